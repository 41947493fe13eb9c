"""The burn-in (deploy/burnin.py) on a lab box, up to the GPU: the box's training stage ran (deploy/train.py: plan,
launcher, unit), a "real run" has a checkpoint and tracker files, and the burn-in

- places its files and its unit (the training unit's template: same user, environment, sandbox) and starts it;
- says why this box cannot train (its launcher's preflight: no NVIDIA kernel driver in a box, no env, no data) and
  fails that box cleanly: the unit ends, nothing of the train user runs, the run's checkpoint and tracker files are
  as they were, the training unit was never started;
- is refused while the training unit runs (here: crash-looping in its own preflight);
- is shown by deploy/status.py and read by deploy/doctor.py, from the box's record; then from a GPU-shaped record
  (tests/fixtures/burnin/*.json, made by the product's judge: not a GPU run; the lead replaces them with a GPU
  call's) put where the burn-in writes its own: passed with its figures, and a failed one with the doctor's reason.

What a GPU adds (a burn-in that trains) is bench/gpu/run_burnin.sh's.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from tests.lab import BoxSpec

BOX = "p40"
TRAIN = "/opt/verl-lab/train"
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "burnin"
RUN_FILES = f"{TRAIN}/checkpoints /opt/verl-lab/tracking"
LISTING = f"find {RUN_FILES} -printf '%p %s %T@ %u\\n' 2>/dev/null | LC_ALL=C sort"


@pytest.fixture(scope="module")
def lab(lab_factory):
    return lab_factory([BoxSpec(BOX, gpu="p40")])


@pytest.fixture(scope="module")
def trained(lab):
    res = lab.deploy("deploy/train.py", hosts=[BOX], mode="text")
    assert res.rc == 0, res.tail()
    box = lab.box(BOX)
    # the real run's files: a save of step 3 and a tracker's event file, the train user's
    box.ssh(f"runuser -u verl -- sh -c 'mkdir -p {TRAIN}/checkpoints/global_step_3/actor && "
            f"echo 3 > {TRAIN}/checkpoints/latest_checkpointed_iteration.txt && "
            f"head -c 4096 /dev/urandom > {TRAIN}/checkpoints/global_step_3/actor/model_world_size_1_rank_0.pt'; "
            "mkdir -p /opt/verl-lab/tracking/tensorboard && echo event > /opt/verl-lab/tracking/tensorboard/run.tfevents")
    return res


@pytest.fixture(scope="module")
def burned(lab, trained):
    box = lab.box(BOX)
    before = box.ssh(LISTING).stdout
    res = lab.deploy("deploy/burnin.py", hosts=[BOX], mode="text", timeout=900)
    return res, before


def test_the_burnin_says_the_box_cannot_train_and_fails_it(burned):
    res, _ = burned
    assert res.failed_hosts == [BOX], res.tail()
    out = res.output
    assert "verl-lab burn-in FAILED: preflight" in out, res.tail()
    assert "no usable CUDA device" in out, res.tail()


def test_its_unit_is_the_training_units_sandbox(lab, burned):
    box = lab.box(BOX)
    unit = box.read_text("/etc/systemd/system/verl-lab-burnin.service")
    assert f"ExecStart=/usr/bin/python3 {TRAIN}/train-launcher --burnin" in unit and "Restart=no" in unit
    assert box.ssh("systemd-analyze verify /etc/systemd/system/verl-lab-burnin.service", check=False).returncode == 0
    assert box.ssh("systemctl is-enabled verl-lab-burnin.service", check=False).stdout.strip() in ("static", "disabled")
    show = box.ssh("systemctl show -p User -p ProtectSystem -p NoNewPrivileges verl-lab-burnin.service").stdout
    assert "User=verl" in show and "ProtectSystem=strict" in show and "NoNewPrivileges=yes" in show


def test_nothing_is_left_running_and_the_runs_files_are_untouched(lab, burned):
    _, before = burned
    box = lab.box(BOX)
    assert box.ssh("systemctl is-active verl-lab-burnin.service", check=False).stdout.strip() in ("failed", "inactive")
    assert box.ssh("pgrep -u verl", check=False).stdout.strip() == ""
    assert box.ssh(LISTING).stdout == before
    assert box.ssh("systemctl is-active verl-lab-train.service", check=False).stdout.strip() == "inactive"
    journal = box.ssh("journalctl -u verl-lab-train.service -b --no-pager -o cat", check=False).stdout
    assert "Started" not in journal


def test_its_record_lies_in_its_own_folder(lab, burned):
    box = lab.box(BOX)
    record = json.loads(box.read_text(f"{TRAIN}/burnin/burnin.json"))
    assert record["state"] == "failed" and record["failed"] == ["preflight"]
    assert record["gpu"]["name"] == "Tesla P40" and record["plan"]["rung"] == "ppo"
    assert box.stat(f"{TRAIN}/burnin") == ("750", "verl", "verl")
    assert box.stat(f"{TRAIN}/burnin-plan.json")[1] == "root"


def test_refused_while_the_training_unit_runs(lab, burned):
    box = lab.box(BOX)
    box.ssh("systemctl start verl-lab-train.service", check=False)        # its preflight fails: it crash-loops
    try:
        res = lab.deploy("deploy/burnin.py", hosts=[BOX], mode="text", timeout=600)
        assert res.failed_hosts == [BOX], res.tail()
        assert "a burn-in never runs beside the training unit" in res.output, res.tail()
        assert box.ssh("systemctl is-active verl-lab-burnin.service", check=False).stdout.strip() != "active"
    finally:
        box.ssh("systemctl stop verl-lab-train.service; systemctl reset-failed verl-lab-train.service", check=False)


def test_status_and_doctor_show_the_failed_burnin(lab, burned, tmp_path):
    res = lab.deploy("deploy/status.py", hosts=[BOX], data={"status_json": str(tmp_path / "lab.json")}, mode="text")
    assert res.rc == 0 and res.changed == 0, res.tail()
    assert "burn-in: failed" in res.output and "FAIL preflight" in res.output, res.tail()
    row = json.loads((tmp_path / "lab.json").read_text())["hosts"][0]
    assert row["burnin"]["state"] == "failed" and row["burnin"]["failed"] == ["preflight"]
    doc = lab.deploy("deploy/doctor.py", hosts=[BOX], mode="text")
    assert "[burnin-preflight]" in doc.output, doc.tail()


def _put_record(box, name: str) -> None:
    text = (FIXTURES / f"{name}.json").read_text()
    box.ssh(f"runuser -u verl -- sh -c {shlex.quote(f'cat > {TRAIN}/burnin/burnin.json')}", input=text)


def test_status_shows_a_gpu_shaped_passed_burnin_with_its_figures(lab, burned, tmp_path):
    box = lab.box(BOX)
    _put_record(box, "passed")
    res = lab.deploy("deploy/status.py", hosts=[BOX], data={"status_plots": str(tmp_path / "png")}, mode="text")
    line = next((line for line in res.output.splitlines() if "burn-in: passed" in line), "")
    assert "reward 0.502->0.526" in line and "peak 22187/22455 MiB" in line and "s/step" in line, res.tail()
    assert "run ETA" in line
    assert (tmp_path / "png" / f"burnin-{BOX}.png").stat().st_size > 10_000


def test_the_doctor_reads_a_gpu_shaped_failed_burnin(lab, burned):
    box = lab.box(BOX)
    _put_record(box, "failed-reward-fell")
    doc = lab.deploy("deploy/doctor.py", hosts=[BOX], mode="text")
    assert "[burnin-reward-fell]" in doc.output and "the update moves the policy against its advantage" in doc.output, \
        doc.tail()
