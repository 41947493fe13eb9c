"""The training launcher's guards around a run's end (verl_lab_box/train_launcher.py ``train``,
``after_run``), on a train dir placed as the stage places it, with recording stand-ins for verl's
trainer, the export and the score (tests/unit/test_launcher_after_run.py's ``run`` fixture):

* a run whose latest checkpoint is at or past its planned last step does not start verl again
  (verl 0.5.0 adds 1 to the step it loads before it checks for the last one: ray_trainer.py
  ``fit``), by ``trainer.total_training_steps`` or by epochs over the data stage's train rows;
* exports whose save verl removed are pruned before verl starts;
* the export's host RAM (plan.json's prediction) is checked against MemAvailable before the export
  starts, with the fix, and not where the export is proven already (nothing to do).

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
from verl_lab_box import train_launcher as tl


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


def test_an_export_that_does_not_fit_the_host_ram_is_refused_with_the_fix(run, tmp_path, monkeypatch, capsys):  # noqa: F811
    launch, calls, layout = run
    _tracker(layout, STEP)
    lau = tl.load_launch(layout.plan_file)
    ram = lau.checkpoints["export_host_ram"]
    assert ram["gpu_busy_mib"] > ram["gpu_free_mib"] > 4000                 # the 0.5B plan's prediction
    monkeypatch.setattr(tl, "MEMINFO", _meminfo(tmp_path, ram["gpu_free_mib"] - 1))
    assert tl.after_run(lau, final=True, gpu_free=True) == tl.AFTER_RUN_FAILED
    err = capsys.readouterr().err
    assert f"not exported: the export of step {STEP} needs about {ram['gpu_free_mib']} MiB of host RAM" in err
    assert f"has {ram['gpu_free_mib'] - 1} MiB available (MemAvailable)" in err
    assert 'stop training first (train_unit_state = "stopped"' in err and "or export on a box with more RAM" in err
    assert not [c for c in calls() if "export" in c]
    # beside training (on demand) the proof's model is in host RAM: the larger figure
    monkeypatch.setattr(tl, "MEMINFO", _meminfo(tmp_path, ram["gpu_busy_mib"] - 1))
    assert tl.export_ram_short(lau, STEP, gpu_free=True) is None
    assert f"needs about {ram['gpu_busy_mib']} MiB" in tl.export_ram_short(lau, STEP, gpu_free=False)


def test_the_ram_check_lets_a_proven_export_through(run, tmp_path, monkeypatch):  # noqa: F811
    """Nothing to merge or prove: the export would only say "already proven"."""
    _, _, layout = run
    _tracker(layout, STEP)
    step = Path(layout.checkpoint_dir, f"global_step_{STEP}")
    (step / "actor" / "model_world_size_1_rank_0.pt").write_bytes(b"w")
    (step / "hf").mkdir()
    (step / "hf" / "model.safetensors").write_bytes(b"m" * 10)
    proof = {"format": ck.EXPORT_FORMAT, "ok": True, "shards": ck.shard_identity(str(step / "actor")),
             "files": ck.folder_identity(str(step / "hf"))}
    (step / "hf.proof.json").write_text(json.dumps(proof))
    lau = tl.load_launch(layout.plan_file)
    monkeypatch.setattr(tl, "MEMINFO", _meminfo(tmp_path, 10))
    assert tl.export_ram_short(lau, STEP, gpu_free=True) is None
    (step / "hf" / "model.safetensors").write_bytes(b"m" * 11)             # the files decide: not proven now
    assert "needs about" in tl.export_ram_short(lau, STEP, gpu_free=True)


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
