"""verl 0.5.0's LoRA with the HF rollout (Pascal cards, ``rollout = "hf"``), proven with verl's own
ActorRolloutRefWorker on CPU (tests/fixtures/lora_worker_run.py), and patches 0011-0013 (files/patches/verl-0.5.0/)
shown needed: what the release does without each (0013: the rollout generates with the adapter merged).

The plans go through verl's Hydra config with LoRA's keys added (``actor_rollout_ref.model.lora_rank``,
``lora_alpha``, ``target_modules=all-linear``, and the vLLM-side ``rollout.load_format``/``layered_summon`` the
LoRA plans also carry, harmless here), the batch, lengths and micro-batches shrunk for a tiny Qwen2 on one gloo rank:

* FSDP1: the Tesla P40's plan (the ``ppo`` rung, verl's default strategy, fp32, HF rollout);
* FSDP2 + CPUOffloadPolicy: the GTX 1080's plan (the ``grpo-cpu-offload`` rung), with and without the offload
  rung's gather knobs (patches 0007-0009).

Behaviour, after one update has made the adapter non-zero: the rollout samples the policy the actor scores (the
log-prob of each sampled token as the sampler saw it against the actor's compute_log_prob: the full plans' check);
the ref log-probs (verl's ``ref_in_actor``: the actor with its adapter disabled) equal the base model's, computed by
transformers alone; the update moved LoRA's A and B and left every base weight bit-identical to the model folder's;
save_checkpoint wrote verl's ``lora_adapter/`` beside the shards.

What a GPU adds (bf16 rollouts, memory, speed, more than one rank) is not shown here: bench/gpu measures it.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tasks.plan import GpuTarget, Workload, load_model_config, make_plan
from tasks.verl import source as verl_source
from tests.fixtures.forked_runs import forked_results
from tests.unit.test_fsdp2_gather import KNOBS, SHRINK, tiny_model
from tests.unit.test_hf_rollout import _tree

RUN = Path(__file__).resolve().parents[1] / "fixtures" / "lora_worker_run.py"
PROBE = Path(__file__).resolve().parents[2] / "bench" / "gpu" / "probe"
WRAP = "0011-lora-keeps-its-fsdp1-wrap-policy-with-the-hf-rollout.diff"
PEFT = "0012-hf-rollout-generates-with-a-peft-model.diff"
MERGE = "0013-hf-rollout-generates-with-the-adapter-merged.diff"
RANK, ALPHA = 4, 8
LORA = [f"actor_rollout_ref.model.lora_rank={RANK}", f"actor_rollout_ref.model.lora_alpha={ALPHA}",
        "actor_rollout_ref.model.target_modules=all-linear", "actor_rollout_ref.rollout.load_format=safetensors",
        "actor_rollout_ref.rollout.layered_summon=True"]
LR = 1e-2                 # moves a rank-4 adapter of the tiny model far enough to see in the log-probs
CARDS = {"fsdp1": (GpuTarget("Tesla P40", "6.1", 24576), "ppo"),
         "fsdp2": (GpuTarget("NVIDIA GeForce GTX 1080", "6.1", 8192), "grpo-cpu-offload")}
# float noise of fp32 on CPU: the sampler's probabilities come from generate()'s cached forward, the actor's from
# one uncached forward of the whole sequence
GAP = 1e-4


def plan_overrides(card: str, model_dir: Path, extra: list[str] = ()) -> list[str]:
    """The card's plan, its model and sizes swapped for the tiny run's, the offload knobs taken out (``extra``
    puts some back), LoRA's keys added."""
    gpu, rung = CARDS[card]
    workload = Workload(model_path=str(model_dir), train_files="/unused/train.parquet", val_files="/unused/val.parquet",
                        checkpoint_dir="/unused/ckpt", model_config=load_model_config(), total_training_steps=1,
                        finetune="full")   # the full plan's layout (FSDP1; FSDP2 with CPUOffloadPolicy), LoRA added here
    plan = make_plan(gpu, workload)
    assert plan.rung == rung, plan.rung
    shrink = {**SHRINK, "actor_rollout_ref.actor.optim.lr": LR}
    knob_keys = tuple(k.split("=", 1)[0] for knobs in KNOBS.values() for k in knobs)
    keep = [line for line in plan.override_lines if line.split("=", 1)[0] not in shrink
            and not line.startswith(knob_keys) and not line.startswith("critic.")]
    return keep + [f"{k}={v}" for k, v in shrink.items()] + LORA + list(extra)


