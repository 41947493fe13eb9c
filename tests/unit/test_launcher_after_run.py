"""What the training launcher does when verl ends (verl_lab_box/train_launcher.py ``train``,
verl_lab_box/after_run.py ``after_run``), run here on a train dir placed as the stage places it.

Plumbing: verl's trainer, the export program and the score program are replaced by recording
stand-ins (the real export and score are tests/unit/test_export.py's and test_gsm8k_score.py's,
and the whole chain runs on a lab box in tests/e2e/test_export.py). What this shows: a run that
verl ends by itself with status 0 is recorded as finished, exported with ``--final`` and scored
(the base model, then the export) with plan.json's evaluation settings; a failed run is neither;
a run stopped by SIGTERM ends the launcher by SIGTERM without an export, whatever verl's status;
a finished run started again trains no step; an export or score that fails ends the launcher
with AFTER_RUN_FAILED (70, which the unit does not restart on); ``--export`` on demand is not final.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.unit.test_train_launcher import box, make_env  # noqa: F401 - the fixture

STEP = 3
MAIN_PPO = """\
import json, os, sys, time
ckpt = next(a.split("=", 1)[1] for a in sys.argv if a.startswith("trainer.default_local_dir="))
with open(os.environ["RECORD"], "a") as fh:
    fh.write(json.dumps({"main_ppo": sys.argv[1:]}) + "\\n")
mode = os.environ.get("MAIN_PPO", "finish")
if mode == "sleep":
    print("training", flush=True)
    time.sleep(60)
os.makedirs(ckpt, exist_ok=True)
with open(os.path.join(ckpt, "latest_checkpointed_iteration.txt"), "w") as fh:
    fh.write("@STEP@")
sys.exit(1 if mode == "fail" else 0)
""".replace("@STEP@", str(STEP))
RECORDER = """\
import json, os, sys
with open(os.environ["RECORD"], "a") as fh:
    fh.write(json.dumps({"%s": sys.argv[1:]}) + "\\n")
if os.environ.get("FAIL") == "%s":
    sys.exit(1)
if "--out" in sys.argv:
    args = dict(zip(sys.argv[1::2], sys.argv[2::2]))
    os.makedirs(os.path.dirname(args["--out"]), exist_ok=True)
    with open(args["--out"], "w") as fh:
        json.dump({"accuracy": 0.25 if args["--label"] == "base" else 0.5, "rows": 12}, fh)
