"""Patches 0007 and 0008 (files/patches/verl-0.5.0/): an FSDP2 model gathered once per pass, gradients reduced once
per mini-batch, proven with verl 0.5.0's own ActorRolloutRefWorker on CPU (tests/fixtures/offload_worker_run.py).

The GTX 1080's plan (the grpo-cpu-offload rung: GRPO, the actor and the ref on FSDP2 with CPUOffloadPolicy, fp32,
HF rollout) goes through verl's Hydra config with the batch, lengths and micro-batches shrunk for a tiny Qwen2 on
one gloo rank: the step's worker calls (generate_sequences in 2 chunks, compute_log_prob, compute_ref_log_prob,
update_actor over 2 mini-batches of 4 micro-batches), then the updated actor's log-probs and a new rollout.

* behaviour: every variant samples the same tokens and computes the same log-probs, ref log-probs and updated
  parameters as the tree before 0007 (bitwise: one rank adds the same gradients in the same order);
* plumbing: how often each call gathers an FSDP2 unit's parameters (under CPUOffloadPolicy: a copy from host
  memory) and reduces its gradients (a copy to host memory), counted where FSDP2 does them.

What a GPU adds (device memory of the gathered model, the copies' time) is not shown here: the GPU harness
measures it (bench/gpu/run_speed.sh, docs/training-runs.md). This machine's torch (2.13) runs these paths; the
product's torch 2.6 names the same FSDP2 hooks (read in its sources: see the patch's comments).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tasks.plan import GpuTarget, Workload, load_model_config, make_plan
from tasks.verl import source as verl_source
from tests.fixtures.forked_runs import forked_results
from tests.fixtures.standins.hf_endpoint import tiny_model_files
from tests.unit.test_hf_rollout import _tree

RUN = Path(__file__).resolve().parents[1] / "fixtures" / "offload_worker_run.py"
FIRST = "0007-fsdp2-gather-once-per-pass.diff"
KNOBS = {"gather": ["+actor_rollout_ref.rollout.gather_once=True", "+actor_rollout_ref.actor.fsdp_config.gather_once=True",
                    "+actor_rollout_ref.ref.fsdp_config.gather_once=True"],
         "grads": ["+actor_rollout_ref.actor.fsdp_config.accumulate_grads_unsharded=True"],
         "fused": ["+actor_rollout_ref.actor.optim.fused=True"]}
# the tiny run: 4 prompts x 4 samples = 16 sequences, rollout chunks of 8, log-prob micro-batches of 4, mini-batches of
# 2 prompts (8 sequences) in micro-batches of 2, 6 response tokens, an lr that moves the parameters visibly
SHRINK = {"data.train_batch_size": 4, "actor_rollout_ref.actor.ppo_mini_batch_size": 2,
          "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 2, "+actor_rollout_ref.rollout.micro_batch_size": 8,
          "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": 4,
          "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": 4, "data.max_response_length": 6,
          "actor_rollout_ref.actor.optim.lr": 1e-3}
CHUNKS, MINI_BATCHES, MICRO_PER_MINI, LOG_PROB_MICRO = 2, 2, 4, 4


def plan_overrides(model_dir: Path) -> list[str]:
    """The GTX 1080's plan, its model and sizes swapped for the tiny run's."""
    workload = Workload(model_path=str(model_dir), train_files="/unused/train.parquet", val_files="/unused/val.parquet",
                        checkpoint_dir="/unused/ckpt", model_config=load_model_config(), total_training_steps=1,
                        finetune="full")      # the full plan: "auto" gives this card LoRA
    plan = make_plan(GpuTarget("NVIDIA GeForce GTX 1080", "6.1", 8192), workload)
    assert plan.rung == "grpo-cpu-offload"
    keep = [line for line in plan.override_lines if line.split("=", 1)[0] not in SHRINK
            and not line.startswith(tuple(k.split("=", 1)[0] for knobs in KNOBS.values() for k in knobs))]
    return keep + [f"{k}={v}" for k, v in SHRINK.items()]


def tiny_model(dest: Path) -> Path:
    """The lab's tiny Qwen2 repo (weights, config, tokenizer) as a local model folder."""
    files, _ = tiny_model_files()
    for name, data in files.items():
        if not name.startswith("onnx/"):
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            (dest / name).write_bytes(data)
    return dest


