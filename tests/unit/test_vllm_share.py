"""The plans' vLLM share, judged by vLLM 0.8.5's own accounting of gpu_memory_utilization.

How the release (vllm-0.8.5 sdist) turns the share into a KV cache, restated here as plain
arithmetic over a simulated GPU (the project's own code, not vLLM's):

* V1 engine, ``vllm/v1/worker/gpu_worker.py`` ``Worker.determine_available_memory``:
  ``total * share - (torch's allocated peak during profile_run + (GPU memory in use - torch's
  allocated bytes))``. The peak counts every tensor of the process (verl's actor and critic
  are already built in it), the second term the CUDA context and anything else on the GPU.
* V0 engine, ``vllm/worker/worker.py`` ``Worker.determine_num_available_blocks`` with
  ``vllm/utils.py`` ``memory_profiling``: ``total * share - (weights + torch's peak increase
  during profile_run + the non-torch increase since the worker was created)``: only vLLM's own.

The simulated process is built from each plan's overrides (offloads, dtypes, lengths, batch),
the model's config.json, and one measured figure: 1311 MiB outside PyTorch per process on the
H200 (docs/training-runs.md). On the plans before the engine was pinned (share 0.05-0.10 on
3090/A100/H100), V1's arithmetic gives a negative KV cache: vLLM stops with "No available
memory for the cache blocks".
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tasks.memory import ModelShape
from tasks.plan import GpuTarget, make_plan
from tests.unit.test_plan import overrides_of, workload

MIB = 1024 * 1024
CONTEXT_MIB = 1311          # outside PyTorch per process, measured on the H200
VLLM_EXTRA_MIB = 256        # NCCL/cuBLAS a vLLM worker adds outside torch (a generous figure)

PLANS = [
    ("NVIDIA GeForce RTX 3090", "8.6", 24576, "v1"),
    ("NVIDIA A100-SXM4-80GB", "8.0", 81920, "v1"),
    ("NVIDIA H100 80GB HBM3", "9.0", 81559, "v1"),
    ("Tesla T4", "7.5", 15360, "v0"),
    ("Tesla V100-SXM2-32GB", "7.0", 32768, "v0"),
]


def _bytes(dtype: str) -> int:
    return {"float32": 4, "fp32": 4, "float16": 2, "bfloat16": 2, "bf16": 2}[dtype]


class SimulatedGpu:
    """GPU memory as vLLM's profiler reads it: torch's allocated bytes (current and peak) and
    what is in use on the device."""

    def __init__(self, total_mib: int):
        self.total = total_mib * MIB
        self.allocated = 0
        self.peak = 0
        self.non_torch = 0

    def alloc(self, mib: float) -> None:
        self.allocated += int(mib * MIB)
        self.peak = max(self.peak, self.allocated)

    def free(self, mib: float) -> None:
        self.allocated -= int(mib * MIB)

    @property
    def in_use(self) -> int:
        return self.allocated + self.non_torch


def _profile_activation_mib(shape: ModelShape, dtype: str, tokens: int, seqs: int) -> float:
    # vLLM's profile_run: a dummy forward over max_num_batched_tokens tokens, one layer at a
    # time (residual and hidden states, q/k/v, attention output, gate/up and the activated
    # MLP alive together), then the sampler over max_num_seqs rows: fp32 logits, probabilities,
    # log-probabilities, sorted values and int64 sort indices for top-p/top-k, masks
    w = _bytes(dtype)
    layer = tokens * (shape.hidden * 2 + shape.q_dim * 2 + 2 * shape.kv_dim + 3 * shape.ffn) * w
    sampler = seqs * shape.vocab * 4 * 8
    return (layer + sampler) / MIB


def _kv_cache(plan, engine: str, shape: ModelShape, total_mib: int | None = None, others_mib: float = 0.0,
              share: float | None = None) -> tuple[float, float, dict]:
    """(KV cache MiB vLLM grants, MiB one step's sequences need, the simulated state). ``total_mib``:
    the total CUDA counts (default: the plan's GPU memory); ``others_mib``: what other processes
    hold on the GPU the whole time (device memory torch did not allocate); ``share``: another share
    than the plan's."""
    ov = overrides_of(plan)
    gpu = SimulatedGpu(total_mib or plan.gpu.memory_mib)
    gpu.non_torch = int((CONTEXT_MIB + others_mib) * MIB)
    P_a, P_c = shape.params("actor"), shape.params("critic")
    model_bytes = _bytes(ov["actor_rollout_ref.actor.fsdp_config.model_dtype"])
    # verl's init order (ray_trainer.init_workers): critic, then the actor, then vLLM
    if not ov["critic.model.fsdp_config.param_offload"]:
        gpu.alloc(_bytes(ov["critic.model.fsdp_config.model_dtype"]) * P_c / MIB)
    if not ov["actor_rollout_ref.actor.fsdp_config.param_offload"]:
        gpu.alloc(model_bytes * P_a / MIB)
    share = share or ov["actor_rollout_ref.rollout.gpu_memory_utilization"]
    rdtype = ov["actor_rollout_ref.rollout.dtype"]
    # vLLM worker init: empty_cache + reset_peak_memory_stats, then V0's baseline snapshot
    gpu.peak = gpu.allocated
    states = gpu.allocated / MIB
    baseline_non_torch = gpu.non_torch
    gpu.non_torch += VLLM_EXTRA_MIB * MIB
    weights = _bytes(rdtype) * P_a / MIB
    gpu.alloc(weights)
    before_profile_alloc = gpu.allocated
    gpu.peak = gpu.allocated                       # reset_peak_memory_stats before profile_run
    seqs = ov["actor_rollout_ref.rollout.engine_kwargs.vllm.max_num_seqs"]
    act = _profile_activation_mib(shape, rdtype, ov["actor_rollout_ref.rollout.max_num_batched_tokens"], seqs)
    gpu.alloc(act)
    gpu.free(act)
    if engine == "v1":
        kv = gpu.total * share - (gpu.peak + (gpu.in_use - gpu.allocated))
    else:
        torch_peak_increase = gpu.peak - before_profile_alloc
        non_torch_increase = gpu.non_torch - baseline_non_torch
        kv = gpu.total * share - (weights * MIB + torch_peak_increase + non_torch_increase)
    seq_len = ov["data.max_prompt_length"] + ov["data.max_response_length"]
    need = shape.kv_bytes_per_token("bf16" if rdtype != "float32" else "fp32") * seqs * seq_len
    state = {"share": share, "held_mib": states, "act_mib": act, "weights_mib": weights,
             "optimizer_mib": (0 if ov["actor_rollout_ref.actor.fsdp_config.optimizer_offload"] else 8 * P_a / MIB)
             + (0 if ov["critic.model.fsdp_config.optimizer_offload"] else 8 * P_c / MIB)}
    return kv / MIB, need / MIB, state


@pytest.fixture(scope="module")
def shape():
    from tasks.plan import load_model_config

    return ModelShape.from_config(load_model_config())


@pytest.mark.parametrize("name,cc,mem,engine", PLANS)
def test_plan_pins_the_engine_it_sized_the_share_for(name, cc, mem, engine):
    plan = make_plan(GpuTarget(name, cc, mem), workload())
    assert plan.env["VLLM_USE_V1"] == ("1" if engine == "v1" else "0")
    assert any(r.setting == "VLLM_USE_V1" and r.why for r in plan.reasons)
    assert "V1" in next(o.why for o in plan.overrides if o.key.endswith("gpu_memory_utilization")) \
        or engine == "v0"


@pytest.mark.parametrize("name,cc,mem,engine", PLANS)
def test_the_share_holds_one_steps_sequences_under_vllms_own_accounting(name, cc, mem, engine, shape):
    plan = make_plan(GpuTarget(name, cc, mem), workload())
    kv, need, state = _kv_cache(plan, engine, shape)
    assert kv >= need, (f"{name} ({engine}): share {state['share']} gives a KV cache of {kv:.0f} MiB, "
                        f"one step's sequences need {need:.0f} MiB; held at start {state['held_mib']:.0f} MiB")
    # and at a later rollout, with the optimizer states made by the first update, the whole
    # process (held states + optimizer + vLLM's weights, KV cache and activations + context)
    # still fits the card
    later = state["held_mib"] + state["optimizer_mib"] + state["weights_mib"] + kv + state["act_mib"] \
        + CONTEXT_MIB + VLLM_EXTRA_MIB
    assert later <= mem, f"{name}: {later:.0f} MiB at a later rollout on a {mem} MiB card"


def test_v1_counts_what_the_process_holds_v0_does_not(shape):
    """The same share means far less KV cache under V1 on a box that holds fp32 training states:
    the reason the engine must be pinned with the share."""
    plan = make_plan(GpuTarget("NVIDIA GeForce RTX 3090", "8.6", 24576), workload())
    kv1, _, st = _kv_cache(plan, "v1", shape)
    kv0, _, _ = _kv_cache(plan, "v0", shape)
    assert kv0 - kv1 == pytest.approx(st["held_mib"] + CONTEXT_MIB, rel=0.01)


@pytest.mark.parametrize("share", [0.05, 0.10])
def test_the_old_shares_leave_no_kv_cache_under_v1(share, shape):
    """What the plans set before the engine was pinned: V1 finds no memory for cache blocks."""
    from dataclasses import replace

    plan = make_plan(GpuTarget("NVIDIA GeForce RTX 3090", "8.6", 24576), workload())
    plan.overrides = [replace(o, value=share) if o.key.endswith("gpu_memory_utilization") else o
                      for o in plan.overrides]
    kv, need, _ = _kv_cache(plan, "v1", shape)
    assert kv < 0 < need


# ---- the GPU as it is at launch: what other processes hold (verl_lab_box/vllm_share.py) -------------

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "nvidia-smi"


def at_launch(capture: str):
    """The GPUs of a recorded nvidia-smi (tests/fixtures/nvidia-smi/) as the launcher reads them."""
    from tests.unit.test_launch_share import sections
    from verl_lab_box.gpu import parse_memory, parse_processes
    from verl_lab_box.vllm_share import GpuAtLaunch

    out = sections(FIXTURES / capture)
    procs = parse_processes(out["nvidia-smi"])
    return [GpuAtLaunch(m.index, m.cuda_total_mib, m.used_mib,
                        tuple((p.pid, p.name, p.used_mib) for p in procs if p.gpu == m.index))
            for m in parse_memory(out["nvidia-smi --query-gpu=index,memory.total,memory.used,memory.free "
                                      "--format=csv,noheader,nounits"])]


def test_what_other_processes_hold_shrinks_v1s_kv_cache_not_v0s(shape):
    """vLLM's own profilers replayed: a display server's 812 MiB comes off V1's KV cache whole; V0
    snapshots it at its start and it cancels. Both multiply the share by CUDA's total."""
    plan = make_plan(GpuTarget("NVIDIA GeForce RTX 3090", "8.6", 24576), workload())
    (g,) = at_launch("rtx3090-display.txt")
    assert (g.cuda_total_mib, g.in_use_mib) == (24250, 812)
    for engine in ("v1", "v0"):
        idle, _, _ = _kv_cache(plan, engine, shape, total_mib=g.cuda_total_mib)
        busy, _, _ = _kv_cache(plan, engine, shape, total_mib=g.cuda_total_mib, others_mib=g.in_use_mib)
        assert idle - busy == pytest.approx(812 if engine == "v1" else 0, abs=1)


@pytest.mark.parametrize("capture, name, cc, mem, planned, launched", [
    ("rtx3090-display.txt", "NVIDIA GeForce RTX 3090", "8.6", 24576, 0.42, 0.46),
    ("t4-other-job.txt", "Tesla T4", "7.5", 15360, 0.3, 0.3),
])
def test_the_launch_share_keeps_the_plans_kv_cache_on_the_gpu_as_it_is(capture, name, cc, mem, planned, launched,
                                                                        shape):
    """The launcher's share (vllm_share.launch_share, from plan.json's vllm section and a recorded
    nvidia-smi): vLLM's replayed accounting grants the KV cache one step's sequences need at it,
    with the other processes present; under V1 the plan's own share would no longer (the display
    server's memory and CUDA's smaller total come off it); the launch share is the smallest that
    gives the plan's KV cache (0.01 less does not)."""
    from verl_lab_box.vllm_share import kv_cache_mib, launch_share

    plan = make_plan(GpuTarget(name, cc, mem), workload())
    vllm = plan.to_dict()["vllm"]
    gpus = at_launch(capture)
    decision = launch_share(vllm, gpus)
    assert (decision.planned, decision.share, decision.fits) == (planned, launched, True)
    g = gpus[0]
    kv, need, _ = _kv_cache(plan, vllm["engine"], shape, total_mib=g.cuda_total_mib, others_mib=g.in_use_mib,
                            share=decision.share)
    assert kv >= need
    args = (vllm["engine"], g.cuda_total_mib, vllm["own_mib"], vllm["held_at_start_mib"], g.in_use_mib)
    assert kv_cache_mib(args[0], decision.share, *args[1:]) >= vllm["kv_wanted_mib"]
    if decision.changed:
        assert kv_cache_mib(args[0], decision.share - 0.01, *args[1:]) < vllm["kv_wanted_mib"]
        assert kv_cache_mib(args[0], planned, *args[1:]) < vllm["kv_wanted_mib"]


def test_the_plan_and_the_launcher_share_one_arithmetic(shape):
    """tasks/memory/generate.py's vllm_memory sizes the plan's share with verl_lab_box/vllm_share.py: on an idle GPU
    of the plan's size, the launcher's arithmetic gives the plan's own share back."""
    from verl_lab_box.vllm_share import GpuAtLaunch, launch_share

    for name, cc, mem, _ in PLANS:
        plan = make_plan(GpuTarget(name, cc, mem), workload())
        vllm = plan.to_dict()["vllm"]
        assert vllm["share"] == plan.memory.vllm_gpu_memory_utilization
        again = launch_share({**vllm, "share": 0.0}, [GpuAtLaunch(0, mem, 0)])
        assert again.share == vllm["share"], (name, again)
