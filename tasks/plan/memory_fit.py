"""The memory fit of one rung: the fastest choice the memory estimate fits. Gradient checkpointing,
offloads (fewest first, in OFFLOAD_LADDER's order), the update micro-batch, then the no-gradient
passes' micro-batch, the HF rollout's chunk and vLLM's tensor-parallel size (``search_memory``);
on the CPU-offload rung the speed model (tasks/speed.py) ranks what fits, phase by phase
(``search_offload``), among the speed knobs it may try (``knob_values``: UNMEASURED_KNOBS stay
off). Nothing fits: PlanError with the shortfall (``short_mib``), which the ladder reads."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

from tasks.plan.estimator import _MEM_DTYPE, VLLM_SHARE_MAX
from tasks.plan.terms import (
    OFFLOAD_KNOBS,
    OFFLOAD_LADDER,
    Estimator,
    GpuTarget,
    MemoryChoice,
    MemoryEstimate,
    PlanError,
    Precision,
    Reason,
    Workload,
)

MICRO_BATCH_CHOICES = (16, 8, 4, 2, 1)          # update micro-batches (sequences per GPU)
FORWARD_MICRO_CHOICES = (64, 32, 16, 8, 4, 2, 1)  # no-gradient passes: actor log-probs, critic values
ROLLOUT_CHUNK_CHOICES = (256, 128, 64, 32, 16, 8, 4, 2, 1)   # prompts per HF generate() call


# Knobs the plan leaves off until a GPU run has measured their memory (issue 29: every new setting's estimate
# calibrated on the GPU like the others). The update's two (the actor held gathered through each mini-batch,
# gradients summed unsharded on the GPU: patches 0007-0008) never ran to its end on a GPU: GPU call 13 cut the
# update under the profiler. Measured: the gathered generation and log-prob passes (call 13, within 4% of the
# model); the fused AdamW holds no GPU memory. bench/gpu/run_speed.sh measures the rest; then empty this.
UNMEASURED_KNOBS = frozenset({"actor_gather_once", "accumulate_grads_unsharded"})


def knob_values(knob: str) -> tuple[bool, ...]:
    """The values the plan tries for a speed knob: (True, False), or (False,) while it is unmeasured."""
    return (False,) if knob in UNMEASURED_KNOBS else (True, False)


def offload_levels(workload: Workload, precision: Precision) -> list[dict[str, bool]]:
    """The cumulative offload states to try, fewest first."""
    steps = [k for k in OFFLOAD_LADDER
             if k != "ref_param_offload"        # no effect in verl 0.5.0: its FSDP1 ref stays on the GPU (call 12)
             # LoRA: the adapters' AdamW states are megabytes; only the frozen base is worth offloading
             and not (k == "actor_optimizer_offload" and workload.lora)
             and not (k == "actor_param_offload" and precision.rollout == "hf")
             and not (k.startswith("critic") and not workload.uses_critic)]
    levels = []
    on: set[str] = set()
    levels.append({k: False for k in OFFLOAD_LADDER})
    for k in steps:
        on.add(k)
        levels.append({kk: kk in on for kk in OFFLOAD_LADDER})
    return levels


def _divisors(per_gpu: int, choices: Sequence[int]) -> list[int]:
    return [m for m in choices if m <= per_gpu and per_gpu % m == 0] or [1]


def _micro_choices(per_gpu: int) -> list[int]:
    return _divisors(per_gpu, MICRO_BATCH_CHOICES)


def rollout_chunk_choices(workload: Workload, gpu: GpuTarget) -> list[int]:
    """HF generate() chunks, largest first: each divides the per-GPU training batch and, since
    validation runs through the same rollout (HFRollout splits a batch into equal chunks), leaves
    the validation rows in equal chunks too."""
    per_gpu = workload.train_batch_size * workload.rollout_n // gpu.count
    val_per_gpu = max(1, -(-workload.val_rows // gpu.count))     # verl pads validation to the GPU count
    return [m for m in _divisors(per_gpu, ROLLOUT_CHUNK_CHOICES)
            if m >= val_per_gpu or val_per_gpu % (val_per_gpu // m) == 0] or [1]


def rollout_tp_choices(gpu: GpuTarget, workload: Workload) -> list[int]:
    """vLLM tensor parallel sizes to try, smallest first: 1, then each power of two that divides the
    GPU count and the model's attention and KV heads (vLLM splits heads over the GPUs)."""
    heads = int(workload.model_config.get("num_attention_heads") or 1)
    kv = int(workload.model_config.get("num_key_value_heads") or heads)
    return [tp for tp in (1, 2, 4, 8) if tp == 1 or (gpu.count % tp == 0 and heads % tp == 0 and kv % tp == 0)]