@pytest.fixture(scope="module")
def runs(served, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fsdp2")
    verl_python = served.python()            # its runs: children of an interpreter with verl's stack imported
    model = tiny_model(tmp / "model")
    patches = verl_source.patch_files()
    assert FIRST in [p.name for p in patches]
    trees = {"before": _tree(tmp / "before", [p for p in patches if p.name < FIRST]), "patched": _tree(tmp / "patched", patches)}
    base = plan_overrides(model)
    variants = {"before": ("before", base), "off": ("patched", base),
                "gather": ("patched", base + KNOBS["gather"]), "grads": ("patched", base + KNOBS["grads"]),
                "both": ("patched", base + KNOBS["gather"] + KNOBS["grads"]),
                "fused": ("patched", base + KNOBS["gather"] + KNOBS["grads"] + KNOBS["fused"])}
    out = {}
    for tree in trees:           # one process a tree, a child forked from it a variant (docs/testing.md)
        names = [name for name, (on, _) in variants.items() if on == tree]
        for name in names:
            (tmp / f"{name}.json").write_text(json.dumps({"overrides": variants[name][1]}))
        jobs = [(tmp / f"{name}.json", tmp / f"{name}.pt") for name in names]
        for name, (found, log) in zip(names, forked_results(verl_python, RUN, trees[tree], jobs), strict=True):
            assert found is not None, f"{name}: {log}"
            out[name] = found
    # every variant against "before", all pairs in one process (one RESULT a pair, in this order)
    diffs = _results(verl_python, trees["patched"], len(variants), "compare", tmp / "before.pt",
                     *(tmp / f"{name}.pt" for name in variants))
    out.update((f"diff {name}", diff) for name, diff in zip(variants, diffs, strict=True))
    return out


def _result(python, cwd: Path, *args, env: dict | None = None) -> dict:
    return _results(python, cwd, 1, *args, env=env)[0]


def _results(python, cwd: Path, count: int, *args, env: dict | None = None) -> list[dict]:
    """The ``count`` RESULT lines of one run of offload_worker_run.py (its exit 0 and every line required)."""
    res = subprocess.run([str(python), str(RUN), *map(str, args)], cwd=cwd, capture_output=True, text=True, timeout=600,
                         env=env)
    lines = [line for line in res.stdout.splitlines() if line.startswith("RESULT ")]
    assert res.returncode == 0 and len(lines) == count, f"{args}: {res.stdout[-3000:]}{res.stderr[-3000:]}"
    return [json.loads(line[len("RESULT "):]) for line in lines]


def test_the_run_is_the_offload_rung_and_trains(runs):
    before = runs["before"]
    assert before["strategy"] == "fsdp2" and before["offload_policy"] is True and before["fsdp2"].startswith("FSDP")
    assert before["sequences"] == 16 and before["param_moved_max"] > 1e-4
    # the update moved the actor's log-probs: a stale gathered copy would show as a difference below
    assert runs["diff before"]["log_probs_moved_by_update"] > 1e-3


@pytest.mark.parametrize("variant", ["off", "gather", "grads", "both"])
def test_every_variant_computes_what_verl_computes(runs, variant):
    diff = runs[f"diff {variant}"]
    assert diff["responses_1"] == 0 and diff["responses_2"] == 0, diff           # tokens sampled, before and after
    for key in ("old_log_probs_1", "ref_log_prob", "log_probs_1_after_update", "params_max"):
        assert diff[key] == 0.0, (key, diff)


def test_without_the_knobs_the_patched_tree_moves_what_verl_moves(runs):
    assert runs["off"]["moves"] == runs["before"]["moves"]
    units, moves = runs["before"]["units"], runs["before"]["moves"]
    # verl 0.5.0 under FSDP2 + CPUOffloadPolicy: every forward of generate() gathers every unit again ...
    assert moves["generate_sequences"]["gathers"] >= units * CHUNKS * 2
    assert moves["compute_log_prob"]["gathers"] == units * LOG_PROB_MICRO
    # ... and every update micro-batch gathers twice (forward, backward) and sends every gradient to the host
    assert moves["update_actor"] == {"gathers": 2 * units * MINI_BATCHES * MICRO_PER_MINI,
                                     "reductions": units * MINI_BATCHES * MICRO_PER_MINI}


def test_gather_once_gathers_each_unit_once_per_pass_and_per_mini_batch(runs):
    units, moves = runs["gather"]["units"], runs["gather"]["moves"]
    for call in ("generate_sequences", "compute_log_prob", "compute_ref_log_prob"):
        assert moves[call] == {"gathers": units, "reductions": 0}, call
    assert moves["update_actor"] == {"gathers": units * MINI_BATCHES, "reductions": units * MINI_BATCHES * MICRO_PER_MINI}


def test_unsharded_accumulation_reduces_once_per_mini_batch(runs):
    units = runs["grads"]["units"]
    assert runs["grads"]["moves"]["update_actor"] == {"gathers": 2 * units * MINI_BATCHES * MICRO_PER_MINI,
                                                      "reductions": units * MINI_BATCHES}
    assert runs["both"]["moves"]["update_actor"] == {"gathers": units * MINI_BATCHES, "reductions": units * MINI_BATCHES}


def test_fused_adamw_steps_the_offloaded_params_with_the_same_result(runs):
    """Patch 0009: optim.fused=True builds torch's fused AdamW, which steps the FSDP2 DTensors kept on the CPU (the
    per-tensor loop otherwise); the same algorithm, rounded differently: what it computes matches within float
    rounding, not bitwise (plumbing: the optimizer verl built is the fused one; behaviour: the same update)."""
    assert runs["fused"]["adamw_fused"] is True and runs["both"]["adamw_fused"] is False
    assert runs["fused"]["moves"] == runs["both"]["moves"]
    diff = runs["diff fused"]
    assert diff["responses_1"] == 0 and diff["old_log_probs_1"] == 0.0 and diff["ref_log_prob"] == 0.0   # before the step
    assert 0.0 < diff["params_max"] < 1e-3 * runs["fused"]["param_moved_max"], diff   # a thousandth of the step
    assert diff["log_probs_1_after_update"] < 1e-4, diff
