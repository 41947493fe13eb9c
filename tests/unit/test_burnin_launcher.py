"""``train-launcher --burnin`` (verl_lab_box/burnin.py), run here on a train dir placed as the train and burn-in stages
place it (tests/unit/test_train_launcher.py's T4 box, plus tasks/burnin/stage.py's files).

Plumbing: verl's run is the stand-in driver tests/fixtures/standin_burnin_driver.py (what the probe and the reward
write, and a save), the export and the weights check are recording stand-ins, and where the test needs the preflight
to pass its part is a stand-in that passes (this machine has no /dev/nvidia*: the real preflight fails, which one
test shows). What it shows: refusals (no burn-in plan; the training unit running), a box that cannot train fails
cleanly in its preflight and runs nothing, the two verl runs and their overrides (the save, then the resume), the
record and its verdicts for each way the stand-in's steps go (rises; flat; NaN; out of memory; no save), the
doctor's reason printed, its saves removed and the run's checkpoints untouched. What the real verl writes is
tests/unit/test_burnin_learning.py's (CPU) and bench/gpu's (GPU).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tasks.burnin.plan import BurninSpec, burnin_paths, burnin_plan
from tasks.burnin.stage import burnin_wanted
from tests.unit.test_train_launcher import box, make_data, make_env  # noqa: F401 - the fixture

REPO = Path(__file__).resolve().parents[2]
DRIVER = REPO / "tests" / "fixtures" / "standin_burnin_driver.py"
EXPORT = """\
import json, os, sys
args = dict(zip(sys.argv[1::2], sys.argv[2::2]))
with open(os.environ["RECORD"], "a") as fh:
    fh.write(json.dumps({"export": sys.argv[1:]}) + "\\n")
with open(os.path.join(args["--checkpoint-dir"], "global_step_" + args["--step"], "hf.proof.json"), "w") as fh:
    json.dump({"merge_seconds": 1.0, "proof_seconds": 2.0, "export_bytes": 1000}, fh)
"""
WEIGHTS = """\
import json, sys
print(json.dumps({"id": "weights", "ok": True, "words": "stand-in: moved", "versions": {"torch": "2.6.0"}}))
"""
PASSING_PREFLIGHT = """\
def preflight(launch, extra=()):
    print("verl-lab preflight passed on " + launch.host, flush=True)
    return 0
"""


@pytest.fixture
def burnin(box):  # noqa: F811
    """The box with the burn-in's files placed; returns (launch(*args, **env), calls(), paths)."""
    make_env(box, torch_cuda=True)
    make_data(box)
    layout = box["layout"]
    bp = burnin_plan(layout.plan, layout.train_dir, "box1", BurninSpec())
    for want in burnin_wanted(layout, json.dumps(bp)):
        path = Path(want.path)
        if not want.path.startswith(layout.train_dir):
            continue                                     # the unit, under /etc/systemd
        if want.is_dir:
            path.mkdir(parents=True, exist_ok=True)
        else:
            path.write_bytes(want.content)
    train = Path(layout.train_dir)
    shutil.copy(DRIVER, train / "verl_lab_burnin_driver.py")
    (train / "verl_lab_export.py").write_text(EXPORT)
    (train / "verl_lab_burnin_weights.py").write_text(WEIGHTS)
    systemctl = box["bin"] / "systemctl"
    systemctl.write_text("#!/bin/sh\n[ -n \"$TRAINING\" ] && printf 'active\\nrunning\\n' || printf 'inactive\\ndead\\n'\n")
    systemctl.chmod(0o755)
    Path(layout.checkpoint_dir).mkdir(parents=True, exist_ok=True)
    (Path(layout.checkpoint_dir) / "latest_checkpointed_iteration.txt").write_text("7")   # the run's: untouched
    record = box["tmp"] / "record.jsonl"

    def launch(*args, preflight_passes=True, **env):
        if preflight_passes:
            (train / "verl_lab_preflight.py").write_text(PASSING_PREFLIGHT)
        env = {"PATH": f"{box['bin']}:/usr/bin:/bin", "HOME": str(box["tmp"]), "RECORD": str(record), **env}
        return subprocess.run([sys.executable, str(box["launcher"]), "--burnin", *args], capture_output=True,
                              text=True, env=env, timeout=120)

    def calls():
        return [json.loads(line) for line in record.read_text().splitlines()] if record.exists() else []

    return launch, calls, burnin_paths(layout.train_dir), layout


def _record(paths) -> dict:
    return json.loads(Path(paths["record"]).read_text())


