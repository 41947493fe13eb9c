"""How each box is doing (deploy/status.py) on three lab boxes in different states, and a training
stage that waits for its unit to get past the launcher's preflight.

- ``fresh``: never provisioned;
- ``broken``: the training stage ran (unit installed, enabled, never started), then its env
  broke (the env marker is there, the env it points at is gone);
- ``looping``: the training stage ran with ``train_unit_state=started``; the launcher's
  preflight fails (no env, no data, no NVIDIA kernel driver in a box), so the unit crash-loops.

Proven here: the training stage fails that box only, with the doctor's verdict, where it used
to report success; every row says the state of its box. Not proven here: a row of a box that
trains (no box can get past the preflight without a GPU: the step/score columns are read from a
real GPU log in tests/unit/test_status.py).
"""

from __future__ import annotations

import json
import re

import pytest

from tests.lab import BoxSpec

FRESH, BROKEN, LOOPING = "fresh", "broken", "looping"
ENV = "/opt/verl-lab/envs/verl"


@pytest.fixture(scope="module")
def lab(lab_factory):
    return lab_factory([BoxSpec(FRESH, gpu="t4"), BoxSpec(BROKEN, gpu="p40"), BoxSpec(LOOPING, gpu="t4")])


@pytest.fixture(scope="module")
def trained(lab):
    res = lab.deploy("deploy/train.py", hosts=[BROKEN, LOOPING], per_host={LOOPING: {"train_unit_state": "started"}},
                     mode="text")
    box = lab.box(BROKEN)
    box.ssh(f"mkdir -p /opt/verl-lab/markers /opt/verl-lab/envs && ln -sfn verl.gen1 {ENV} && "
            "printf 'generation=verl.gen1\\nstamp=0123456789abcdef\\n' > /opt/verl-lab/markers/env.done")
    return res


def test_started_unit_that_stops_in_its_preflight_fails_that_box_only(trained):
    assert trained.failed_hosts == [LOOPING], trained.tail()
    out = trained.output
    assert "verl-lab train: verl-lab-train.service did not start training" in out, trained.tail()
    assert "[stage-not-finished]" in out and "fix:" in out, trained.tail()
    # its summary line says what the unit does, not what was asked of it (issue 44: not "unit started")
    line = next(ln for ln in out.splitlines() if ln.startswith(f"verl-lab: {LOOPING} ("))
    assert "train FAILED; FAILED (see above)" in line and "unit started" not in line, line
    assert re.search(r"unit (crash-looping|failed), not training \(", line), line


def test_a_second_started_deploy_fails_again_not_silently(lab, trained):
    res = lab.deploy("deploy/train.py", hosts=[LOOPING], data={"train_unit_state": "started"}, mode="text")
    assert res.failed_hosts == [LOOPING] and "did not start training" in res.output, res.tail()


@pytest.fixture(scope="module")
def status(lab, trained, tmp_path_factory):
    out = tmp_path_factory.mktemp("status")
    res = lab.deploy("deploy/status.py", data={"status_json": str(out / "lab.json"), "status_plots": str(out / "png")},
                     mode="text")
    rows = {r["host"]: r for r in json.loads((out / "lab.json").read_text())["hosts"]}
    return res, rows


def test_status_changes_nothing_and_prints_a_row_per_box(status):
    res, rows = status
    assert res.rc == 0 and res.changed == 0, res.tail()
    assert sorted(rows) == [BROKEN, FRESH, LOOPING]
    table = [line for line in res.output.splitlines() if line.split(" ", 1)[0] in rows]
    assert len(table) == 3, res.tail()
    assert "plots: none (no box has finished a step)" in res.output


def test_never_provisioned_box(status):
    row = status[1][FRESH]
    assert row["stages"] == [] and row["unit"] == "not-installed" and row["step"] == 0


def test_box_whose_env_broke_says_its_unit_never_ran_and_why(status):
    row = status[1][BROKEN]
    assert row["stages"] == ["env", "train"] and row["env_generation"] == "verl.gen1"
    assert row["unit"] == "never-ran", json.dumps(row)
    assert row["verdict"].startswith("the unit never ran; the launcher's preflight says:")
    assert f"{ENV}/bin/python" in row["verdict"] and "FAIL" in row["verdict"], row["verdict"]


def test_crash_looping_box_gets_the_doctors_verdict(status):
    row = status[1][LOOPING]
    assert row["unit"] in ("crash-looping", "failed"), row
    assert "[stage-not-finished]" in row["verdict"] and "fix:" in row["verdict"], row["verdict"]
    assert row["predicted_peak_mib"] and row["peak_mib"] is None
