# verl-lab developer targets. The lab targets need root (systemd-nspawn, debootstrap).
PYTHON ?= $(shell test -x .venv/bin/python && echo .venv/bin/python || command -v python3)
GPUS ?= p40,t4,rtx3090

.PHONY: lab-up lab-down lab-status lab-plans lint test test-unit test-e2e

lab-up:          ## boot boxes (GPUS=p40,t4,rtx3090) and write .lab/inventory.py
	$(PYTHON) bin/lab up --gpus $(GPUS)

lab-down:        ## stop what lab-up started
	$(PYTHON) bin/lab down

lab-status:
	$(PYTHON) bin/lab status

lab-plans:       ## the training plan each box got (after a deploy)
	$(PYTHON) bin/lab plans

lint:            ## ruff and mypy, as CI runs them before the tests (.ci/lint; docs/testing.md, "Lint and types")
	PYTHON=$(PYTHON) bash .ci/lint

test:            ## everything (the README's test command)
	$(PYTHON) -m pytest -q -n 4 tests

test-unit:       ## no boxes
	$(PYTHON) -m pytest -q tests/unit

test-e2e:        ## lab-in-a-box end-to-end tests only
	$(PYTHON) -m pytest -q tests/e2e
