"""The memory estimate of one choice: the project's memory model (tasks/memory/) asked about a
plan's GPU, workload, precision and MemoryChoice (``default_estimator``), what a plan may use of a
GPU (``gpu_budget_mib``) and vLLM's share of it (``vllm_memory_for``, between VLLM_SHARE_MIN and
VLLM_SHARE_MAX)."""

from __future__ import annotations

from tasks.plan.precision import vllm_engine
from tasks.plan.terms import OFFLOAD_KNOBS, GpuTarget, MemoryChoice, MemoryEstimate, PlanError, Precision, Workload

VLLM_SHARE_MAX = 0.9       # never give vLLM more of the GPU than this


VLLM_SHARE_MIN = 0.05


_MEM_DTYPE = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "bf16": "bf16", "fp32": "fp32", "fp16": "fp16"}


def gpu_budget_mib(gpu: GpuTarget) -> int:
    """What a plan may use of one GPU: total minus what the driver keeps (an idle H200 shows
    615 MiB in use of 143771) and allocator fragmentation: 5%, at least 512 MiB; and minus the
    margin for what a real old card's process may hold outside PyTorch beyond what the H200
    measured (tasks/memory/shape.py: OLD_CARD_OUTSIDE_TORCH_MARGIN_MIB, never measured; the predicted
    peak counts only the measured 1368 MiB)."""
    from tasks.memory import OLD_CARD_OUTSIDE_TORCH_MARGIN_MIB

    return gpu.memory_mib - max(512, gpu.memory_mib // 20) - int(OLD_CARD_OUTSIDE_TORCH_MARGIN_MIB)


def max_num_batched_tokens(workload: Workload) -> int:
    """vLLM's chunked-prefill budget: at least one whole sequence (prompt + response)."""
    return max(8192, workload.sequence_length)


def vllm_memory_for(gpu: GpuTarget, workload: Workload, precision: Precision, choice: MemoryChoice):
    """vLLM's share and footprint for this plan's engine (tasks.memory.vllm_memory)."""
    from tasks.memory import ModelShape, held_at_vllm_start_mib, vllm_memory
    from tasks.memory.lora import lora_held_at_vllm_start_mib

    shape = ModelShape.from_config(dict(workload.model_config))
    wl = _verl_workload(gpu, workload, precision, choice)
    dtype = _MEM_DTYPE[precision.rollout_dtype]
    return vllm_memory(
        shape, engine=vllm_engine(gpu), dtype=dtype, gpu_memory_mib=gpu.memory_mib,
        seqs=choice.rollout_micro_batch, seq_len=workload.sequence_length, tp=choice.rollout_tp,
        max_num_batched_tokens=max_num_batched_tokens(workload),
        held_at_start_mib=lora_held_at_vllm_start_mib(shape, wl, lora_spec(workload, precision)) if workload.lora
        else held_at_vllm_start_mib(shape, wl),
        share_min=VLLM_SHARE_MIN, share_max=VLLM_SHARE_MAX,
        lora_mib=vllm_lora_mib_for(gpu, workload, precision, choice) if workload.lora else 0.0)


def vllm_lora_mib_for(gpu: GpuTarget, workload: Workload, precision: Precision, choice: MemoryChoice) -> float:
    """vLLM 0.8.5's LoRA buffers on each GPU of this plan's engine (tasks/memory/vllm_lora.py): the model's class,
    the rank, the rollout's dtype, tensor-parallel size, max_num_seqs and max_num_batched_tokens."""
    from tasks.memory import ModelShape
    from tasks.memory.vllm_lora import vllm_lora_mib

    arch = (workload.model_config.get("architectures") or [""])[0]
    return vllm_lora_mib(ModelShape.from_config(dict(workload.model_config)), workload.lora_rank,
                         _MEM_DTYPE[precision.rollout_dtype], choice.rollout_tp, arch,
                         max_num_batched_tokens(workload), choice.rollout_micro_batch * choice.rollout_tp,
                         vllm_engine(gpu))


def lora_spec(workload: Workload, precision: Precision):
    """The memory model's LoRA (tasks/memory/lora.py) of a LoRA rung: its rank and targets, the frozen base in
    the training dtype (the plan's actor model_dtype on LoRA rungs: tasks/plan/lora.py)."""
    from tasks.memory.lora import LORA_MODULES, LoraSpec

    targets = LORA_MODULES if workload.target_modules == "all-linear" else tuple(workload.target_modules)
    return LoraSpec(rank=workload.lora_rank, targets=targets, base_dtype=precision.train_dtype)


def _verl_workload(gpu: GpuTarget, workload: Workload, precision: Precision, choice: MemoryChoice,
                   vllm_rollout_mib: float | None = None):
    from tasks.memory import VerlWorkload

    off = choice.offload
    return VerlWorkload(
        train_dtype=precision.train_dtype,
        # the estimator models sdpa and eager; flash_attention_2 needs no more than sdpa
        attn="sdpa" if precision.attn_implementation in ("sdpa", "flash_attention_2") else "eager",
        grad_ckpt=choice.grad_ckpt,
        micro_batch=choice.actor_micro_batch,
        critic_micro_batch=choice.critic_micro_batch,
        log_prob_micro_batch=choice.log_prob_micro_batch,
        seq_len=workload.sequence_length,
        rollout=precision.rollout,
        rollout_dtype=_MEM_DTYPE[precision.rollout_dtype],
        rollout_batch=choice.rollout_micro_batch,
        prompt_len=workload.max_prompt_length,
        response_len=workload.max_response_length,
        vllm_rollout_mib=vllm_rollout_mib,
        gpu_memory_mib=gpu.memory_mib,
        use_critic=workload.uses_critic,
        use_ref=workload.uses_reference,
        n_gpus=gpu.count,
        actor_param_offload=bool(off.get("actor_param_offload")),
        actor_optimizer_offload=bool(off.get("actor_optimizer_offload")),
        ref_param_offload=bool(off.get("ref_param_offload")),
        actor_offload_policy=workload.actor_offload_policy,
        critic_param_offload=bool(off.get("critic_param_offload")),
        critic_optimizer_offload=bool(off.get("critic_optimizer_offload")),
        **{k: getattr(choice, k) for k in OFFLOAD_KNOBS if k != "fused_adamw"},    # no GPU memory of its own
    )


def default_estimator(gpu: GpuTarget, workload: Workload, precision: Precision, choice: MemoryChoice) -> MemoryEstimate:
    """The project's memory model for one choice (tasks/memory/verl_budget.py: verl_gpu_budget; on a LoRA rung
    tasks/memory/lora.py: lora_gpu_budget)."""
    from tasks.memory import ModelShape, verl_gpu_budget
    from tasks.memory.lora import lora_gpu_budget

    if not workload.model_config:
        raise PlanError("the workload has no model config.json: the memory estimate needs the model's shape")
    shape = ModelShape.from_config(dict(workload.model_config))
    vllm = vllm_memory_for(gpu, workload, precision, choice) if precision.rollout == "vllm" else None
    wl = _verl_workload(gpu, workload, precision, choice, vllm.rollout_mib if vllm else None)
    est = lora_gpu_budget(shape, wl, lora_spec(workload, precision)) if workload.lora else verl_gpu_budget(shape, wl)
    breakdown = {k: int(round(v)) for k, v in est.breakdown.items()}
    # per GPU (rank): offloaded states, vLLM's weights asleep, patch 0013's saved shard; the plan's host RAM is per box
    breakdown["host_ram"] = int(round(est.host_ram_mib))
    if vllm is not None and workload.lora:
        breakdown["vllm_lora"] = int(round(vllm.lora_mib))
    peak = int(round(est.peak_mib))
    if vllm is not None:
        breakdown.update({"vllm_kv_wanted": int(round(vllm.kv_wanted_mib)),
                          "vllm_kv_granted": int(round(vllm.kv_granted_mib))})
        if vllm.kv_granted_mib < vllm.kv_wanted_mib:
            peak = max(peak, gpu.memory_mib)      # vLLM's share cannot hold one step's sequences
    return MemoryEstimate(peak_mib=peak, budget_mib=gpu_budget_mib(gpu), breakdown=breakdown,
                          vllm_gpu_memory_utilization=vllm.share if vllm else None,
                          vllm={"engine": vllm.engine, "share": vllm.share, "own_mib": round(vllm.own_mib, 1),
                                "held_at_start_mib": round(vllm.held_at_start_mib, 1),
                                "kv_wanted_mib": round(vllm.kv_wanted_mib, 1), "gpu_memory_mib": gpu.memory_mib}
                          if vllm else None)