def safetensors_header(path: Path) -> dict:
    """A safetensors file's header (tensor name -> dtype, shape, offsets): 8 bytes of length, then JSON."""
    with open(path, "rb") as fh:
        size = int.from_bytes(fh.read(8), "little")
        header = json.loads(fh.read(size))
    header.pop("__metadata__", None)
    return header


def _run(python, cwd: Path, spec: Path, out: Path, env: dict | None = None) -> tuple[dict | None, str]:
    """One run in a process of its own (the GPU probe's test: the probe loads at the interpreter's start)."""
    out.mkdir(parents=True, exist_ok=True)
    res = subprocess.run([str(python), str(RUN), str(spec), str(out)], cwd=cwd, capture_output=True, text=True,
                         timeout=600, env=env)
    lines = [line for line in res.stdout.splitlines() if line.startswith("RESULT ")]
    found = json.loads(lines[-1][len("RESULT "):]) if res.returncode == 0 and lines else None
    return found, res.stdout[-3000:] + res.stderr[-3000:]


def runs_forked(python, cwd: Path, jobs: list[tuple[Path, Path]]) -> list[tuple[dict | None, str]]:
    """Each (SPEC, OUT) run on one tree in a child forked from one process that imported torch, transformers, peft
    and verl once (docs/testing.md "Heavy processes"): its result, or None and the run's log, in the order given."""
    for _, out in jobs:
        out.mkdir(parents=True, exist_ok=True)
    return forked_results(python, RUN, cwd, jobs)


