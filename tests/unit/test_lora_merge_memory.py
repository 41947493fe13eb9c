"""Patch 0013's merge in the memory model (issue 42, tasks/memory/lora.py ``lora_merge``): the HF rollout of a LoRA
actor merges one FSDP unit at a time (GPU: the largest decoder layer with its adapters and one weight's fp32 delta,
nothing gathered on one GPU, never the whole model) and each rank copies only its own shard of the adapted decoder
layers to host memory (a box: the decoder once, in the training dtype), which plan.json's host RAM carries per box
and the launcher's preflight checks.

What this proves: the arithmetic and where the plan puts it. Not proven: the merge's memory on a GPU (patch 0013 as
rewritten in issue 42 has not run there); the merge itself is tested on CPU ranks with verl's worker
(tests/unit/test_lora_worker.py).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from tasks.memory import ModelShape
from tasks.memory.lora import LoraSpec, adapted_base_params, lora_merge
from tasks.plan import GpuTarget, cluster_plan, make_plan, with_model
from tasks.plan.workload import catalog_models
from tests.unit.test_plan import workload

REPO = Path(__file__).resolve().parents[2]
MIB = 1024 * 1024
GTX1080 = GpuTarget("NVIDIA GeForce GTX 1080", "6.1", 8192)


def shape(name: str) -> ModelShape:
    return ModelShape.from_config(json.loads((REPO / "files/models" / name / "config.json").read_text()))


def qwen15() -> object:
    from tasks.catalog import default_catalog

    art = next(a for a in catalog_models(default_catalog()) if a.repo == "Qwen/Qwen2.5-1.5B-Instruct")
    return with_model(workload(), art, "/opt/verl-lab/models/Qwen--Qwen2.5-1.5B-Instruct")


@pytest.mark.parametrize("name,fp32_mib,bf16_mib", [("qwen2.5-0.5b-instruct", 1365, 683),
                                                     ("qwen2.5-3b-instruct", 10584, 5292)])
def test_a_box_saves_the_adapted_decoder_once_whatever_its_gpus(name, fp32_mib, bf16_mib):
    """Each rank copies its flat-parameter shard of every decoder layer that holds an adapted weight (the whole layer:
    the adapted linear weights, docs/training-runs.md's 1365 / 683 MiB for the 0.5B and 10584 / 5292 for the 3B, and
    the layer's norms and biases), in the base's dtype; each of n ranks 1/n of it."""
    s = shape(name)
    for dtype, mib in (("fp32", fp32_mib), ("bf16", bf16_mib)):
        spec = LoraSpec(base_dtype=dtype)
        whole = lora_merge(s, spec, 1).host_mib
        assert whole == pytest.approx((4 if dtype == "fp32" else 2) * s.layers * s.layer_params / MIB)
        assert whole == pytest.approx(mib, abs=1)
        for n in (2, 4):
            assert lora_merge(s, spec, n).host_mib * n == pytest.approx(whole)
    # attention-only adapters still copy whole layers (the unit is the layer), and merge into q and v alone
    attention_only = LoraSpec(targets=("q_proj", "v_proj"), base_dtype="fp32")
    assert lora_merge(s, attention_only, 1).host_mib == lora_merge(s, LoraSpec(base_dtype="fp32"), 1).host_mib
    assert adapted_base_params(s, attention_only) == s.layers * s.hidden * (s.q_dim + s.kv_dim)


def test_the_merge_gathers_one_layer_never_the_model():
    """FSDP1 on several GPUs gathers the unit it merges: one decoder layer with its adapters (fp32), plus one
    weight's fp32 delta (the weight is added into it, the sum rounded once into the weight); on one GPU (NO_SHARD)
    nothing is gathered, only the delta."""
    s = shape("qwen2.5-1.5b-instruct")
    fp32, bf16 = LoraSpec(base_dtype="fp32"), LoraSpec(base_dtype="bf16")
    largest = s.hidden * s.ffn                                  # gate_proj / up_proj / down_proj
    layer_adapters = 32 * (7 * s.hidden + 2 * s.q_dim + 2 * s.kv_dim + 3 * s.ffn)
    assert lora_merge(s, fp32, 2).gpu_mib == pytest.approx((4 * s.layer_params + 4 * layer_adapters
                                                            + 4 * largest) / MIB)
    assert lora_merge(s, bf16, 2).gpu_mib == pytest.approx((2 * s.layer_params + 4 * layer_adapters
                                                            + 4 * largest) / MIB)
    assert lora_merge(s, fp32, 1).gpu_mib == pytest.approx(4 * largest / MIB)
    whole = 4 * s.params("actor") / MIB
    assert lora_merge(s, fp32, 2).gpu_mib < whole / 20


def test_two_gtx1080s_train_the_15b_with_lora_by_their_numbers():
    """The issue's case: 2 x GTX 1080 with Qwen2.5-1.5B is grpo-lora, fp32, HF rollout. Its merge moment (the
    resident states + one layer gathered) is far below its largest phase, and the plan fits its budget; the whole
    fp32 model gathered on top of the resident states (0013 before issue 42) would not have fitted at all."""
    plan = make_plan(GpuTarget(GTX1080.name, GTX1080.compute_capability, GTX1080.memory_mib, 2), qwen15())
    d, bd = plan.to_dict(), plan.estimate.breakdown
    assert (plan.rung, plan.precision.train_dtype, plan.precision.rollout) == ("grpo-lora", "fp32", "hf")
    s = shape("qwen2.5-1.5b-instruct")
    assert bd["lora_frozen_base"] == round(4 * s.params("actor") / 2 / MIB)          # each GPU half the base
    merge = lora_merge(s, LoraSpec(base_dtype="fp32"), 2)
    assert bd["lora_merge_gpu"] == round(merge.gpu_mib) and 200 < bd["lora_merge_gpu"] < 260
    merge_moment = bd["resident"] + bd["lora_merge_gpu"]
    phases = {k: v for k, v in bd.items() if k.startswith("phase_")}
    assert merge_moment < max(phases.values()) and bd["phase_rollout"] >= merge_moment
    assert d["predicted_peak_mib"] == max(phases.values()) + bd["cuda_context"] <= d["budget_mib"]
    whole_gather = bd["resident"] + bd["cuda_context"] + 4 * s.params("actor") / MIB
    assert whole_gather > GTX1080.memory_mib                                        # the issue's ~10.4 GiB
    # host: each rank its shard, the box the adapted base once, in fp32
    assert d["predicted_lora_merge_host_mib"] == 2 * bd["lora_merge_host"]
    assert d["predicted_lora_merge_host_mib"] == pytest.approx(4 * s.layers * s.layer_params / MIB, abs=2)
    assert d["predicted_host_ram_mib"] == d["predicted_lora_merge_host_mib"]         # nothing else is offloaded
    why = next(r for r in plan.reasons if r.setting == "lora_merge")
    assert why.value == f"{d['predicted_lora_merge_host_mib']} MiB host, {bd['lora_merge_gpu']} MiB GPU"
    assert "one FSDP unit at a time" in why.why and "never the whole model" in why.why


def test_host_ram_is_per_box_and_a_ray_node_counts_its_own_gpus():
    """plan.json's predicted_host_ram_mib is what one box holds: its GPUs' shares. Two boxes of one GTX 1080 each
    (a Ray cluster) hold one share each of the same world of two ranks."""
    box = make_plan(GpuTarget(GTX1080.name, "6.1", 8192, 2), qwen15()).to_dict()
    node = cluster_plan({"a": GTX1080, "b": GTX1080}, qwen15()).to_dict()
    assert node["rung"] == box["rung"] == "grpo-lora"
    assert node["breakdown"]["lora_merge_host"] == box["breakdown"]["lora_merge_host"]
    assert node["predicted_host_ram_mib"] * 2 == box["predicted_host_ram_mib"]
    # the offload rung's states too: per rank in the model, per box in the plan
    offload = make_plan(GpuTarget(GTX1080.name, "6.1", 8192, 2), workload(finetune="full")).to_dict()
    assert offload["rung"] == "grpo-cpu-offload"
    assert offload["predicted_host_ram_mib"] == 2 * offload["breakdown"]["host_ram"]


def test_vllm_plans_merge_nothing():
    plan = make_plan(GpuTarget("NVIDIA GeForce RTX 3060", "8.6", 12288), workload())
    assert plan.precision.rollout == "vllm" and plan.workload.lora
    assert plan.estimate.breakdown["lora_merge_host"] == plan.estimate.breakdown["lora_merge_gpu"] == 0
    assert plan.to_dict()["predicted_lora_merge_host_mib"] == 0


def test_the_preflight_checks_the_box_holds_the_saved_base(tmp_path):
    spec = importlib.util.spec_from_file_location("launcher_mod", REPO / "verl_lab_box" / "train_launcher.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    lines = []

    class Rep:
        def ok(self, name, text):
            lines.append(("ok", name, text))

        def fail(self, name, text):
            lines.append(("fail", name, text))

    class Launch:
        predicted_host_ram_mib = 4998
        predicted_lora_merge_host_mib = 4998

    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:        4096000 kB\n")
    mod.preflight_module().check_host_ram(Rep(), Launch(), str(meminfo))
    assert lines == [("fail", "host ram", "the plan keeps 4998 MiB in host RAM (0 MiB of offloaded model states, "
                      "4998 MiB of base weights saved while the LoRA adapter is merged for generation), the box "
                      "has 4000 MiB in all: train a smaller model (workload.model) or add RAM")]


def test_plan_json_hands_the_launcher_the_merges_host_ram():
    """deploy/train.py's plan.json: the launch section carries the box's host RAM and the merge's part of it, which
    the launcher reads (verl_lab_box/train_launcher.py Launch) for the preflight above."""
    from tasks.settings import load_settings
    from tasks.train import TrainingLayout, training_workload

    settings = load_settings("box", {"lab_root": "/tmp/vl/box", "workload": {"model": "Qwen/Qwen2.5-1.5B-Instruct"}})
    plan = make_plan(GpuTarget(GTX1080.name, "6.1", 8192, 2), training_workload(settings))
    launch = json.loads(TrainingLayout(settings=settings, plan=plan, plan_source="gpu_override").plan_json())["launch"]
    assert launch["predicted_lora_merge_host_mib"] == plan.to_dict()["predicted_lora_merge_host_mib"] > 4900
    assert launch["predicted_host_ram_mib"] == plan.to_dict()["predicted_host_ram_mib"]


def test_the_run_checks_count_the_merges_host_copy_once_with_the_training_states():
    """tasks/run_bounds.py reads the plan's key for 0013's copy and checks it with what training holds beside it
    (one need: both are in host memory at once), never twice. Mutations: the copy read under another key (the
    need loses its part), or added on top of predicted_host_ram_mib (the need grows)."""
    from tasks.run_bounds import host_ram_needs
    plan = make_plan(GpuTarget(GTX1080.name, GTX1080.compute_capability, GTX1080.memory_mib, 2), qwen15()).to_dict()
    copy = plan["predicted_lora_merge_host_mib"]
    assert copy > 4900
    (training, *_rest) = host_ram_needs(plan)
    assert training[1] == plan["predicted_host_ram_mib"]
    assert f"LoRA's host copy of the adapted weights (patch 0013), {copy} MiB" in training[0], training
