"""The training launcher's guards around a run's end (verl_lab_box/train_launcher.py ``train``,
verl_lab_box/after_run.py ``after_run``), on a train dir placed as the stage places it, with
recording stand-ins for verl's trainer, the export and the score
(tests/unit/test_launcher_after_run.py's ``run`` fixture):

* a run whose latest checkpoint is at or past its planned last step does not start verl again
  (verl 0.5.0 adds 1 to the step it loads before it checks for the last one: ray_trainer.py
  ``fit``), by ``trainer.total_training_steps`` or by epochs over the data stage's train rows;
* exports whose save verl removed are pruned before verl starts;
* the export is told the host RAM plan.json predicts for it (``--host-ram-mib``: the larger figure
  where training may hold the GPU), which it checks against MemAvailable before it merges, with
  the fix (verl_lab_box/export.py ``ram_short``; the real export's refusal and its skip where the
  export is proven already: tests/unit/test_export.py).

What is real: the launcher, its plan.json, verl_lab_box/checkpoints.py; the stand-ins are the
programs it runs. The lock and the pruning inside the export are tests/unit/test_export.py's (the
real export on verl's own checkpoints) and tests/e2e/test_export.py's.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.unit.test_launcher_after_run import STEP, run  # noqa: F401 - the fixture
from tests.unit.test_train_launcher import box  # noqa: F401 - the fixture
from verl_lab_box import checkpoints as ck


def _tracker(layout, step):
    Path(layout.checkpoint_dir, "latest_checkpointed_iteration.txt").write_text(str(step))
    Path(layout.checkpoint_dir, f"global_step_{step}", "actor").mkdir(parents=True, exist_ok=True)


def test_a_run_at_its_last_step_is_not_started_again(run):  # noqa: F811
    launch, calls, layout = run
    _tracker(layout, STEP)
    out = launch("--no-preflight", "--", f"trainer.total_training_steps={STEP}")
    assert out.returncode == 0, out.stdout + out.stderr
    assert not [c for c in calls() if "main_ppo" in c]                     # verl never started
    assert f"the latest checkpoint (step {STEP}) is at or past the run's last step ({STEP})" in out.stdout
    assert json.loads(Path(layout.checkpoint_dir, "run-finished.json").read_text())["step"] == STEP
    (export,) = [c["export"] for c in calls() if "export" in c]
    assert export[-1] == "--final"                                          # the run is finished at that step
    past = launch("--no-preflight", "--", f"trainer.total_training_steps={STEP - 1}")
    assert past.returncode == 0 and not [c for c in calls() if "main_ppo" in c]
    more = launch("--no-preflight", "--", f"trainer.total_training_steps={STEP + 1}")
    assert more.returncode == 0 and len([c for c in calls() if "main_ppo" in c]) == 1     # one step to go: trains


def test_a_run_by_epochs_stops_at_its_last_step_by_the_train_rows(run):  # noqa: F811
    launch, calls, layout = run
    overrides = json.loads(Path(layout.plan_file).read_text())["launch"]["overrides"]
    o = ck.overrides_dict(o["override"] for o in overrides)
    assert "trainer.total_training_steps" not in o                          # the default plan runs by epochs
    batch, epochs = int(o["data.train_batch_size"]), int(o["trainer.total_epochs"])
    Path(layout.settings.marker("data")).parent.mkdir(parents=True, exist_ok=True)
    Path(layout.settings.marker("data")).write_text(f"digest=x\ntrain_rows={batch * 2 + 1}\n")
    last = 2 * epochs
    _tracker(layout, last)
    out = launch("--no-preflight")
    assert out.returncode == 0 and not [c for c in calls() if "main_ppo" in c], out.stdout + out.stderr
    assert f"at or past the run's last step ({last})" in out.stdout
    Path(layout.settings.marker("data")).write_text(f"digest=x\ntrain_rows={batch * 3}\n")   # more data: trains
    Path(layout.checkpoint_dir, "run-finished.json").unlink()
    assert launch("--no-preflight").returncode == 0 and [c for c in calls() if "main_ppo" in c]


def test_exports_of_removed_saves_are_pruned_before_verl_starts(run):  # noqa: F811
    launch, calls, layout = run
    gone = Path(layout.checkpoint_dir, "global_step_1")
    (gone / "hf").mkdir(parents=True)
    (gone / "hf" / "model.safetensors").write_bytes(os.urandom(4096))
    (gone / "hf.proof.json").write_text("{}")
    kept = Path(layout.checkpoint_dir, "global_step_2")
    (kept / "actor").mkdir(parents=True)
    (kept / "hf").mkdir()
    out = launch("--no-preflight")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "verl-lab: pruned the export of step 1" in out.stdout
    assert not (gone / "hf").exists() and not (gone / "hf.proof.json").exists() and (kept / "hf").is_dir()


def _meminfo(tmp_path, available_mib):
    path = tmp_path / "meminfo"
    path.write_text(f"MemTotal:       {64 * 2 ** 20} kB\nMemFree:        1000 kB\n"
                    f"MemAvailable:   {available_mib * 1024} kB\n")
    return str(path)


def test_the_export_is_told_the_host_ram_the_plan_predicts(run):  # noqa: F811
    """After the unit's own run (training released the GPU) the smaller figure; on demand (training
    may hold the GPU, so the proof's model is in host RAM) the larger; none in a plan without it."""
    launch, calls, layout = run
    ram = json.loads(Path(layout.plan_file).read_text())["launch"]["checkpoints"]["export_host_ram"]
    assert ram["gpu_busy_mib"] > ram["gpu_free_mib"] > 4000                 # the 0.5B plan's prediction
    assert launch("--no-preflight").returncode == 0
    assert launch("--export").returncode == 0
    after, on_demand = [c["export"] for c in calls() if "export" in c]
    assert after[after.index("--host-ram-mib") + 1] == str(ram["gpu_free_mib"])
    assert on_demand[on_demand.index("--host-ram-mib") + 1] == str(ram["gpu_busy_mib"])
    plan = json.loads(Path(layout.plan_file).read_text())
    plan["launch"]["checkpoints"]["export_host_ram"] = None
    Path(layout.plan_file).write_text(json.dumps(plan))
    assert launch("--export").returncode == 0
    assert "--host-ram-mib" not in [c["export"] for c in calls() if "export" in c][-1]