@pytest.fixture(scope="module")
def runs(served, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora")
    verl_python = served.python()            # its runs: children of an interpreter with verl's stack imported
    model = tiny_model(tmp / "model")
    patches = verl_source.patch_files()
    names = [p.name for p in patches]
    assert {WRAP, PEFT, MERGE} <= set(names)
    trees = {"release": _tree(tmp / "release", [p for p in patches if p.name < WRAP]),
             "wrap": _tree(tmp / "wrap", [p for p in patches if p.name <= WRAP]),
             "peft": _tree(tmp / "peft", [p for p in patches if p.name <= PEFT]),
             "patched": _tree(tmp / "patched", patches)}
    variants = {
        "fsdp1": ("patched", plan_overrides("fsdp1", model)),
        "fsdp2": ("patched", plan_overrides("fsdp2", model)),
        "fsdp2-knobs": ("patched", plan_overrides("fsdp2", model, KNOBS["gather"] + KNOBS["grads"] + KNOBS["fused"])),
        "fsdp1 release": ("release", plan_overrides("fsdp1", model)),
        "fsdp1 0011": ("wrap", plan_overrides("fsdp1", model)),
        "fsdp2 0011": ("wrap", plan_overrides("fsdp2", model)),
        "fsdp1 0012": ("peft", plan_overrides("fsdp1", model)),
        "fsdp2 0012": ("peft", plan_overrides("fsdp2", model)),
    }
    out = {}
    for tree in trees:           # one process a tree, a forked child a variant
        names = [name for name, (on, _) in variants.items() if on == tree]
        for name in names:
            (tmp / f"{name}.json").write_text(json.dumps({"overrides": variants[name][1]}))
        jobs = [(tmp / f"{name}.json", tmp / name.replace(" ", "-")) for name in names]
        out.update(zip(names, runs_forked(verl_python, trees[tree], jobs), strict=True))
    out["model"], out["tree"] = model, trees["patched"]
    return out


def _ok(runs, name) -> dict:
    found, log = runs[name]
    assert found is not None, f"{name}: {log}"
    return found


@pytest.mark.parametrize("variant", ["fsdp1", "fsdp2", "fsdp2-knobs"])
def test_the_rollout_samples_the_policy_the_actor_scores(runs, variant):
    found = _ok(runs, variant)
    assert found["tokens_1"] > 0 and found["tokens_2"] > 0
    assert found["rollout_gap_1"] < GAP and found["rollout_gap_2"] < GAP, found
    # after the update the adapter moved the policy: a rollout without it would show here
    assert found["actor_vs_base_2"] > 100 * GAP and found["rollout_vs_base_2"] > 100 * GAP, found


@pytest.mark.parametrize("variant", ["fsdp1", "fsdp2", "fsdp2-knobs"])
def test_the_rollout_generates_with_the_adapter_merged_and_leaves_the_weights_as_they_were(runs, variant):
    """0013: step 2's rollout (the adapter non-zero) runs no adapter forward (PEFT's layers merged, so each calls its
    base layer alone) yet samples the adapted policy (the gap test above), and afterwards every parameter, base and
    adapter, is bit-identical to before it (the saved base tensors restored, not the merge subtracted: subtraction
    left 14 of 26 base weights off in their last bits even in fp32, within every log-prob tolerance) and no PEFT
    layer is left merged (the log-prob and ref passes need it unmerged)."""
    found = _ok(runs, variant)
    assert found["adapter_calls_in_rollout"] == 0, found
    assert found["rollout_vs_base_2"] > 100 * GAP and found["rollout_gap_2"] < GAP, found
    assert found["rollout_moved"] == [], found["rollout_moved"]
    assert found["merged_after_rollout"] == 0


@pytest.mark.parametrize("variant", ["fsdp1 0012", "fsdp2 0012"])
def test_without_0013_the_rollout_runs_every_adapter_at_every_token(runs, variant):
    """What 0013 removes: the release (with 0011-0012) generates through PEFT's unmerged layers, the adapter's two
    extra matmuls per adapted linear layer at every decoding step (1.6-1.9x the generation time on the H200)."""
    found = _ok(runs, variant)
    assert found["adapter_calls_in_rollout"] >= 2 * 7 * SHRINK["data.max_response_length"], found
    assert found["rollout_gap_2"] < GAP and found["rollout_moved"] == []


@pytest.mark.parametrize("variant", ["fsdp1", "fsdp2", "fsdp2-knobs"])
def test_the_ref_is_the_base_model(runs, variant):
    found = _ok(runs, variant)
    assert found["ref_vs_actor_1"] == 0.0                  # step 1: B is zero, the adapter adds nothing yet
    assert found["ref_vs_base_2"] < GAP, found             # step 2: the adapter is off for the ref
    assert found["actor_vs_base_2"] > 100 * GAP, found     # ... and on for the actor


@pytest.mark.parametrize("variant", ["fsdp1", "fsdp2", "fsdp2-knobs"])
def test_an_update_changes_the_adapter_only(runs, variant):
    found = _ok(runs, variant)
    # 2 layers x 7 linear layers (all-linear: q, k, v, o, gate, up, down) x (A, B)
    assert found["lora_params"] == 2 * 7 * 2
    assert all("lora_" in name for name in found["trainable"]) and found["trainable"]
    assert found["changed"] and all("lora_" in name for name in found["changed"])
    assert found["lora_A_moved"] > 1e-4 and found["lora_B_moved"] > 1e-4
    assert found["base_moved"] == 0.0
    base = found["base_same_as_file"]
    assert base["compared"] == found["params"] - found["lora_params"] and base["differ"] == 0, base


@pytest.mark.parametrize("variant", ["fsdp1", "fsdp2", "fsdp2-knobs"])
def test_the_run_is_the_plans_layout_and_saves_the_adapter(runs, variant):
    found = _ok(runs, variant)
    if variant == "fsdp1":
        assert found["strategy"] == "fsdp" and found["wrapped"] == "FullyShardedDataParallel"
        assert not found["offload_policy"]
    else:
        assert found["strategy"] == "fsdp2" and found["offload_policy"] and found["wrapped"].startswith("FSDP")
    assert found["generator_fsdp_managed"]     # more than one rank: generate() keeps them in step (synced_gpus)
    assert {"lora_adapter/adapter_config.json", "lora_adapter/adapter_model.safetensors",
            "model_world_size_1_rank_0.pt", "huggingface/config.json"} <= set(found["saved"])


def test_verls_adapter_folder_is_peft_format_with_the_plans_values(runs):
    """verl's save_checkpoint writes adapter_config.json and adapter_model.safetensors (rank 0, from
    layered_summon_lora_params): the plan's rank and alpha, PEFT's key names."""
    for variant in ("fsdp1", "fsdp2"):
        adapter = runs["model"].parent / variant / "global_step_1" / "actor" / "lora_adapter"
        config = json.loads((adapter / "adapter_config.json").read_text())
        assert config["r"] == RANK and config["lora_alpha"] == ALPHA and config["peft_type"] == "LORA"
        keys = sorted(safetensors_header(adapter / "adapter_model.safetensors"))
        assert len(keys) == 28 and all(k.startswith("base_model.model.model.layers.") for k in keys), keys[:3]
        assert all(k.endswith((".lora_A.weight", ".lora_B.weight")) for k in keys), keys[:3]


def test_without_0011_fsdp1_refuses_the_peft_model(runs):
    """The release unwraps the HF rollout's model (one FSDP1 unit), and FSDP1 cannot flatten frozen and trainable
    parameters together."""
    found, log = runs["fsdp1 release"]
    assert found is None and "Must flatten tensors with uniform `requires_grad`" in log, log[-1500:]


def test_without_0012_the_rollout_samples_with_the_models_generation_config(runs):
    """0004 stops transformers from merging generation_config.json's sampling values (the tiny model's: temperature
    0.7, top_p 0.8) by asking generate() for use_model_defaults; a PEFT model's generate takes ``**kwargs``, so
    without 0012 0004 never passes it and the rollout samples another distribution than the actor scores."""
    found = _ok(runs, "fsdp1 0011")
    assert found["rollout_gap_1"] > 0.1, found
    assert found["ref_vs_base_2"] < GAP and found["base_moved"] == 0.0       # the rest already holds


def test_without_0012_fsdp2_generates_with_the_root_never_gathered(runs):
    """A PEFT model's generate() calls its base model, not the FSDP2 root: without 0012 the root's own parameters
    stay sharded DTensors, and the embedding refuses them."""
    found, log = runs["fsdp2 0011"]
    assert found is None and "got mixed torch.Tensor and DTensor" in log, log[-1500:]


def test_the_gpu_probe_measures_the_actors_gap_not_the_ref_pass(runs, served, tmp_path):
    """The GPU harness's probe (bench/gpu/probe/sitecustomize.py) records the rollout/actor log-prob gap on each
    compute_log_prob. With LoRA, verl's compute_ref_log_prob is that call with the adapter disabled: the probe
    records the actor's two passes (steps 1 and 2) and not the ref's, whose log-probs are the base model's (at step 2
    far from the rollout's once the adapter moved)."""
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"overrides": plan_overrides("fsdp2", runs["model"])}))
    probe_dir = tmp_path / "probe"
    env = {**os.environ, "PYTHONPATH": f"{PROBE}{os.pathsep}{runs['tree']}", "VERL_LAB_PROBE_DIR": str(probe_dir)}
    found, log = _run(served.python(env), runs["tree"], spec, tmp_path / "out", env=env)
    assert found is not None, log
    records = [json.loads(line) for f in probe_dir.glob("*.jsonl") for line in f.read_text().splitlines()]
    gaps = [r for r in records if r["event"].startswith("logprob_gap")]
    assert [r["event"] for r in gaps] == ["logprob_gap", "logprob_gap"], gaps
    assert all(r["logprob_gap_max"] < GAP for r in gaps), gaps
    assert found["actor_vs_base_2"] > 100 * GAP          # the ref pass would have shown this
