"""The plan of one box (``make_plan``): its precision (tasks/plan/precision.py), then the fallback
ladder (``RUNGS``: PPO with a critic -> GRPO -> PPO and GRPO with LoRA adapters on the actor -> GRPO with the
actor on FSDP2 CPU offload -> GRPO with shorter responses; ``workload.finetune`` picks the full or the LoRA
rungs, "auto" both: tasks/plan/lora.py), best training first, each rung's batches shared evenly over the GPUs
(``ladder``); the first rung whose memory fits (tasks/plan/memory_fit.py) is the plan, which then
meets verl 0.5.0's own checks (``verl_refusal``, tasks/verl/rules.py)."""

from __future__ import annotations

from dataclasses import replace
from math import gcd

from tasks.gpu_support import refusal as gpu_refusal
from tasks.plan.estimator import default_estimator
from tasks.plan.lora import FINETUNES, finetune_reason, lora_memory_reasons, vllm_rank_refusal
from tasks.plan.memory_fit import search_memory
from tasks.plan.overrides import checkpoint_plan, plan_env, verl_overrides
from tasks.plan.precision import choose_precision
from tasks.plan.terms import Estimator, GpuTarget, PlanError, Reason, TrainingPlan, Workload
from tasks.verl import VERL_VERSION

# The fallback ladder, best training first: (rung, algorithm, response tokens (None: the workload's),
# the actor on FSDP2 with CPUOffloadPolicy, LoRA adapters on the actor, why).
GRPO_N = 4   # samples per prompt: verl's GSM8K GRPO example takes 5; 4 keeps PPO's 256 sequences a step in 64 x 4
_OFFLOAD_WHY = ("the actor on FSDP2 with CPUOffloadPolicy (actor_rollout_ref.actor.strategy=fsdp2, fsdp_config."
                "offload_policy=True): its params, gradients and AdamW states live on the CPU and the AdamW step runs "
                "there; the GPU holds the layers FSDP gathers while they compute, activations, logits and the "
                "rollout; verl offloads the ref the same way. Slower: every micro-batch moves the weights in and the "
                "gradients out over PCIe. Critic-free: verl 0.5.0 cannot FSDP2-wrap the critic (GPU call 6)")
_LORA_WHY = ("LoRA adapters on the actor's linear layers, the base frozen in the training dtype: no gradients or "
             "AdamW states for the base and no reference model (verl's ref is the actor with its adapter disabled), "
             "so the step stays on the GPU")
RUNGS: tuple[tuple[str, str, int | None, bool, bool, str], ...] = (
    ("ppo", "ppo", None, False, False, "PPO with a learned critic (GAE): verl's GSM8K quick start"),
    ("grpo", "grpo", None, False, False, f"GRPO: no critic (no critic params, gradients, optimizer states or passes); "
                                         f"each prompt sampled {GRPO_N} times, the advantage is a reward against its "
                                         "group's"),
    ("ppo-lora", "ppo", None, False, True, f"PPO with {_LORA_WHY}; the critic fully fine-tuned"),
    ("grpo-lora", "grpo", None, False, True, f"GRPO with {_LORA_WHY}"),
    ("grpo-cpu-offload", "grpo", None, True, False, f"GRPO with {_OFFLOAD_WHY}"),
    ("grpo-cpu-offload-response-192", "grpo", 192, True, False, "GRPO, actor on FSDP2 CPU offload, responses cut to "
                                                                "192 tokens: GSM8K answers longer lose their '#### n' "
                                                                "(score 0)"),
    ("grpo-cpu-offload-response-128", "grpo", 128, True, False, "GRPO, actor on FSDP2 CPU offload, responses cut to "
                                                                "128 tokens: many GSM8K answers lose their '#### n' "
                                                                "(score 0)"),
)
ALGORITHMS = ("auto", "ppo", "grpo")


