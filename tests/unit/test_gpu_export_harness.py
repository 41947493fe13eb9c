"""The GPU harness's export profiles (bench/gpu: ppo_profiles.py, run_profile.py, ppo_results.py),
checked here before a GPU call spends minutes on them.

Plumbing: the three profiles render the product's plans for their cards with a save at every
step and the export left on (the launcher's ``after_run``), the train dir holds the export and
score programs and plan.json's evaluation section, the command run_profile builds keeps the
export on only for them, and what a run leaves in its checkpoint folder is collected and summed
up as ppo_results.py reports it (bytes of one save against the plan's prediction, the saves kept,
the export's seconds and logit difference, the scores). Whether verl, the merger and the scores
then run on the GPU is what the call shows (docs/training-runs.md).
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
EXPORT_PROFILES = ("p40-export", "rtx3090-export", "gtx1080-export")


def _module(name: str):
    if f"gpu_harness_{name}" in sys.modules:
        return sys.modules[f"gpu_harness_{name}"]
    spec = importlib.util.spec_from_file_location(f"gpu_harness_{name}", REPO / "bench" / "gpu" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod                 # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def rendered(tmp_path_factory):
    out = tmp_path_factory.mktemp("profiles")
    _module("ppo_profiles").render(list(EXPORT_PROFILES), out, "HEAD")
    return out


@pytest.mark.parametrize("name,rung,dtype,batch", [("p40-export", "ppo", "fp32", 64), ("rtx3090-export", "ppo", "bf16", 64),
                                                   ("gtx1080-export", "grpo-cpu-offload", "fp32", 16)])
def test_export_profiles_render_the_plans_with_a_save_each_step(rendered, name, rung, dtype, batch):
    profile = json.loads((rendered / name / "profile.json").read_text())
    plan = json.loads((rendered / name / "train" / "plan.json").read_text())
    assert profile["export"] is True and profile["kind"] == "launcher" and profile["steps"] == 3
    assert (plan["rung"], plan["train_dtype"], plan["rollout"]) == (rung, dtype, "hf")
    extra = profile["extra_overrides"]
    assert extra[0] == "trainer.save_freq=1" and "trainer.save_freq=-1" not in extra
    assert f"data.train_batch_size={batch}" in extra and extra[-1] == "trainer.test_freq=-1"
    assert "trainer.total_training_steps=3" in plan["overrides"]
    keep_one = {"trainer.max_actor_ckpt_to_keep=1", "trainer.max_critic_ckpt_to_keep=1"}
    assert (keep_one <= set(extra)) == (rung == "ppo")         # the disk: see ppo_profiles.py
    if rung != "ppo":
        assert "trainer.max_actor_ckpt_to_keep=2" in plan["overrides"]     # the plan's keep + 1
    ev = plan["launch"]["evaluation"]
    assert ev["engine"] == "hf" and ev["test_file"] == f"/tmp/vl/{name}/data/gsm8k/test.parquet"
    assert ev["dtype"] == ("bfloat16" if dtype == "bf16" else "float32") and ev["batch"] >= 64
    files = {p.name for p in (rendered / name / "train").iterdir()}
    assert {"train-launcher", "verl_lab_preflight.py", "verl_lab_after_run.py", "verl_lab_export.py",
            "verl_lab_score.py", "plan.json"} <= files


def test_only_export_profiles_keep_the_export_on(rendered):
    run_profile = _module("run_profile")
    profile = json.loads((rendered / "p40-export" / "profile.json").read_text())
    root = Path("/tmp/vl/p40-export")
    cmd = run_profile.command(profile, root, {})
    assert cmd[2:4] == ["--no-preflight", "--"] and "--no-export" not in cmd
    assert run_profile.command({**profile, "export": False}, root, {})[2:5] == ["--no-preflight", "--no-export", "--"]


def _checkpoints(tmp_path: Path) -> Path:
    """A checkpoint folder as a PPO export run leaves it: step 2 kept (step 1 removed by the plan's
    retention but for verl's data.pt), its export and JSON files."""
    ck = tmp_path / "checkpoints"
    for rel, size in {"global_step_1/data.pt": 100, "global_step_2/actor/model_world_size_1_rank_0.pt": 4000,
                      "global_step_2/actor/optim_world_size_1_rank_0.pt": 8000,
                      "global_step_2/critic/model_world_size_1_rank_0.pt": 3000, "global_step_2/data.pt": 100,
                      "global_step_2/hf/model.safetensors": 2500, "global_step_1/.hf.partial/model.safetensors": 700}.items():
        (ck / rel).parent.mkdir(parents=True, exist_ok=True)
        (ck / rel).write_bytes(b"\0" * size)
    (ck / "latest_checkpointed_iteration.txt").write_text("2")
    (ck / "run-finished.json").write_text(json.dumps({"step": 2, "overrides_sha256": "x"}))
    (ck / "global_step_2" / "hf.proof.json").write_text(json.dumps(
        {"ok": True, "export_bytes": 2500, "merge_seconds": 11.5, "proof_seconds": 7.25, "max_abs_logit_diff": 0.0,
         "max_abs_logit_diff_vs_checkpoint_dtype": 0.04, "max_abs_weight_diff": 0.0, "fsdp_version": 1, "world_size": 1}))
    for name, acc in (("global_step_2/hf.gsm8k.json", 0.0078), ("gsm8k-base.json", 0.0)):
        (ck / name).write_text(json.dumps({"accuracy": acc, "correct": 2 if acc else 0, "rows": 256,
                                           "prompts_per_s": 12.5, "engine": "hf", "dtype": "float32", "batch": 256}))
    return ck


def test_a_runs_checkpoints_are_collected_and_summed_up(tmp_path):
    run = tmp_path / "runs" / "p40-export"
    record = _module("run_profile").collect_export(_checkpoints(tmp_path), run / "export")
    assert record["global_steps"] == ["global_step_1", "global_step_2"]
    assert record["saves"]["global_step_1"]["bytes"] == 100                   # an export cut while made is no save
    assert record["saves"]["global_step_2"]["bytes"] == 4000 + 8000 + 3000 + 100     # not the export or its JSONs
    assert (record["saves"]["global_step_2"]["actor"], record["saves"]["global_step_2"]["critic"]) == (12000, 3000)
    assert record["exports"] == {"global_step_2": 2500}
    (run / "plan.json").write_text(json.dumps({"checkpoints": {"save": {"total_bytes": 15000}}}))
    summary = _module("ppo_results").export_summary(run)
    assert summary["save_bytes"] == 15100 and summary["predicted_save_bytes"] == 15000
    assert summary["save_ratio"] == pytest.approx(15100 / 15000, abs=1e-4)
    assert summary["kept"] == ["global_step_1", "global_step_2"] and summary["finished"]["step"] == 2
    assert summary["proven"] and summary["export_seconds"] == 18.75
    # a format-1 proof (GPU call A's) read as format 2 names it: in the export's dtype, and against the checkpoint's
    assert (summary["logit_diff_in_export_dtype"], summary["logit_diff_vs_checkpoint_dtype"]) == (0.0, 0.04)
    assert (summary["base"]["accuracy"], summary["trained"]["accuracy"], summary["trained"]["rows"]) == (0.0, 0.0078, 256)
    table = _module("ppo_results").export_markdown([{"profile": "p40-export", "export": summary}])
    assert "| p40-export | global_step_1, global_step_2 | 15100 | 15000 | 1.0067 | 2500 | 11.5 + 7.25 (cpu) | 0.0 / 0.04," \
        in table
    (run / "plan.json").write_text("{}")                 # a plan from before save sizes were predicted
    assert _module("ppo_results").export_summary(run)["save_ratio"] is None
    assert _module("ppo_results").export_summary(tmp_path / "runs" / "other") is None


def test_a_format_2_proof_and_the_proof_bench_are_summed_up(tmp_path):
    """Today's proof (verl_lab_box/export_proof.py) names both differences itself; proof_bench.py's record gives
    the before / today seconds of one step, and a cut proof says so."""
    ck = _checkpoints(tmp_path)
    (ck / "global_step_2" / "hf.proof.json").write_text(json.dumps(
        {"ok": True, "export_bytes": 2500, "merge_seconds": 11.5, "proof_seconds": 4.5, "max_abs_logit_diff": 0.27,
         "max_abs_logit_diff_in_export_dtype": 0.0, "logit_tolerance": 0.86, "proof_device": "cuda"}))
    run = tmp_path / "runs" / "gtx1080-export"
    _module("run_profile").collect_export(ck, run / "export")
    (run / "proof-bench.json").write_text(json.dumps({"today": {"seconds": 6.2}, "before": {"seconds": 98.4}}))
    results = _module("ppo_results")
    summary = results.export_summary(run)
    assert (summary["logit_diff_in_export_dtype"], summary["logit_diff_vs_checkpoint_dtype"]) == (0.0, 0.27)
    assert (summary["logit_tolerance"], summary["proof_device"]) == (0.86, "cuda")
    row = results.export_markdown([{"profile": "gtx1080-export", "export": summary}]).splitlines()[-1]
    assert "11.5 + 4.5 (cuda) | 0.0 / 0.27, 0.86 |" in row and row.endswith("| 98.4 / 6.2 |")
    (run / "proof-bench.json").write_text(json.dumps({"today": {"seconds": 6.2},
                                                      "before": {"timed_out": True, "timeout": 120.0}}))
    row = results.export_markdown([{"profile": "x", "export": results.export_summary(run)}]).splitlines()[-1]
    assert row.endswith("| cut at 120.0 s / 6.2 |")
