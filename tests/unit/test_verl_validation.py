"""verl 0.5.0's own checks pass on every plan: ``RayPPOTrainer._validate_config`` (through the
trainer's real ``__init__``) and the FSDP workers' batch normalisation, on CPU.

tests/fixtures/verl_plan_check.py runs them in the patched verl 0.5.0 tree with the cached
Python of tests/fixtures/standins/env.py (torch + verl's dependencies): one process, the
workers' ``__init__`` in as many forked gloo ranks as the plan has GPUs. The cases are
test_verl_compose.py's (every GPU of docs/plan.md's table that gets a plan, and each rung
forced on a few), plus broken plans that verl must refuse, so the judge is shown to fail.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tasks.plan import GpuTarget
from tests.unit.test_verl_compose import _plan, _plans

CHECK = Path(__file__).resolve().parents[1] / "fixtures" / "verl_plan_check.py"
TRAIN_ROWS = 7473          # GSM8K's train split (tasks/gsm8k.py keeps every row; filtering drops overlong ones)
CASES = _plans()


def _broken():
    """Plans verl refuses: (label, changed override lines, gpu count, what verl says)."""
    base = _plan(next(c for c in CASES if c[0] == "1 x Tesla P40")).override_lines
    four = _plan(("4 x P40", GpuTarget("Tesla P40", "6.1", 24576, 4), {}))
    swap = lambda lines, key, value: [f"{key}={value}" if line.startswith(key + "=") else line for line in lines]  # noqa: E731
    return [
        ("micro-batch not dividing the mini-batch", swap(base, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", 3),
         1, "should be divisible by ppo_micro_batch_size_per_gpu"),
        ("sequences not dividing over 4 GPUs", swap(four.override_lines, "data.train_batch_size", 254), 4,
         "must be divisible by minimal possible batch size"),
        ("no log-prob micro-batch", swap(base, "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu", "null"),
         1, "Please set at least one of"),
    ]


@pytest.fixture(scope="module")
def verl_root(patched_verl_root):
    """verl 0.5.0's sdist with the project's patches applied."""
    return patched_verl_root


@pytest.fixture(scope="module")
def results(verl_python, verl_root, tmp_path_factory):
    root = verl_root
    items = [{"label": label, "overrides": _plan((label, gpu, extra)).override_lines, "n_gpus": gpu.count,
              "train_rows": TRAIN_ROWS, "val_rows": 64} for label, gpu, extra in CASES]
    items += [{"label": label, "overrides": lines, "n_gpus": n, "train_rows": TRAIN_ROWS, "val_rows": 64}
              for label, lines, n, _ in _broken()]
    return run_plan_check(verl_python, root, items, tmp_path_factory.mktemp("plans"))


def run_plan_check(verl_python, verl_root, items: list[dict], folder) -> dict:
    """verl_plan_check.py on ``items`` (each ``{"label", "overrides", "n_gpus", ...}``) in the tree:
    its answer per label."""
    plans = folder / "plans.json"
    plans.write_text(json.dumps(items))
    res = subprocess.run([str(verl_python), str(CHECK), str(plans)], cwd=verl_root, capture_output=True, text=True,
                         timeout=900)
    found = {}
    for line in res.stdout.splitlines():
        if line.startswith("PLANCHECK "):
            item = json.loads(line[len("PLANCHECK "):])
            found[item["label"]] = item
    assert len(found) == len(items), res.stdout[-3000:] + res.stderr[-3000:]
    return found


@pytest.mark.parametrize("label,gpu,extra", CASES, ids=[c[0] for c in CASES])
def test_verl_accepts_the_plan(results, label, gpu, extra):
    plan = _plan((label, gpu, extra))
    w = plan.workload
    r = results[label]
    assert "error" not in r and "error" not in r["workers"], r
    # verl decides critic and reference from the config as the plan meant them
    assert r["use_critic"] is w.uses_critic and r["use_reference_policy"] is w.uses_reference
    # the run's length: a step cap, else whole epochs of 'train_batch_size' prompts (verl drops the last partial batch)
    assert r["train_batches"] == TRAIN_ROWS // w.train_batch_size
    assert r["total_training_steps"] == (w.total_training_steps or r["train_batches"] * w.total_epochs)
    # the workers' normalisation: sequences of a mini-batch per GPU, divided into the planned micro-batches
    workers = r["workers"]
    assert workers["actor_mini_per_gpu"] == w.ppo_mini_batch_size * w.rollout_n // gpu.count
    assert workers["actor_micro"] == plan.memory.actor_micro_batch
    assert ("critic_micro" in workers) is w.uses_critic and workers.get("ref", False) is w.uses_reference
    if w.uses_critic:
        assert (workers["critic_mini_per_gpu"], workers["critic_micro"]) == (workers["actor_mini_per_gpu"],
                                                                           plan.memory.critic_micro_batch)
    # the FSDP2 CPU-offload rung: the actor (and through the interpolation the ref) on fsdp2 with the policy on;
    # the critic's strategy stays one main_ppo accepts (no critic is built); the actor's FSDP1 flags are off
    s = r["strategies"]
    assert (s["actor"], s["ref"], s["offload_policy"]) == (("fsdp2", "fsdp2", True) if w.actor_offload_policy
                                                           else ("fsdp", "fsdp", False))
    assert s["critic"] in ("fsdp", "fsdp2")
    if w.actor_offload_policy:
        assert workers["actor_offload"] == [False, False]
    # HF rollout: equal chunks of the planned size over a rank's share of a step and of validation
    if plan.precision.rollout == "hf":
        train, val = r["hf_chunks"]["train"], r["hf_chunks"]["validation"]
        assert set(train) == {plan.memory.rollout_micro_batch}
        assert sum(train) == w.train_batch_size * w.rollout_n // gpu.count and len(set(val)) == 1


@pytest.mark.parametrize("label,lines,n,message", _broken(), ids=[b[0] for b in _broken()])
def test_verl_refuses_broken_plans(results, label, lines, n, message):
    r = results[label]
    error = r.get("error") or r["workers"].get("error")
    assert error and message in error, r


def test_verl_code_behind_the_cpu_offload_rung(verl_root):
    """What the grpo-cpu-offload rung relies on, in verl 0.5.0's own code (the workers' init_model, which
    the checks above do not run, needs a GPU): under fsdp2 with offload_policy the actor gets
    CPUOffloadPolicy and its FSDP1 offload flags are forced False; the ref is always built with
    CPUOffloadPolicy (its param_offload flag is never read on that path); the ref is built with the
    actor's strategy; vLLM's sharding manager moves each CPU-offloaded DTensor to the GPU itself; the
    critic has no such policy path the plan could use (GPU call 6: FSDP2 cannot wrap it here)."""
    workers = (verl_root / "verl/workers/fsdp_workers.py").read_text()
    build = workers.split("def _build_model_optimizer", 1)[1].split("def _build_rollout", 1)[0]
    assert 'fsdp_strategy = self.config.actor.strategy' in build          # the ref too
    policy = build.split('elif fsdp_strategy == "fsdp2":', 1)[1].split("fsdp_kwargs", 1)[0]
    assert 'if role == "actor" and fsdp_config.offload_policy:' in policy
    assert "cpu_offload = CPUOffloadPolicy(pin_memory=True)" in policy
    assert "self._is_offload_param = False" in policy and "self._is_offload_optimizer = False" in policy
    assert 'cpu_offload = None if role == "actor" else CPUOffloadPolicy(pin_memory=True)' in policy
    ref = workers.split("def compute_ref_log_prob", 1)[1].split("@register", 1)[0]
    assert "load_fsdp_model_to_gpu" not in ref and "_is_offload_param" not in ref
    assert "strategy: ${actor_rollout_ref.actor.strategy}" in (verl_root / "verl/trainer/config/ref/ref.yaml").read_text()
    vllm = (verl_root / "verl/workers/sharding_manager/fsdp_vllm.py").read_text()
    assert "param.to(device, non_blocking=True).full_tensor() if isinstance(param, DTensor)" in vllm
    assert "used when fsdp2 set cpu_offload_policy" in vllm
