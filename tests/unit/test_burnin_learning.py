"""The burn-in's learning test on CPU (tests/fixtures/burnin_worker_run.py): verl 0.5.0's own worker trains a tiny
Qwen2 on the burn-in's reward (the product's reward manager, registered in verl's registry by the product's probe)
with the burn-in's learning rate and the product's judge; and a broken update fails it with the doctor's reason.

The plan is the Tesla P40's with GRPO (the grpo rung: its KL loss and ref, FSDP1, fp32, HF rollout) with the burn-in's
overrides (tasks/burnin/plan.py, merged as the box's burn-in
merges them: verl_lab_box/burnin.py ``merged``) and its sizes shrunk for the tiny model on one gloo rank. The
mutations are test-only patches of the verl tree (tests/fixtures/burnin/mutations/): the advantage's sign flipped
(``reward-fell``), the optimizer step skipped (``reward-flat`` and ``weights-unmoved``); and the same plan with LoRA
(grpo-lora) for two steps, whose second rollout merges a non-zero adapter (patch 0013): with its restore taken out
(``lora-base-moved``).

What this does not show (a GPU does: bench/gpu/run_burnin.sh): the 0.5B's learning at the burn-in's rate, memory,
speed, the save/resume/export path through verl's trainer.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from dataclasses import replace
from pathlib import Path

import pytest

from tasks.burnin.plan import RISES, BurninSpec
from tasks.burnin.plan import overrides as burnin_overrides
from tasks.plan import GpuTarget, Workload, load_model_config, make_plan
from tasks.verl import source as verl_source
from tests.unit.test_fsdp2_gather import tiny_model
from tests.unit.test_hf_rollout import _tree
from verl_lab_box.burnin import merged

REPO = Path(__file__).resolve().parents[2]
RUN = REPO / "tests" / "fixtures" / "burnin_worker_run.py"
MUTATIONS = REPO / "tests" / "fixtures" / "burnin" / "mutations"
PROMPTS, STEPS = 16, 5
LORA_STEPS = 2       # the LoRA runs check the weights: step 2's rollout is the first to merge a non-zero adapter
# the tiny run: 16 prompts x 4 samples, 48 response tokens, mini-batches of 4 prompts (4 updates a step, as the GRPO
# plans' 64/16), five steps (the burn-in's default); the burn-in's rate at the tiny model's width (64): 4.2e-3
SHRINK = {"data.train_batch_size": PROMPTS, "actor_rollout_ref.actor.ppo_mini_batch_size": 4,
          "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 16, "+actor_rollout_ref.rollout.micro_batch_size": 64,
          "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": 64,
          "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": 64, "data.max_response_length": 48}


def burnin_run_overrides(model_dir: Path, folder: Path, finetune: str = "full") -> list[str]:
    workload = Workload(model_path=str(model_dir), train_files="/unused/train.parquet", val_files="/unused/val.parquet",
                        checkpoint_dir="/unused/ckpt", model_config=load_model_config(), total_training_steps=1,
                        finetune=finetune)
    plan = make_plan(GpuTarget("Tesla P40", "6.1", 24576), replace(workload, algorithm="grpo"))
    assert plan.rung == ("grpo" if finetune == "full" else "grpo-lora")
    base = [o for o in plan.override_lines if o.split("=", 1)[0] not in SHRINK]
    # the burn-in's rate for the model that trains here: the same rule at the tiny model's width
    tiny = replace(plan, workload=replace(plan.workload, model_config=json.loads((model_dir / "config.json").read_text())))
    mine = [o["override"] for o in burnin_overrides(tiny, str(folder), "cpu", BurninSpec())]
    return merged(base + [f"{k}={v}" for k, v in SHRINK.items()], mine)


def _run(python, tree: Path, spec: dict, out: Path, timeout: int = 900) -> tuple[dict | None, str, float]:
    out.mkdir(parents=True, exist_ok=True)
    (out / "spec.json").write_text(json.dumps(spec))
    probe = out / "probe"
    probe.mkdir(exist_ok=True)
    (probe / "sitecustomize.py").write_bytes((REPO / "verl_lab_box" / "burnin_probe.py").read_bytes())
    (probe / "verl_lab_burnin_reward.py").write_bytes((REPO / "verl_lab_box" / "burnin_reward.py").read_bytes())
    records = next(o.split("=", 1)[1] for o in spec["overrides"] if o.startswith("+reward_model.reward_kwargs.records="))
    env = {**os.environ, "PYTHONPATH": str(probe), "VERL_LAB_BURNIN_RECORDS": records}   # as the driver sets it
    start = time.monotonic()
    res = subprocess.run([str(python), str(RUN), str(out / "spec.json"), str(out)], cwd=tree, capture_output=True,
                         text=True, timeout=timeout, env=env)
    lines = [line for line in res.stdout.splitlines() if line.startswith("RESULT ")]
    found = json.loads(lines[-1][len("RESULT "):]) if res.returncode == 0 and lines else None
    return found, res.stdout[-3000:] + res.stderr[-3000:], round(time.monotonic() - start, 1)


@pytest.fixture(scope="module")
def runs(served, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("burnin")
    verl_python = served.python()            # its runs: children of an interpreter with verl's stack imported
    model = tiny_model(tmp / "model")
    patches = verl_source.patch_files()
    found = {}
    runs_of = {"baseline": ("full", STEPS), "lora": ("lora", LORA_STEPS),
               **{p.stem: ("lora" if "lora" in p.stem else "full", LORA_STEPS if "lora" in p.stem else STEPS)
                  for p in MUTATIONS.glob("*.diff")}}
    for name, (finetune, steps) in runs_of.items():
        tree = _tree(tmp / f"tree-{name}", patches)
        if (MUTATIONS / f"{name}.diff").is_file():
            subprocess.run(["git", "apply", str(MUTATIONS / f"{name}.diff")], cwd=tree, check=True)
        spec = {"overrides": burnin_run_overrides(model, tmp / name, finetune), "prompts": PROMPTS, "steps": steps,
                "rises": RISES}
        found[name] = _run(verl_python, tree, spec, tmp / name)
    return found


def _ok(runs, name) -> dict:
    found, log, _ = runs[name]
    assert found is not None, f"{name}: {log}"
    return found


def test_the_reward_rises_with_verls_own_update(runs):
    found = _ok(runs, "baseline")
    print(json.dumps({k: found[k] for k in ("steps", "test", "seconds", "phase_seconds")}, indent=1))
    assert found["test"]["ok"] is True and found["test"]["id"] == "reward", found["test"]
    assert found["weights"]["ok"] is True, found["weights"]
    assert found["nan"]["ok"] is True
    # the probe saw the worker's calls and the trainer's metrics, as on a box
    assert {"generate_sequences", "compute_log_prob", "compute_ref_log_prob", "update_actor"} <= set(found["phase_calls"])
    assert [s["step"] for s in found["steps"]] == list(range(1, STEPS + 1))
    # verl's advantage was computed from the share's z-score (its critic/score/mean), the judge read the shares
    for s in found["steps"]:
        handed, z = found["verl_scores"][str(s["step"])], found["z_means"][str(s["step"])]
        assert abs(handed - z) < 1e-4 and abs(handed - s["score"]) > 0.05, (s, handed, z)


def test_the_advantage_sign_flipped_fails_it_as_reward_fell(runs):
    found = _ok(runs, "advantage-sign-flipped")
    assert found["test"]["ok"] is False and found["test"]["id"] == "reward-fell", found["test"]
    assert found["weights"]["ok"] is True          # the weights moved: the wrong way


def test_the_optimizer_step_skipped_fails_it_as_reward_flat_and_weights_unmoved(runs):
    found = _ok(runs, "optimizer-step-skipped")
    assert found["test"]["ok"] is False and found["test"]["id"] == "reward-flat", found["test"]
    assert found["weights"]["id"] == "weights-unmoved" and found["weights"]["ok"] is False, found["weights"]


def test_a_lora_burnin_moves_the_adapter_and_leaves_the_base(runs):
    found = _ok(runs, "lora")
    assert found["lora"] and found["weights"]["ok"] is True, found["weights"]


def test_the_lora_merge_not_restored_fails_it_as_lora_base_moved(runs):
    """Patch 0013 merges the adapter into the weights for the rollout and puts the saved base back after it; without
    the putting back, the save's frozen base differs from the model folder."""
    found = _ok(runs, "lora-merge-not-restored")
    assert (found["weights"]["id"], found["weights"]["ok"]) == ("lora-base-moved", False), found["weights"]