def speed_ranked(workload: Workload) -> bool:
    """Whether the search takes the fastest fitting (update micro-batch, checkpointing) pair by the speed model
    (tasks/speed.py gpu_step_seconds, with its fixed cost per micro-batch and layer): on the LoRA rungs, where that
    cost was measured (issue 42). The full fine-tuning rungs keep "no checkpointing first, the largest micro-batch"
    (their plans' peaks were measured on a GPU as chosen so) until a run measures their cost per micro-batch."""
    return workload.lora


def search_memory(gpu: GpuTarget, workload: Workload, precision: Precision,
                  estimator: Estimator) -> tuple[MemoryChoice, MemoryEstimate, list[Reason]]:
    """The fastest choice the estimate fits. Full fine-tuning: no checkpointing before checkpointing, fewer offloads
    before more, the largest update micro-batch. LoRA (``speed_ranked``): fewer offloads before more, and at the
    first offload level where anything fits, the (micro-batch, checkpointing) pair the speed model ranks fastest
    (ties: the larger micro-batch, then no checkpointing). Then the largest no-gradient micro-batch and HF
    generation chunk (each of those changes only its own phase of the estimate)."""
    mini_per_gpu = workload.ppo_mini_batch_size * workload.rollout_n // gpu.count
    batch_per_gpu = workload.train_batch_size * workload.rollout_n // gpu.count
    best_failure: MemoryEstimate | None = None
    tried = 0
    found: tuple[MemoryChoice, MemoryEstimate] | None = None
    ranking: list[tuple[float, int, bool]] | None = None     # the update's seconds of each fitting pair (LoRA)
    if workload.actor_offload_policy:
        return search_offload(gpu, workload, precision, estimator)
    ranked = speed_ranked(workload)
    levels = offload_levels(workload, precision)
    # a group is tried whole; the first group with a fit decides (full: each candidate its own group, in order)
    groups = [[(ckpt, level, micro) for ckpt in (False, True) for micro in _micro_choices(mini_per_gpu)]
              for level in levels] if ranked else \
        [[(ckpt, level, micro)] for ckpt in (False, True) for level in levels for micro in _micro_choices(mini_per_gpu)]
    # vLLM across several GPUs only where one GPU cannot hold the rollout (TP costs an all-reduce per layer)
    tps = rollout_tp_choices(gpu, workload) if precision.rollout == "vllm" else [1]
    for tp, group in ((tp, g) for tp in tps for g in groups):
        fits = []
        for ckpt, level, micro in group:
            choice = MemoryChoice(offload=level, actor_micro_batch=micro, log_prob_micro_batch=1,
                                  critic_micro_batch=micro, rollout_micro_batch=1, grad_ckpt=ckpt, rollout_tp=tp)
            est = estimator(gpu, workload, precision, choice)
            tried += 1
            if est.fits:
                fits.append((update_seconds(gpu, workload, precision, choice) if ranked else 0.0,
                             -micro, ckpt, choice, est))
            elif best_failure is None or est.peak_mib < best_failure.peak_mib:
                best_failure = est
        if fits:
            found = min(fits, key=lambda f: f[:3])[3:]
            ranking = [(f[0], -f[1], f[2]) for f in fits] if ranked else None
            break
    if found is None:
        if best_failure is None:
            raise _no_choice(gpu, "the update")
        raise _no_fit(gpu, workload, best_failure)
    choice, est = found

    def grow(choice, est, field, sizes):
        """The largest of ``sizes`` (descending) for ``field`` that still fits; estimates tried."""
        for n, m in enumerate(sizes, 1):
            if m <= getattr(choice, field):
                return choice, est, n - 1
            bigger = replace(choice, **{field: m})
            e = estimator(gpu, workload, precision, bigger)
            if e.fits:
                return bigger, e, n
        return choice, est, len(sizes)

    choice, est, n = grow(choice, est, "log_prob_micro_batch", _divisors(batch_per_gpu, FORWARD_MICRO_CHOICES))
    tried += n
    choice, est, n = grow(choice, est, "rollout_micro_batch", rollout_chunk_choices(workload, gpu)
                          if precision.rollout == "hf" else _divisors(batch_per_gpu, ROLLOUT_CHUNK_CHOICES))
    tried += n
    if est.vllm_gpu_memory_utilization is not None:
        choice = replace(choice, vllm_gpu_memory_utilization=est.vllm_gpu_memory_utilization)
    return choice, est, _memory_reasons(gpu, workload, precision, choice, est, tried, ranking)