def test_without_its_plan_it_says_which_deploy_places_it(burnin):
    launch, calls, paths, _ = burnin
    Path(paths["plan"]).unlink()
    out = launch()
    assert out.returncode == 2 and "run deploy/burnin.py" in out.stderr and calls() == []


def test_it_refuses_to_run_beside_the_training_unit(burnin):
    launch, calls, paths, _ = burnin
    out = launch(TRAINING="1")
    assert out.returncode == 3, out.stderr
    assert "refused: the training unit verl-lab-train.service is active (running)" in out.stderr
    assert calls() == [] and not Path(paths["record"]).exists()


def test_a_box_that_cannot_train_fails_in_its_preflight_and_runs_nothing(burnin):
    launch, calls, paths, layout = burnin
    out = launch(preflight_passes=False)           # the real preflight: no /dev/nvidia* on this machine
    assert out.returncode == 1, out.stdout + out.stderr
    record = _record(paths)
    assert record["state"] == "failed" and record["failed"] == ["preflight"]
    assert "no usable CUDA device" in record["checks"][0]["words"]
    assert "verl-lab burn-in: FAIL preflight: this box cannot train now" in out.stderr
    assert calls() == []                              # no verl run, no export
    assert (Path(layout.checkpoint_dir) / "latest_checkpointed_iteration.txt").read_text() == "7"


def test_it_runs_verl_twice_resumes_exports_and_passes(burnin):
    launch, calls, paths, layout = burnin
    out = launch()
    assert out.returncode == 0, out.stdout + out.stderr
    first, second, export = calls()
    for run in (first, second):
        args = run["driver"]
        assert f"trainer.default_local_dir={paths['folder']}/checkpoints" in args
        assert "trainer.logger=['console']" in args and "reward_model.reward_manager=verl_lab_burnin" in args
        assert sum(a.startswith("trainer.default_local_dir=") for a in args) == 1    # the plan's replaced
        assert run["probe"] == paths["probe"]
    assert "trainer.total_training_steps=2" in first["driver"] and "trainer.resume_mode=disable" in first["driver"]
    assert "trainer.total_training_steps=5" in second["driver"] and "trainer.resume_mode=auto" in second["driver"]
    assert export["export"][-2:] == ["--step", "5"]
    record = _record(paths)
    assert record["state"] == "passed" and record["failed"] == [], record["checks"]
    ids = {c["id"]: c["ok"] for c in record["checks"]}
    assert ids == {"reward": True, "nan-inf": True, "memory": True, "speed": None, "save": True, "resume": True,
                   "weights": True, "export": True}
    assert (record["reward"]["first"], record["reward"]["last"]) == (0.5, 0.57)
    assert [s["step"] for s in record["steps"]] == [1, 2, 3, 4, 5]
    assert record["speed"]["seconds_per_step"] == 13.67       # steps 2, 4 and 5: not a run's first
    assert record["versions"] == {"torch": "2.6.0"}
    assert not Path(paths["folder"], "checkpoints").exists()  # its saves go after the record
    assert (Path(layout.checkpoint_dir) / "latest_checkpointed_iteration.txt").read_text() == "7"


def test_it_makes_its_folder_where_nothing_placed_it(burnin):
    """The GPU harness's lab_root has no burn-in folder (the stage makes it on a box): the burn-in makes it itself
    (GPU call 17's first try failed at its first record write). Mutation: the makedirs dropped: FileNotFoundError."""
    launch, calls, paths, layout = burnin
    shutil.rmtree(paths["folder"])
    out = launch()
    assert out.returncode == 0, out.stdout + out.stderr
    assert _record(paths)["state"] == "passed"


def test_keep_leaves_its_saves(burnin):
    launch, _, paths, _ = burnin
    assert launch("--keep").returncode == 0
    assert Path(paths["folder"], "checkpoints", "global_step_5", "hf.proof.json").is_file()


@pytest.mark.parametrize("mode, reason", [("flat", "reward-flat"), ("nan", "nan-inf"), ("oom", "oom"),
                                          ("nosave", "save-failed")])
def test_each_failure_is_recorded_with_the_doctors_reason(burnin, mode, reason):
    launch, calls, paths, _ = burnin
    out = launch(STANDIN_BURNIN=mode)
    assert out.returncode == 1, out.stdout + out.stderr
    record = _record(paths)
    assert record["state"] == "failed" and reason in record["failed"], record["checks"]
    assert f"verl-lab burn-in: FAIL {reason}:" in out.stderr
    if mode == "oom":       # verl stopped: learning and speed are not judged, the cause is the finding
        assert record["failed"] == ["oom"] and len(calls()) == 1
        assert next(c for c in record["checks"] if c["id"] == "reward-flat")["ok"] is None