def make_plan(gpu: GpuTarget, workload: Workload, estimator: Estimator | None = None) -> TrainingPlan:
    if gpu.count < 1:
        raise PlanError("the plan needs at least one GPU")
    refused = gpu_refusal(gpu.arch_list.split(";"))
    if refused:
        raise PlanError(refused[0], fix=refused[1], key="gpu")
    for name in ("train_batch_size", "ppo_mini_batch_size", "max_prompt_length", "max_response_length",
                 "total_training_steps", "rollout_n", "total_epochs"):
        if getattr(workload, name) is not None and getattr(workload, name) < 1:
            raise PlanError(f"workload {name} must be >= 1")
    if workload.train_batch_size < workload.ppo_mini_batch_size:
        raise PlanError("train_batch_size must be >= ppo_mini_batch_size")
    if workload.algorithm not in ALGORITHMS:
        raise PlanError(f"workload algorithm must be one of {', '.join(ALGORITHMS)}, not {workload.algorithm!r}")
    if workload.finetune not in FINETUNES:
        raise PlanError(f"workload finetune must be one of {', '.join(FINETUNES)}, not {workload.finetune!r}",
                        key="workload.finetune")
    estimator = estimator or default_estimator
    precision, reasons = choose_precision(gpu, workload.flash_attn_installed, workload.rollout_engine)
    rank_refused = vllm_rank_refusal(workload, precision)
    if rank_refused:
        raise rank_refused
    if gpu.mixed:
        reasons.insert(0, Reason("gpu", f"{gpu.count} x {gpu.name} ({gpu.memory_mib} MiB)",
                                 f"the box mixes GPU models ({gpu.mixed_words()}): planned for the weakest, "
                                 "precision and rollout by the lowest compute capability, memory by the smallest GPU; "
                                 "FSDP gives every GPU the same share, so the larger ones keep memory unused"))
    failed: list[tuple[str, PlanError]] = []
    rungs = ladder(workload, gpu)
    for rung, w, why in rungs:
        try:
            choice, est, mem_reasons = search_memory(gpu, w, precision, estimator)
        except PlanError as exc:
            if not hasattr(exc, "short_mib"):
                raise
            failed.append((rung, exc))
            continue
        before = "; ".join(f"{r} is short by {e.short_mib} MiB" for r, e in failed)
        rung_reason = Reason("rung", rung, why + (f" ({before})" if before else ""))
        env, env_reasons = plan_env(precision, gpu)
        cp = checkpoint_plan(w, gpu.count, precision.train_dtype)
        plan = TrainingPlan(gpu=gpu, precision=precision, memory=choice, estimate=est, workload=w, rung=rung,
                            overrides=verl_overrides(gpu, w, precision, choice, cp), env=env, checkpoints=cp,
                            reasons=reasons + [rung_reason, finetune_reason(gpu, workload, rung, w, precision, choice,
                                                                            estimator, rungs, failed),
                                               *_batch_reasons(workload, w)] + mem_reasons
                            + lora_memory_reasons(gpu, w, precision, choice, est) + env_reasons
                            + [Reason(*r) for r in cp.reasons])
        verl_refusal(plan)
        return plan
    tried = ", ".join(f"{r} short by {e.short_mib} MiB" for r, e in failed)
    err = PlanError(f"{failed[-1][1].reason} Rungs tried: {tried}.",
                    fix=failed[-1][1].fix)
    err.short_mib = failed[-1][1].short_mib     # the last rung tried: the one the message describes
    raise err


def verl_refusal(plan: TrainingPlan) -> None:
    """PlanError where verl 0.5.0's own checks (tasks/verl/rules.py) refuse the plan's config, with
    verl's words: a workload verl would stop on is refused before any host changes."""
    from tasks.verl import violations

    w = plan.workload
    found = violations({o.key: o.value for o in plan.overrides}, w.model_config, w.train_rows, w.val_rows)
    if not found:
        return
    first, more = found[0], len(found) - 1
    reason = (f"verl {VERL_VERSION} would refuse this run ({first.where}): \"{first.message}\""
              + (f" (and {more} more of its checks)" if more else ""))
    if first.setting.startswith("workload."):
        raise PlanError(reason, fix=first.fix or f"change {first.setting}", key=first.setting)
    raise PlanError(reason, fix=f"{first.setting} is the plan's own choice: this is a bug of verl-lab's plan; report "
                                "it with the workload and the GPU", key="workload")


def ladder(workload: Workload, gpu: GpuTarget) -> list[tuple[str, Workload, str]]:
    """The rungs ``workload.algorithm`` allows ("auto": all of RUNGS; else that algorithm at the
    workload's lengths) and ``workload.finetune`` ("auto": full and LoRA; "full" or "lora": those rungs alone),
    each as the workload it trains, with batches every GPU gets a share of."""
    out = []
    for rung, algorithm, response, offload_policy, lora, why in RUNGS:
        if workload.algorithm not in ("auto", algorithm) or \
                (response and (workload.algorithm != "auto" or response >= workload.max_response_length)) or \
                workload.finetune == ("full" if lora else "lora"):
            continue
        w = replace(workload, algorithm=algorithm, max_response_length=response or workload.max_response_length,
                    actor_offload_policy=offload_policy, lora=lora)
        if algorithm == "grpo":   # PPO's sequences a step: prompts / GRPO_N, each sampled GRPO_N times
            w = replace(w, rollout_n=GRPO_N, use_kl_loss=True, train_batch_size=max(1, w.train_batch_size // GRPO_N),
                        ppo_mini_batch_size=max(1, w.ppo_mini_batch_size // GRPO_N))
        step = gpu.count // gcd(gpu.count, w.rollout_n)    # prompts whose sequences split evenly over the GPUs
        mini = -(-w.ppo_mini_batch_size // step) * step
        out.append((rung, replace(w, ppo_mini_batch_size=mini,
                                  train_batch_size=max(mini, -(-w.train_batch_size // step) * step)), why))
    return out


def _batch_reasons(asked: Workload, w: Workload) -> list[Reason]:
    n_why = (f"{w.rollout_n} samples per prompt for GRPO's group baseline: {w.train_batch_size} prompts x "
             f"{w.rollout_n} = {w.train_batch_size * w.rollout_n} sequences a step" if w.rollout_n > 1 else "one sample per prompt")
    grown = w.train_batch_size * w.rollout_n > asked.train_batch_size * asked.rollout_n
    return [Reason("rollout_n", w.rollout_n, n_why),
            Reason("train_batch_size", w.train_batch_size,
                   f"prompts a step, mini-batch {w.ppo_mini_batch_size}"
                   + (": rounded up so every GPU gets an equal share of sequences (verl divides them)" if grown else ""))]