def offload_seconds(gpu: GpuTarget, workload: Workload, precision: Precision, choice: MemoryChoice) -> dict[str, float]:
    """The speed model's seconds per phase of one step of ``choice`` on the CPU-offload rung (tasks/speed.py)."""
    from tasks.memory import ModelShape
    from tasks.speed import OffloadStep, offload_step_seconds

    n = workload.rollout_n
    return offload_step_seconds(OffloadStep(
        params=ModelShape.from_config(dict(workload.model_config)).params("actor"),
        train_dtype=precision.train_dtype, sequences=workload.train_batch_size * n // gpu.count,
        mini_batch=workload.ppo_mini_batch_size * n // gpu.count, micro_batch=choice.actor_micro_batch,
        log_prob_micro_batch=choice.log_prob_micro_batch,
        rollout_chunk=choice.rollout_micro_batch if precision.rollout == "hf" else 0,
        prompt_len=workload.max_prompt_length, response_len=workload.max_response_length, grad_ckpt=choice.grad_ckpt,
        rollout_dtype=_MEM_DTYPE[precision.rollout_dtype], **{k: getattr(choice, k) for k in OFFLOAD_KNOBS}))


def gpu_seconds(gpu: GpuTarget, workload: Workload, precision: Precision, choice: MemoryChoice,
                lora: bool | None = None) -> dict[str, float]:
    """The speed model's seconds per phase of a plan that stays on the GPU (tasks/speed.py: gpu_step_seconds);
    ``lora`` None: as the workload's rung trains."""
    from tasks.memory import ModelShape
    from tasks.speed import GpuStep, gpu_step_seconds

    shape = ModelShape.from_config(dict(workload.model_config))
    n = workload.rollout_n
    return gpu_step_seconds(GpuStep(
        params=shape.params("actor"), layers=shape.layers, train_dtype=precision.train_dtype,
        sequences=workload.train_batch_size * n // gpu.count, micro_batch=choice.actor_micro_batch,
        rollout_chunk=choice.rollout_micro_batch if precision.rollout == "hf" else 0,
        prompt_len=workload.max_prompt_length, response_len=workload.max_response_length, grad_ckpt=choice.grad_ckpt,
        rollout_dtype=_MEM_DTYPE[precision.rollout_dtype], lora=workload.lora if lora is None else lora,
        reference=workload.uses_reference, critic_params=shape.params("critic") if workload.uses_critic else 0))