def test_the_export_refuses_a_box_short_of_host_ram_with_the_fix(tmp_path):
    from verl_lab_box import export

    short = export.ram_short(6775, 3, _meminfo(tmp_path, 6774))
    assert short.startswith("step 3's export needs about 6775 MiB of host RAM") and "has 6774 MiB available" in short
    assert 'stop training first (train_unit_state = "stopped"' in short and "global_step_3/actor copied there" in short
    assert export.ram_short(6775, 3, _meminfo(tmp_path, 6775)) is None
    assert export.ram_short(None, 3, _meminfo(tmp_path, 1)) is None


@pytest.mark.parametrize("change, proven", [(None, True), ("delete", False), ("grow", False), ("shard", False),
                                            ("format", False)])
def test_an_export_is_proven_only_while_its_files_bear_the_proof_out(tmp_path, change, proven):
    step = tmp_path / "global_step_2"
    (step / "actor").mkdir(parents=True)
    (step / "actor" / "model_world_size_1_rank_0.pt").write_bytes(b"w")
    (step / "hf").mkdir()
    (step / "hf" / "model.safetensors").write_bytes(b"m" * 10)
    proof = {"format": ck.EXPORT_FORMAT, "ok": True, "shards": ck.shard_identity(str(step / "actor")),
             "files": ck.folder_identity(str(step / "hf"))}
    if change == "format":
        proof["format"] += 1
    (step / "hf.proof.json").write_text(json.dumps(proof))
    if change == "delete":
        (step / "hf" / "model.safetensors").unlink()
    elif change == "grow":
        (step / "hf" / "model.safetensors").write_bytes(b"m" * 11)
    elif change == "shard":
        (step / "actor" / "model_world_size_1_rank_0.pt").write_bytes(b"ww")
    assert (ck.proven_export(str(tmp_path), 2) is not None) is proven


@pytest.mark.parametrize("change", [None, "delete", "grow"])
def test_the_status_fact_reads_an_export_from_its_files(tmp_path, change):
    """tasks.facts.export.RunExports' command run here by sh: the proof counts only while hf/ holds
    the files it lists."""
    import subprocess

    from tasks.facts.export import RunExports

    step = tmp_path / "global_step_2"
    (step / "hf" / "sub").mkdir(parents=True)
    (step / "hf" / "model.safetensors").write_bytes(b"m" * 10)
    (step / "hf" / "sub" / "a b.json").write_bytes(b"{}")
    (step / "hf.proof.json").write_text(json.dumps({"ok": True, "files": ck.folder_identity(str(step / "hf"))}))
    if change == "delete":
        subprocess.run(["rm", "-r", str(step / "hf")], check=True)
    elif change == "grow":
        (step / "hf" / "model.safetensors").write_bytes(b"m" * 11)
    fact = RunExports()
    out = subprocess.run(["sh", "-c", fact.command(str(tmp_path))], capture_output=True, text=True).stdout
    (entry,) = fact.process(out.splitlines())["exports"]
    assert entry["proof"]["ok"] is (change is None)
    if change == "delete":
        assert "hf/ is missing or empty" in entry["proof"]["problem"]
    elif change == "grow":
        assert "other bytes ['model.safetensors']" in entry["proof"]["problem"]


def test_the_box_s_proof_reader_and_the_export_write_one_format():
    """verl_lab_box/checkpoints.py judges the proofs verl_lab_box/export.py writes: the export refuses to run when
    the two disagree (a box with one placed and not the other), so the repository's pair must agree."""
    from verl_lab_box import export

    assert ck.EXPORT_FORMAT == export.FORMAT


def test_the_facts_command_succeeds_on_a_proof_whose_hf_folder_is_gone(tmp_path):
    """RunExports' real command in bash: a step with its proof but no hf/ (deleted by hand) lists nothing and the
    command still ends 0 (a failing fact command fails the whole host's bundle: status, export, tracking)."""
    import subprocess

    from tasks.facts.export import RunExports

    step = tmp_path / "global_step_5"
    step.mkdir()
    (step / "hf.proof.json").write_text(json.dumps({"ok": True, "files": [{"name": "model.safetensors", "bytes": 1}]}))
    res = subprocess.run(["bash", "-c", RunExports().command(str(tmp_path))], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    (export,) = RunExports().process(res.stdout.splitlines())["exports"]
    assert export["proof"]["ok"] is False and "hf/ is missing" in export["proof"]["problem"]
