"""End-to-end fixtures: ``lab_factory`` boots lab-in-a-box hosts (tests/lab).

    def test_x(lab_factory):
        lab = lab_factory(["p40", "t4"])          # a started Lab with these boxes booted
        lab.deploy("deploy/full.py").assert_ok()

Labs made by one factory live until the end of the test module (boxes are cheap to boot but
a module's tests usually build on one converge), and are torn down even when a test fails.
Every test here is skipped, with the reason, only when the machine cannot run boxes at all
(not root, or systemd-nspawn / debootstrap / ssh missing); CI installs them (see .ci/run).
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from tests.lab import BoxSpec, Lab, requirements_missing  # noqa: E402


def pytest_collection_modifyitems(config, items):
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.e2e)


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


@pytest.fixture(scope="module")
def lab_factory(request):
    why = requirements_missing()
    if why:
        pytest.skip(f"lab in a box unavailable: {why}")
    labs: list[Lab] = []
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        # a SIGTERM (CI timeout, `kill`) must still tear the boxes down: make it an interrupt,
        # after which pytest runs the fixture finalizers
        signal.signal(signal.SIGTERM, _interrupt)

    def make(boxes=(), **lab_kwargs) -> Lab:
        lab = Lab(**lab_kwargs)
        labs.append(lab)
        lab.start()
        if boxes:
            lab.boot([BoxSpec.of(b) for b in boxes])
        return lab

    yield make
    errors = []
    for lab in reversed(labs):
        try:
            lab.close()
        except Exception as exc:   # noqa: BLE001 - report every lab's teardown problem
            errors.append(str(exc))
    if errors:
        raise RuntimeError("; ".join(errors))
