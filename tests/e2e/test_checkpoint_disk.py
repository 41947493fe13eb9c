"""The checkpoint disk check on lab-in-a-box hosts: a box whose checkpoint folder is a filesystem
too small for the plan's saves and export fails the training stage, with the numbers and the
fix, before the stage changes anything there; the other box goes on; a re-run changes nothing;
with the small filesystem gone the same box converges.

Real: pyinfra over SSH, the CheckpointDisk fact's df/du on the box, the plan's prediction for the
stand-in P40 (the real Qwen2.5-0.5B shape: a PPO save of 11.6 GiB), the train stage's refusal
(tasks.failure.fail_host) and the launcher's preflight as the train user. The small disk is a
64 MiB tmpfs mounted inside the box on /opt/verl-lab/train/checkpoints: it lives in the box's own
mount namespace, is unmounted at the end of the module, and goes with the box in any case. The
other box's checkpoint folder is on the test machine's disk, which must have the plan's need free
(about 26 GiB) for it to go on.
"""

from __future__ import annotations

import pytest

from tests.lab import BoxSpec

TRAIN = "/opt/verl-lab/train"
CKPT = f"{TRAIN}/checkpoints"
UNIT = "/etc/systemd/system/verl-lab-train.service"
TIGHT, ROOMY = "tight", "p40"


@pytest.fixture(scope="module")
def lab(lab_factory):
    lab = lab_factory([ROOMY, BoxSpec(TIGHT, gpu="p40")])
    box = lab.box(TIGHT)
    box.ssh(f"mkdir -p {CKPT} && mount -t tmpfs -o size=64m,mode=755 verl-lab-test-small {CKPT}")
    yield lab
    box.ssh(f"umount {CKPT} 2>/dev/null; true", check=False)


@pytest.fixture(scope="module")
def first(lab):
    return lab.deploy("deploy/train.py", hosts=[ROOMY, TIGHT], timeout=900)


def test_the_small_disk_fails_its_box_with_the_numbers_and_the_other_goes_on(lab, first):
    assert first.failed_hosts == [TIGHT], first.tail()
    said = next((line for line in first.output.splitlines() if "verl-lab train: " in line), first.tail())
    assert f"verl-lab train: {CKPT} has 64.0 MiB free, this run needs 26.0 GiB there: 2 saves of 11.6 GiB " \
           "(1 kept whole + 1 being written) + the export 1.2 GiB" in said, said
    assert "Fix: free 26.0 GiB more there, or put lab_root on a larger disk" in said, said
    roomy = lab.box(ROOMY)
    assert first.changed_by_host[ROOMY] > 0 and roomy.exists(f"{TRAIN}/plan.json") and roomy.exists(UNIT)


def test_nothing_of_the_training_stage_changed_on_the_small_box(lab, first):
    box = lab.box(TIGHT)
    for path in (f"{TRAIN}/plan.json", f"{TRAIN}/train-launcher", f"{TRAIN}/train.env", f"{TRAIN}/work",
                 f"{TRAIN}/verl_lab_checkpoints.py", UNIT, "/opt/verl-lab/markers/train.done"):
        assert not box.exists(path), path
    # the folders as the test left them: the stage would make them 750 and the train user's
    assert box.stat(TRAIN) == ("755", "root", "root")
    assert box.stat(CKPT) == ("755", "root", "root")
    stage_ops = ("Training plan", "Training launcher", "Training environment", "Unit ", "GPU reader",
                 "Checkpoint disk check", "Prove the unit", f"Directory {TRAIN}")
    assert not [op for host, op in first.changed_ops if host == TIGHT and op.startswith(stage_ops)], \
        first.changed_ops


def test_the_fact_reads_the_small_filesystem_as_recorded(lab, first):
    """The CheckpointDisk fact's command on the box gives the recorded case's answer
    (tests/fixtures/facts/disk.CheckpointDisk/small_filesystem.json holds this box's output)."""
    import json
    from pathlib import Path

    from tasks.facts.disk import CheckpointDisk

    case = json.loads((Path(__file__).resolve().parents[1] / "fixtures" / "facts" / "disk.CheckpointDisk"
                       / "small_filesystem.json").read_text())
    printed = lab.box(TIGHT).ssh(CheckpointDisk().command(CKPT)).stdout.splitlines()
    assert printed == case["output"], printed
    assert CheckpointDisk().process(printed) == case["fact"]


def test_a_rerun_changes_nothing(lab, first):
    again = lab.deploy("deploy/train.py", hosts=[ROOMY, TIGHT], timeout=900)
    assert again.failed_hosts == [TIGHT] and again.changed == 0, (again, again.changed_ops)
    assert "this run needs 26.0 GiB there" in again.output


def test_the_launchers_preflight_refuses_the_same_disk(lab, first):
    """The roomy box's launcher, pointed at a plan whose checkpoint folder is a small filesystem,
    fails its disk check with the same numbers (as the train user)."""
    box = lab.box(ROOMY)
    small = "/opt/verl-lab/small-checkpoints"
    box.ssh(f"mkdir -p {small} && mount -t tmpfs -o size=64m,mode=777 verl-lab-test-small {small}")
    try:
        box.ssh(f"python3 -c \"import json; p = json.load(open('{TRAIN}/plan.json')); "
                f"p['launch']['checkpoints']['dir'] = '{small}'; "
                f"json.dump(p, open('{small}/plan.json', 'w'))\"")
        out = box.ssh(f"/usr/bin/python3 {TRAIN}/train-launcher --check --plan {small}/plan.json", user="verl",
                      check=False)
    finally:
        box.ssh(f"umount {small}; rmdir {small}", check=False)
    assert out.returncode == 1
    assert f"FAIL  checkpoint disk: {small} has " in out.stdout and "this run needs 26.0 GiB there" in out.stdout
    assert "checkpoint disk" in out.stderr        # named among the failed checks
    ok = box.ssh(f"/usr/bin/python3 {TRAIN}/train-launcher --check", user="verl", check=False)
    assert "ok    checkpoint disk: " in ok.stdout and f"free under {CKPT} >= 26.0 GiB" in ok.stdout


def test_without_the_small_filesystem_the_box_converges(lab, first):
    box = lab.box(TIGHT)
    box.ssh(f"umount {CKPT}")
    res = lab.deploy("deploy/train.py", hosts=[TIGHT], timeout=900)
    res.assert_ok()
    assert box.exists(f"{TRAIN}/plan.json") and box.stat(CKPT)[1:] == ("verl", "verl")