"""


@pytest.fixture
def run(box):  # noqa: F811
    """The launcher with a stand-in verl trainer, export and score; returns (run, record, layout)."""
    make_env(box, torch_cuda=True)
    site = box["tmp"] / "site"
    (site / "verl" / "trainer").mkdir()
    (site / "verl" / "trainer" / "__init__.py").write_text("")
    (site / "verl" / "trainer" / "main_ppo.py").write_text(MAIN_PPO)
    train = Path(box["layout"].train_dir)
    (train / "verl_lab_export.py").write_text(RECORDER % ("export", "export"))
    (train / "verl_lab_score.py").write_text(RECORDER % ("score", "score"))
    Path(box["layout"].checkpoint_dir).mkdir(parents=True, exist_ok=True)
    record = box["tmp"] / "record.jsonl"

    def launch(*args, **env):
        env = {"PATH": f"{box['bin']}:/usr/bin:/bin", "HOME": str(box["tmp"]), "RECORD": str(record), **env}
        return subprocess.run([sys.executable, str(box["launcher"]), *args], capture_output=True, text=True, env=env,
                              timeout=120)

    def calls():
        return [json.loads(line) for line in record.read_text().splitlines()] if record.exists() else []

    return launch, calls, box["layout"]


def _value(args, flag):
    return args[args.index(flag) + 1]


def test_a_finished_run_is_exported_and_scored_base_then_trained(run):
    launch, calls, layout = run
    out = launch("--no-preflight")
    assert out.returncode == 0, out.stdout + out.stderr
    (trainer,), exports, scores = ([c[k] for c in calls() if k in c] for k in ("main_ppo", "export", "score"))
    ckpt = layout.checkpoint_dir
    ram = json.loads(Path(layout.plan_file).read_text())["launch"]["checkpoints"]["export_host_ram"]
    assert exports == [["--checkpoint-dir", ckpt, "--step", str(STEP), "--host-ram-mib", str(ram["gpu_free_mib"]),
                        "--final"]]
    base, trained = scores
    ev = json.loads(Path(layout.plan_file).read_text())["launch"]["evaluation"]
    for args in (base, trained):
        assert (_value(args, "--engine"), _value(args, "--dtype"), _value(args, "--batch")) == \
            (ev["engine"], ev["dtype"], str(ev["batch"]))
        assert _value(args, "--data") == ev["test_file"] and _value(args, "--vllm-share") == str(ev["vllm_gpu_memory_utilization"])
    assert (_value(base, "--model"), _value(base, "--label"), "--final" in base) == (layout.settings.model_dir, "base", False)
    assert _value(base, "--out") == f"{ckpt}/gsm8k-base.json"
    assert (_value(trained, "--model"), _value(trained, "--out"), "--final" in trained) == \
        (f"{ckpt}/global_step_{STEP}/hf", f"{ckpt}/global_step_{STEP}/hf.gsm8k.json", True)
    assert "GSM8K 0.2500 (base) -> 0.5000 (step 3)" in out.stdout
    finished = json.loads((Path(ckpt) / "run-finished.json").read_text())
    assert finished["step"] == STEP

    again = launch("--no-preflight")          # the unit started again: no step trained, the export re-checked
    assert again.returncode == 0 and "no step is trained again" in again.stdout
    assert len([c for c in calls() if "main_ppo" in c]) == 1 and len([c for c in calls() if "export" in c]) == 2
    other = launch("--no-preflight", "--", "trainer.total_training_steps=9")   # other overrides: it trains
    assert other.returncode == 0 and len([c for c in calls() if "main_ppo" in c]) == 2


def test_a_failed_run_is_neither_finished_nor_exported(run):
    launch, calls, layout = run
    out = launch("--no-preflight", MAIN_PPO="fail")
    assert out.returncode == 1 and "verl exited 1: the run failed" in out.stderr
    assert [k for c in calls() for k in c] == ["main_ppo"]
    assert not (Path(layout.checkpoint_dir) / "run-finished.json").exists()


def test_a_stopped_run_ends_by_its_signal_and_exports_nothing(run, box):  # noqa: F811
    launch, calls, layout = run
    env = {"PATH": f"{box['bin']}:/usr/bin:/bin", "HOME": str(box["tmp"]), "RECORD": str(box["tmp"] / "record.jsonl"),
           "MAIN_PPO": "sleep"}
    proc = subprocess.Popen([sys.executable, str(box["launcher"]), "--no-preflight"], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while not any("main_ppo" in c for c in calls()) and time.monotonic() < deadline:
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)                  # what systemctl stop sends the unit's main process
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGTERM, err
    assert "stopped by signal 15" in err and "nothing is exported" in err
    assert [k for c in calls() for k in c] == ["main_ppo"]
    assert not (Path(layout.checkpoint_dir) / "run-finished.json").exists()


@pytest.mark.parametrize("failing", ["export", "score"])
def test_a_failed_export_or_score_ends_with_the_status_the_unit_does_not_restart_on(run, failing):
    launch, calls, _ = run
    out = launch("--no-preflight", FAIL=failing)
    assert out.returncode == 70, out.stdout + out.stderr
    unit = (Path(__file__).resolve().parents[2] / "files" / "templates" / "verl-lab-train.service.j2").read_text()
    assert "RestartPreventExitStatus=70" in unit
    assert len([c for c in calls() if "score" in c]) == (0 if failing == "export" else 1)


def test_export_on_demand_is_not_final_and_no_export_skips_it(run):
    launch, calls, layout = run
    out = launch("--no-preflight", "--no-export")
    assert out.returncode == 0 and [k for c in calls() for k in c] == ["main_ppo"]
    Path(layout.checkpoint_dir, "run-finished.json").unlink()          # as if the run were still going
    out = launch("--export")
    assert out.returncode == 0, out.stdout + out.stderr
    exports = [c["export"] for c in calls() if "export" in c]
    trained = [c["score"] for c in calls() if "score" in c][-1]
    ram = json.loads(Path(layout.plan_file).read_text())["launch"]["checkpoints"]["export_host_ram"]
    assert exports == [["--checkpoint-dir", layout.checkpoint_dir, "--step", str(STEP), "--host-ram-mib",
                        str(ram["gpu_busy_mib"])]] and "--final" not in trained     # beside training: the larger
    assert "(step 3, not final)" in out.stdout
    out = launch("--export", "--no-score")
    assert out.returncode == 0 and len([c for c in calls() if "score" in c]) == 2
