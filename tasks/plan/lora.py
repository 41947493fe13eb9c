"""LoRA in the plan: the rungs that train adapters on the actor (tasks/plan/rungs.py's RUNGS), their verl
overrides with reasons (``lora_overrides``), why ``workload.finetune = "auto"`` chose full fine-tuning or LoRA,
with both speeds by the speed model (``finetune_reason``; tasks/plan/memory_fit.py ``gpu_seconds``), and what the
rollout holds for LoRA (``lora_memory_reasons``: patch 0013's merge with the HF rollout, vLLM's own buffers).

The choices, and where they come from:

* rank 32, alpha 32, every linear layer of the decoder (PEFT's ``all-linear``: q/k/v/o and the MLP's gate/up/
  down; not the head). Schulman et al., "LoRA Without Regret" (Thinking Machines, 2025): for policy-gradient RL
  even rank 1 matched full fine-tuning, given LoRA on all linear layers (the MLP too) and a learning rate about
  10x full fine-tuning's; with PEFT's alpha/rank scaling and alpha fixed at 32 the best learning rate hardly
  depends on the rank. 32 is not needed for quality: it is the smallest vLLM-valid rank the paper's settings and
  verl's LoRA examples share, and vLLM 0.8.5 takes only max_lora_rank in VLLM_LORA_RANKS (8..512; verl sets
  max_lora_rank to the rank). The adapters' states are megabytes at any of these ranks.
* the actor's learning rate: 10 x verl 0.5.0's default 1e-6 (actor.yaml ``optim.lr``) = 1e-5, the paper's ratio.
* the frozen base in the training dtype (``actor.fsdp_config.model_dtype``): it takes no optimizer step, so it
  needs no fp32 master copy; PEFT keeps the adapters in fp32 whatever the base's dtype, so AdamW still steps
  fp32 weights.
* vLLM: ``rollout.load_format=safetensors`` (vLLM loads the frozen base from the model's files at start, and
  verl's sharding manager then sends only the adapter each step: with ``dummy_dtensor`` it would first send the
  whole model); ``rollout.layered_summon`` on several GPUs (the adapter is collected one decoder layer at a time
  instead of gathering the whole model on every GPU).
* the critic (PPO) is fully fine-tuned: verl 0.5.0's critic LoRA uses the causal-LM task type, which leaves the
  value head frozen at its random initialisation.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from tasks.plan.memory_fit import gpu_seconds, offload_seconds, search_memory
from tasks.plan.terms import Estimator, GpuTarget, MemoryChoice, MemoryEstimate, PlanError, Precision, Reason, Workload

FULL_ACTOR_LR = 1e-6        # verl 0.5.0's actor optim.lr (verl/trainer/config/actor/actor.yaml)
LORA_LR_SCALE = 10          # "LoRA Without Regret": LoRA's best learning rate is about 10x full fine-tuning's
FINETUNES = ("auto", "full", "lora")


def vllm_rank_refusal(workload: Workload, precision: Precision) -> PlanError | None:
    """vLLM 0.8.5 refuses a max_lora_rank outside VLLM_LORA_RANKS, and verl 0.5.0 passes the rank as it."""
    from tasks.memory.vllm_lora import VLLM_LORA_RANKS

    if workload.finetune == "full" or precision.rollout != "vllm" or workload.lora_rank in VLLM_LORA_RANKS:
        return None
    return PlanError(f"workload.lora_rank {workload.lora_rank} cannot run on vLLM 0.8.5: verl 0.5.0 passes it as "
                     f"vLLM's max_lora_rank, which must be one of {', '.join(map(str, VLLM_LORA_RANKS))}",
                     fix="set workload.lora_rank to one of those (32, the default, is plenty: for RL even rank 1 "
                         "matched full fine-tuning), or workload.rollout = 'hf', or workload.finetune = 'full'",
                     key="workload.lora_rank")


def lora_overrides(gpu: GpuTarget, workload: Workload, precision: Precision) -> list[tuple[str, Any, str]]:
    """verl's keys of a LoRA rung: (key, value, why). The actor's model_dtype is set by verl_overrides."""
    w = workload
    mods = w.target_modules if isinstance(w.target_modules, str) else list(w.target_modules)
    out = [
        ("actor_rollout_ref.model.lora_rank", w.lora_rank,
         "LoRA adapters on the actor (settings workload.lora_rank): the frozen base needs no gradients and no AdamW "
         "states; for policy-gradient RL even rank 1 matched full fine-tuning (\"LoRA Without Regret\", Thinking "
         "Machines 2025), and vLLM takes ranks from 8 up"),
        ("actor_rollout_ref.model.lora_alpha", w.lora_alpha,
         "PEFT scales the adapter by alpha/rank; alpha fixed at 32 (the paper's) keeps the best learning rate "
         "nearly independent of the rank"),
        ("actor_rollout_ref.model.target_modules", mods,
         "every linear layer, attention and MLP (the paper: LoRA on attention only falls behind)"
         if mods == "all-linear" else "settings workload.target_modules"),
        ("actor_rollout_ref.actor.optim.lr", round(FULL_ACTOR_LR * LORA_LR_SCALE, 12),
         f"{LORA_LR_SCALE} x verl's full fine-tuning default {FULL_ACTOR_LR:g}: LoRA's best learning rate is about "
         "10x full fine-tuning's (\"LoRA Without Regret\")"),
    ]
    if precision.rollout == "vllm":
        out += [
            ("actor_rollout_ref.rollout.load_format", "safetensors",
             "vLLM loads the frozen base from the model's files at start; verl's sharding manager then sends only "
             "the adapter each step (with dummy_dtensor it would send the whole model first); verl 0.5.0 sets "
             f"enable_lora, max_loras=1 and max_lora_rank={w.lora_rank} itself"),
            ("actor_rollout_ref.rollout.layered_summon", gpu.count > 1,
             "the adapter is collected one decoder layer at a time: the whole model is never gathered on every GPU"
             if gpu.count > 1 else "one GPU holds the whole model anyway: the adapter is collected in one pass"),
        ]
    if w.uses_critic:
        out.append(("critic.model.lora_rank", 0,
                    "the critic is fully fine-tuned: verl 0.5.0's critic LoRA uses the causal-LM task type, which "
                    "leaves the new value head frozen at its random initialisation"))
    return out


def lora_memory_reasons(gpu: GpuTarget, w: Workload, precision: Precision, choice: MemoryChoice,
                        est: MemoryEstimate) -> list[Reason]:
    """What a LoRA rung's rollout holds beyond the training states: patch 0013's merge (the HF rollout) or vLLM's
    LoRA buffers, with where each number comes from."""
    if not w.lora:
        return []
    bd = est.breakdown
    if precision.rollout == "hf":
        box = bd.get("lora_merge_host", 0) * gpu.count
        return [Reason("lora_merge", f"{box} MiB host, {bd.get('lora_merge_gpu', 0)} MiB GPU",
                       "the HF rollout generates with the adapter merged into the base (patch 0013): the ranks decide "
                       "together, each copies its own shard of the adapted decoder layers (in "
                       f"{precision.train_dtype}) to host memory for the run, {box} MiB on this box in all (in "
                       "predicted_host_ram_mib: the preflight checks the box's RAM; patch 0013 merges only where "
                       "MemAvailable holds twice the box's copies, else it generates unmerged, slower), and merges "
                       "one FSDP unit at a time: one decoder layer with its adapters and one weight's fp32 delta on "
                       "the GPU, never the whole model (tasks/memory/lora.py lora_merge; run on one GPU only, never on several)")]
    arch = (w.model_config.get("architectures") or ["an unknown model class"])[0]
    return [Reason("vllm_lora", f"{bd.get('vllm_lora', 0)} MiB",
                   f"vLLM 0.8.5's own LoRA memory on each GPU, in its share: for verl's max_loras=1 and max_lora_rank="
                   f"{w.lora_rank}, the stacked A and B of every linear layer of the decoder in the model's dtype "
                   "(vllm/lora/layers.py create_lora_weights, whatever the adapter targets), "
                   + ("the embedding's and head's LoRA with 256 extra vocabulary rows, " if arch != "Qwen2ForCausalLM"
                      else f"no embedding or head LoRA ({arch} has no embedding_modules), ")
                   + f"the punica workspace for {choice.rollout_micro_batch * choice.rollout_tp} sequences and "
                     "max_num_batched_tokens (vllm/lora/punica_wrapper): read from vLLM's source "
                     "(tasks/memory/vllm_lora.py), unproven on a GPU until a run of a vLLM LoRA plan measures it")]


def _speed_words(seconds: dict[str, float], precision: Precision) -> str:
    vllm = "" if precision.rollout == "hf" else " (generation in vLLM not counted)"
    return f"{seconds['step']:.0f} s a step{vllm}"


def finetune_reason(gpu: GpuTarget, asked: Workload, rung: str, w: Workload, precision: Precision,
                    choice: MemoryChoice, estimator: Estimator, ladder: list[tuple[str, Workload, str]],
                    failed: list[tuple[str, PlanError]]) -> Reason:
    """Why the plan trains every weight or LoRA adapters, with the speed model's seconds of both where it can
    (seconds on the device's H200 and H100: a ranking, not a forecast; tasks/speed.py)."""
    kind = "lora" if w.lora else "full"
    if asked.finetune != "auto":
        return Reason("finetune", kind, f"workload.finetune = {asked.finetune!r} asks for it")
    if w.lora:
        mine = gpu_seconds(gpu, w, precision, choice)
        offload = next(((r, x) for r, x, _ in ladder if x.actor_offload_policy and not x.lora), None)
        other = "full fine-tuning has no CPU-offload rung in this workload"
        if offload:
            try:
                full_choice, _, _ = search_memory(gpu, offload[1], precision, estimator)
                full = offload_seconds(gpu, offload[1], precision, full_choice)
                other = (f"full fine-tuning fits only on the {offload[0]} rung (the actor's weights, gradients and "
                         f"AdamW states on the CPU): {full['step']:.0f} s a step by the speed model")
            except PlanError as exc:
                other = f"full fine-tuning does not fit even on the {offload[0]} rung (short by " \
                        f"{getattr(exc, 'short_mib', '?')} MiB)"
        short = "; ".join(f"{r} short by {e.short_mib} MiB" for r, e in failed if not r.endswith("lora"))
        return Reason("finetune", "lora",
                      f"auto: {other}" + (f" ({short})" if short else "") + f"; LoRA trains on the GPU alone: "
                      f"{_speed_words(mine, precision)} by the speed model (tasks/speed.py, seconds on the device's "
                      "H200 and H100: a ranking)")
    if w.actor_offload_policy:
        lora_short = "; ".join(f"{r} short by {e.short_mib} MiB" for r, e in failed if r.endswith("lora"))
        return Reason("finetune", "full", f"auto: no LoRA rung fits ({lora_short or 'none tried'}): full "
                                          "fine-tuning on the CPU-offload rung is what fits")
    full = gpu_seconds(gpu, w, precision, choice)
    lora = gpu_seconds(gpu, replace(w, lora=True), precision, choice)
    return Reason("finetune", "full",
                  f"auto: full fine-tuning fits on the GPU ({_speed_words(full, precision)} by the speed model; LoRA "
                  f"at the same batches {lora['step']:.0f} s): every weight trains at GPU speed")