def update_seconds(gpu: GpuTarget, workload: Workload, precision: Precision, choice: MemoryChoice) -> float:
    """What the (micro-batch, checkpointing) pair changes in a step by the speed model, the search's key on the LoRA
    rungs: the actor's update and, on PPO, the critic's (its micro-batch and checkpointing are the actor's)."""
    seconds = gpu_seconds(gpu, workload, precision, choice)
    return seconds["update"] + seconds["critic"]


def search_offload(gpu: GpuTarget, workload: Workload, precision: Precision,
                   estimator: Estimator) -> tuple[MemoryChoice, MemoryEstimate, list[Reason]]:
    """The CPU-offload rung (FSDP2 + CPUOffloadPolicy): phase by phase, the choice the speed model ranks fastest
    (tasks/speed.py: host-device copies, host-side sums, the host's AdamW, recomputation) among those the memory
    estimate fits. The phases' memory is independent (the peak is the largest), so each is chosen with the
    earlier ones fixed and the later ones at their smallest: the update (patch 0008's gathering and unsharded
    accumulation, checkpointing, micro-batch; the actor's gathering also holds in its log-prob pass), then the
    log-prob passes (the ref's gathering, the micro-batch), then the HF rollout (its gathering, the chunk; vLLM:
    the most sequences that fit). Ties go to the larger batch, then to no checkpointing."""
    # vLLM across several GPUs only where one GPU cannot hold the rollout (TP costs an all-reduce per layer)
    tps = rollout_tp_choices(gpu, workload) if precision.rollout == "vllm" else [1]
    for tp in tps:
        try:
            return _search_offload_tp(gpu, workload, precision, estimator, tp)
        except PlanError as exc:
            if tp == tps[-1] or not hasattr(exc, "short_mib"):
                raise
    raise AssertionError("unreachable")


def _search_offload_tp(gpu: GpuTarget, workload: Workload, precision: Precision, estimator: Estimator,
                       tp: int) -> tuple[MemoryChoice, MemoryEstimate, list[Reason]]:
    mini_per_gpu = workload.ppo_mini_batch_size * workload.rollout_n // gpu.count
    batch_per_gpu = workload.train_batch_size * workload.rollout_n // gpu.count
    level = {k: k == "ref_param_offload" for k in OFFLOAD_LADDER}
    tried = 0
    best_failure: MemoryEstimate | None = None

    def fastest(options: list[MemoryChoice], phases: tuple[str, ...], size: Callable[[MemoryChoice], int]):
        nonlocal tried, best_failure
        fits = []
        for option in options:
            est = estimator(gpu, workload, precision, option)
            tried += 1
            if est.fits:
                seconds = offload_seconds(gpu, workload, precision, option)
                fits.append((sum(seconds[p] for p in phases), -size(option), option.grad_ckpt, option, est))
            elif best_failure is None or est.peak_mib < best_failure.peak_mib:
                best_failure = est
        if not fits:
            if best_failure is None:
                raise _no_choice(gpu, f"the phases {', '.join(phases) or 'of the rollout'}")
            raise _no_fit(gpu, workload, best_failure)
        return min(fits, key=lambda f: f[:3])[3:]

    start = MemoryChoice(offload=level, actor_micro_batch=1, log_prob_micro_batch=1, critic_micro_batch=1,
                         rollout_micro_batch=1, grad_ckpt=True, rollout_tp=tp)
    choice, est = fastest([replace(start, actor_micro_batch=m, critic_micro_batch=m, grad_ckpt=ckpt, actor_gather_once=g,
                                   accumulate_grads_unsharded=a, fused_adamw=f)
                           for m in _micro_choices(mini_per_gpu) for ckpt in (False, True)
                           for g in knob_values("actor_gather_once") for a in knob_values("accumulate_grads_unsharded")
                           for f in knob_values("fused_adamw")],
                          ("update", "actor_log_prob"), lambda c: c.actor_micro_batch)
    choice, est = fastest([replace(choice, log_prob_micro_batch=m, ref_gather_once=g)
                           for m in _divisors(batch_per_gpu, FORWARD_MICRO_CHOICES) for g in knob_values("ref_gather_once")],
                          ("actor_log_prob", "ref_log_prob"), lambda c: c.log_prob_micro_batch)
    if precision.rollout == "hf":
        choice, est = fastest([replace(choice, rollout_micro_batch=m, rollout_gather_once=g)
                               for m in rollout_chunk_choices(workload, gpu) for g in knob_values("rollout_gather_once")],
                              ("rollout",), lambda c: c.rollout_micro_batch)
    else:   # vLLM: its share follows the sequences it runs at once; the speed model does not count vLLM
        choice, est = fastest([replace(choice, rollout_micro_batch=m)
                               for m in _divisors(batch_per_gpu, ROLLOUT_CHUNK_CHOICES)],
                              (), lambda c: c.rollout_micro_batch)
    if est.vllm_gpu_memory_utilization is not None:
        choice = replace(choice, vllm_gpu_memory_utilization=est.vllm_gpu_memory_utilization)
    return choice, est, _memory_reasons(gpu, workload, precision, choice, est, tried)


