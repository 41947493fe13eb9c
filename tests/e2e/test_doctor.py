"""The doctor on lab boxes: a training unit that fails is diagnosed by name.

One box (a stand-in T4) is given a plan forced for a bigger GPU (gpu_override: an 80 GB A100);
its unit is started and the launcher's preflight refuses to train. deploy/doctor.py then reads
the unit's journal and plan.json over SSH and must name the causes. A second box, whose unit
was never started, must not be reported as failed.
"""

from __future__ import annotations

import json
import time

import pytest

FORCED = "t4"
QUIET = "rtx3090"
A100 = {"name": "NVIDIA A100-SXM4-80GB", "compute_capability": "8.0", "memory_mib": 81920, "count": 1}
UNIT = "verl-lab-train.service"


@pytest.fixture(scope="module")
def lab(lab_factory):
    return lab_factory([FORCED, QUIET])


@pytest.fixture(scope="module")
def failed_unit(lab):
    res = lab.deploy("deploy/train.py", per_host={FORCED: {"gpu_override": A100, "train_unit_state": "started"}})
    # the stage waits for the unit to get past its preflight: it does not, so that box fails
    assert res.failed_hosts == [FORCED], res.tail()
    box = lab.box(FORCED)
    for _ in range(60):  # the unit starts, the preflight fails, systemd records the failure
        state = box.ssh(f"systemctl show -p Result --value {UNIT}; systemctl is-failed {UNIT} || true").stdout
        if "exit-code" in state or "failed" in state:
            break
        time.sleep(1)
    return state


def doctor(lab, tmp_path_factory):
    path = tmp_path_factory.mktemp("doctor") / "lab.json"
    res = lab.deploy("deploy/doctor.py", data={"doctor_json": str(path)}, mode="text")
    assert f"doctor's reports of 2 hosts: {path}" in res.output, res.tail()
    reports = {r["host"]: r for r in json.loads(path.read_text())["hosts"]}     # JSON on its own, in a file
    return res, reports


def test_failed_unit_is_diagnosed_by_name(lab, failed_unit, tmp_path_factory):
    assert "exit-code" in failed_unit or "failed" in failed_unit, failed_unit
    res, reports = doctor(lab, tmp_path_factory)
    assert res.rc == 0 and res.changed == 0, res.tail()  # the doctor changes nothing
    forced = reports[FORCED]
    rules = {f["rule"] for f in forced["findings"]}
    assert forced["failed"]
    assert {"plan-gpu-mismatch", "gpu-memory-short"} <= rules, forced
    mismatch = next(f for f in forced["findings"] if f["rule"] == "plan-gpu-mismatch")
    assert "NVIDIA A100-SXM4-80GB" in " ".join(mismatch["evidence"]) and "gpu_override" in mismatch["fix"]
    # the box also has no env, no data and no NVIDIA kernel driver: each is named too
    assert {"stage-not-finished", "no-cuda-device"} <= rules, rules


def test_unit_that_never_ran_is_said_so_with_what_its_preflight_says(lab, failed_unit, tmp_path_factory):
    """The quiet box's unit was installed, never started: not a failure of the unit, but the doctor
    says it never ran and what the launcher's preflight (run as the train user) would stop on:
    this box has no env and no data."""
    res, reports = doctor(lab, tmp_path_factory)
    quiet = reports[QUIET]
    assert not quiet["failed"] and quiet["findings"] == [], quiet
    assert quiet["unit"] == "never-ran"
    assert "stage-not-finished" in {f["rule"] for f in quiet["preflight"]["findings"]}, quiet["preflight"]
    assert "FAIL" in quiet["preflight"]["output"]
    assert reports[FORCED]["unit"] in ("failed", "crash-looping")
    assert "unit: never ran (installed, never started); the launcher's preflight says:" in res.output
    # the headline says it: never ran, its preflight fails (not "no failure found")
    assert quiet["verdict"] == "never ran: preflight fails" and f"== {QUIET}: never ran: preflight fails" in res.output
    assert reports[FORCED]["verdict"] == "failed" and "no failure found" not in res.output


def test_text_report_names_host_cause_and_fix(lab, failed_unit):
    res = lab.deploy("deploy/doctor.py", mode="text")
    assert f"== {FORCED}: failed" in res.output
    assert "[plan-gpu-mismatch]" in res.output and "fix: re-run deploy/train.py" in res.output