def _no_choice(gpu: GpuTarget, what: str) -> PlanError:
    """A choice list that came out empty (no micro-batch size divides the batch): nothing was estimated, so there
    is no failure to describe."""
    return PlanError(f"no memory choice to try for {what} on {gpu.count} x {gpu.name}", key="gpu")


def _no_fit(gpu: GpuTarget, workload: Workload, best_failure: MemoryEstimate) -> PlanError:
    short = best_failure.peak_mib - best_failure.budget_mib
    phases = {k: v for k, v in best_failure.breakdown.items() if k.startswith("phase_")}
    worst = max(phases, key=lambda k: phases[k]) if phases else None
    where = f" The largest phase is {worst[len('phase_'):]} ({phases[worst]} MiB before process overhead)." if worst else ""
    bd = best_failure.breakdown
    if bd.get("vllm_kv_granted", 0) < bd.get("vllm_kv_wanted", 0):
        where += (f" vLLM cannot hold the rollout: at most {VLLM_SHARE_MAX} of the GPU leaves its KV cache "
                  f"{max(0, bd['vllm_kv_granted'])} MiB of the {bd['vllm_kv_wanted']} MiB one sequence-wave needs "
                  "beside its weights (more GPUs let an engine span several).")
    err = PlanError(
        f"{workload.experiment_name} ({workload.algorithm.upper()}) does not fit {gpu.count} x {gpu.name} "
        f"({gpu.memory_mib} MiB): even with gradient "
        f"checkpointing, every allowed offload and micro-batch 1 the estimated peak is {best_failure.peak_mib} MiB "
        f"against a budget of {best_failure.budget_mib} MiB, short by {short} MiB.{where}",
        fix=f"use a GPU with more memory (or more GPUs), train a smaller model, or shorten the sequences (prompt "
            f"{workload.max_prompt_length} + response {workload.max_response_length} tokens).")
    err.short_mib = short
    return err


def _ranked_words(choice: MemoryChoice, ranking: list[tuple[float, int, bool]]) -> str:
    """The speed model's update seconds of the chosen pair and of the fastest fitting pair the other way."""
    other = [r for r in ranking if r[2] != choice.grad_ckpt]
    mine = next(r for r in ranking if r[1:] == (choice.actor_micro_batch, choice.grad_ckpt))
    alt = min(other) if other else None
    return (f"the speed model ranks this update (and the critic's) the fastest that fits: micro-batch {mine[1]} "
            f"{'with' if mine[2] else 'without'} it {mine[0]:.0f} s a step, "
            + (f"the fastest {'with' if alt[2] else 'without'} it (micro-batch {alt[1]}) {alt[0]:.0f} s"
               if alt else f"none fits {'without' if mine[2] else 'with'} it")
            + " (tasks/speed.py: each micro-batch costs a fixed time per layer, measured on an H100; checkpointing "
              "one more forward)")


def _memory_reasons(gpu, workload, precision, choice, est, tried, ranking=None) -> list[Reason]:
    on = [k for k in OFFLOAD_LADDER if choice.offload.get(k)]
    policy = workload.actor_offload_policy
    reasons = [Reason("gradient_checkpointing", choice.grad_ckpt,
                      _ranked_words(choice, ranking) if ranking else
                      ("the speed model ranks the fastest update that fits with it (tasks/speed.py)" if policy
                       else "without it no offload level and micro-batch fits the budget")
                      + " (it recomputes each layer in the backward pass: about a third more update compute)"
                      if choice.grad_ckpt else
                      "the estimate fits without it (it would recompute every layer in the backward pass)"),
               Reason("offload", "actor_offload_policy, ref" if policy else (", ".join(on) or "none"),
                      "FSDP2's CPUOffloadPolicy keeps the actor's and the ref's params (and the actor's gradients and "
                      "AdamW states) on the CPU; the FSDP1 offload flags are ignored for the actor" if policy else
                      (f"the estimate fits {est.budget_mib} MiB without offload (offload costs PCIe transfers "
                       "every step)" if not on else
                       f"without {on[-1]} the estimate exceeds the {est.budget_mib} MiB budget; "
                       "offloads are taken in ladder order, fewest first"))]
    reasons.append(Reason("micro_batches", f"actor {choice.actor_micro_batch}, critic {choice.critic_micro_batch}, "
                                           f"log-prob/values {choice.log_prob_micro_batch}",
                          (f"the fastest the speed model ranks among those that fit (of {', '.join(map(str, MICRO_BATCH_CHOICES))} "
                           "dividing the per-GPU mini-batch; tasks/speed.py): without the gather-once knobs every "
                           "micro-batch moves the weights in and the gradients out over PCIe, with them once per "
                           "mini-batch" if policy else
                           f"updates: the (micro-batch, checkpointing) pair the speed model ranks fastest among those "
                           f"that fit (of {', '.join(map(str, MICRO_BATCH_CHOICES))} dividing the per-GPU mini-batch, "
                           "each with and without checkpointing; tasks/speed.py); no-gradient passes: the largest "
                           "that still fits" if ranking else
                           f"updates: the largest micro-batch (of {', '.join(map(str, MICRO_BATCH_CHOICES))}) dividing "
                           "the per-GPU mini-batch that fits; no-gradient passes: the largest that still fits")
                          + f" ({tried} candidates estimated)"))
    if policy:
        seconds = offload_seconds(gpu, workload, precision, choice)
        plain = offload_seconds(gpu, workload, precision, replace(choice, **{k: False for k in OFFLOAD_KNOBS}))
        knobs = [k for k in OFFLOAD_KNOBS if getattr(choice, k)]
        reasons.append(Reason("offload_speed_knobs", ", ".join(knobs) or "none",
                              f"speed model: {seconds['step']:.0f} s a step on the device's H200 (update "
                              f"{seconds['update']:.0f} s), {plain['step']:.0f} s with none of them at these batches "
                              "(tasks/speed.py; each knob's memory is in the estimate)"))
    reasons.append(Reason("rollout_micro_batch", choice.rollout_micro_batch,
                          ("sequences per HF generate() call" if precision.rollout == "hf" else
                           "sequences vLLM runs at once (its KV cache and sampler are sized for them)")
                          + ": the most that fit (generation time is per decoding step, nearly flat in the number of "
                            "sequences)"))
    reasons.append(Reason("predicted_peak_mib", est.peak_mib,
                          f"memory estimate of the largest phase; budget {est.budget_mib} MiB of {gpu.memory_mib} MiB"))
    return reasons
