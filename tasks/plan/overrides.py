"""What verl is given: the Hydra overrides of ``verl.trainer.main_ppo`` for a plan's choices, each
with its reason (``verl_overrides``), the process environment (``plan_env``), and the rung's
checkpoints (``checkpoint_plan``: one save's bytes and what is kept, tasks/checkpoints.py), whose
retention is overrides too."""

from __future__ import annotations

import functools
from typing import Any

from tasks.checkpoints import CheckpointPlan, plan_checkpoints, plan_lora_checkpoints, retention_overrides
from tasks.plan.estimator import max_num_batched_tokens
from tasks.plan.lora import lora_overrides
from tasks.plan.memory_fit import speed_ranked
from tasks.plan.precision import VLLM_MIN_CC, vllm_engine
from tasks.plan.terms import (
    OFFLOAD_KEYS,
    OFFLOAD_KNOBS,
    OFFLOAD_LADDER,
    GpuTarget,
    MemoryChoice,
    Precision,
    Reason,
    Workload,
)
from tasks.verl import VERL_VERSION, Override

MASTER_DTYPE = "fp32"      # the actor's and critic's weights (so their AdamW states and saves): model_dtype


# verl 0.5.0's GSM8K GRPO example (examples/grpo_trainer/run_qwen2-7b.sh): the KL to the reference in the loss
GRPO_OVERRIDES: tuple[tuple[str, Any, str], ...] = (
    ("actor_rollout_ref.actor.kl_loss_coef", 0.001, "verl's GSM8K GRPO example"),
    ("actor_rollout_ref.actor.kl_loss_type", "low_var_kl", "verl's GSM8K GRPO example"),
    ("actor_rollout_ref.actor.entropy_coeff", 0, "verl's GSM8K GRPO example: no entropy bonus"),
    ("algorithm.use_kl_in_reward", False, "verl's GSM8K GRPO example: the KL is in the loss, not the reward"),
)


def verl_overrides(gpu: GpuTarget, workload: Workload, precision: Precision,
                   choice: MemoryChoice, checkpoints: CheckpointPlan | None = None) -> list[Override]:
    o: list[Override] = []
    add = lambda key, value, why: o.append(Override(key, value, why))  # noqa: E731
    w = workload
    # data
    add("data.train_files", w.train_files, "GSM8K train split in verl's RL format (data stage)")
    add("data.val_files", w.val_files, "GSM8K test split in verl's RL format (data stage)")
    add("data.train_batch_size", w.train_batch_size, "prompts per step (verl's GSM8K quick start: 256, mini-batch 64)"
        + (f"; x rollout.n {w.rollout_n} = PPO's sequences a step" if w.rollout_n > 1 else ""))
    add("data.max_prompt_length", w.max_prompt_length, "GSM8K questions with the chat template and instruction fit in this; longer ones are filtered")
    add("data.max_response_length", w.max_response_length, "room for a step-by-step answer ending in '#### n'")
    add("data.filter_overlong_prompts", True,
        "drop prompts longer than max_prompt_length instead of crashing (default truncation=error)")
    # model
    add("actor_rollout_ref.model.path", w.model_path, "the local model snapshot (model stage); offline")
    add("critic.model.path", w.model_path, "the critic starts from the same model (GAE needs a value model)")
    add("algorithm.adv_estimator", "gae" if w.uses_critic else "grpo",
        "PPO with a learned critic" if w.uses_critic else "GRPO: group-relative advantages, no critic model")
    add("actor_rollout_ref.rollout.n", w.rollout_n, "samples per prompt" + (" (GRPO's group)" if w.rollout_n > 1 else ""))
    add("actor_rollout_ref.actor.ppo_mini_batch_size", w.ppo_mini_batch_size, "prompts per actor update")
    add("actor_rollout_ref.actor.use_kl_loss", w.use_kl_loss,
        "reference model only when the KL loss is on (it costs a model copy)")
    if not w.uses_critic:
        for key, value, why in GRPO_OVERRIDES:
            add(key, value, why)
    if w.lora:
        for key, value, why in lora_overrides(gpu, w, precision):
            add(key, value, why)
    # precision
    mp = {"param_dtype": precision.train_dtype, "reduce_dtype": "fp32", "buffer_dtype": "fp32"}
    for role, label in (("actor_rollout_ref.actor", "actor"), ("actor_rollout_ref.ref", "reference"),
                        ("critic.model", "critic")):
        for fld, val in mp.items():
            add(f"{role}.fsdp_config.mixed_precision.{fld}", val,
                f"{label} FSDP {fld}: {precision.train_dtype} training on compute capability {gpu.compute_capability}"
                if fld == "param_dtype" else f"{label} {fld} in fp32 for stable sums")
        if role == "actor_rollout_ref.actor" and w.lora:
            add(f"{role}.fsdp_config.model_dtype", precision.train_dtype,
                "LoRA: the actor's frozen base is loaded in the training dtype (it takes no optimizer step, so no fp32 "
                "master copy); PEFT keeps the adapters in fp32, so AdamW steps fp32 weights")
            continue
        add(f"{role}.fsdp_config.model_dtype", MASTER_DTYPE if role != "actor_rollout_ref.ref" or precision.train_dtype == "fp32"
            else "bf16",
            f"{label} weights are loaded in this dtype"
            + (" (fp32 master weights; the optimizer must not run in half precision)" if role != "actor_rollout_ref.ref"
               else (" (bf16: inference only)" if precision.train_dtype == "bf16" else " (no bf16 on this GPU)")))
    # attention
    for key, label in (("actor_rollout_ref.model.override_config._attn_implementation", "actor and reference"),
                       ("critic.model.override_config._attn_implementation", "critic (project patch reads it)")):
        add(key, precision.attn_implementation, f"{label}: verl {VERL_VERSION} hard-codes flash_attention_2 otherwise")
    rmpad = precision.attn_implementation == "flash_attention_2"
    add("actor_rollout_ref.model.use_remove_padding", rmpad,
        "padding removal uses flash-attn's kernels" if rmpad else "padding removal needs flash-attn")
    add("critic.model.use_remove_padding", rmpad,
        "padding removal uses flash-attn's kernels" if rmpad else "padding removal needs flash-attn")
    for key, label in (("actor_rollout_ref.model.enable_gradient_checkpointing", "actor"),
                       ("critic.model.enable_gradient_checkpointing", "critic")):
        ranked = speed_ranked(w) and not w.actor_offload_policy
        add(key, choice.grad_ckpt,
            (f"{label}: the fastest update that fits by the speed model: a larger micro-batch (fewer fixed costs per "
             "micro-batch) for a recomputed forward" if ranked else
             f"{label}: needed to fit the memory budget"
             + (" at a larger update micro-batch (fewer PCIe round trips)" if w.actor_offload_policy else ""))
            + " (recomputes each layer in the backward pass)" if choice.grad_ckpt
            else f"{label}: the estimate fits without it, and it costs a recomputed forward in every update")
    add("actor_rollout_ref.actor.use_torch_compile", precision.use_torch_compile,
        "Triton supports this GPU" if precision.use_torch_compile
        else f"Triton refuses compute capability {gpu.compute_capability} < 7.0")
    # rollout
    add("actor_rollout_ref.rollout.name", precision.rollout,
        "vLLM on compute capability >= 7.0" if precision.rollout == "vllm" else
        "no vLLM below compute capability 7.0" if gpu.cc < VLLM_MIN_CC else "workload.rollout = 'hf' asks for it")
    add("actor_rollout_ref.rollout.dtype", precision.rollout_dtype, "generation dtype for this GPU")
    add("actor_rollout_ref.rollout.tensor_model_parallel_size", choice.rollout_tp,
        "the rollout fits one GPU (default is 2)" if choice.rollout_tp == 1 else
        f"vLLM's weights and KV cache do not fit one GPU beside the training states: each rollout engine spans "
        f"{choice.rollout_tp} GPUs (tensor parallel)")
    if precision.rollout == "vllm":
        share = choice.vllm_gpu_memory_utilization
        add("actor_rollout_ref.rollout.gpu_memory_utilization", share,
            "share of the whole GPU that vLLM's V1 engine may fill, counting the training states this process "
            "already holds when vLLM starts" if vllm_engine(gpu) == "v1" else
            "vLLM V0's own share of the GPU (weights, profiling activations, KV cache) on top of the training "
            "states")
        add("actor_rollout_ref.rollout.max_num_batched_tokens", max_num_batched_tokens(w),
            "chunked prefill needs max_num_batched_tokens >= prompt + response length")
        add("actor_rollout_ref.rollout.engine_kwargs.vllm.max_num_seqs", choice.rollout_micro_batch * choice.rollout_tp,
            "sequences at once: the share of a step of the GPUs the engine spans, when the memory estimate fits it (else in waves); "
            "rollout.max_num_seqs is never passed to vLLM in 0.5.0")
    else:
        add("actor_rollout_ref.rollout.micro_batch_size", choice.rollout_micro_batch,
            "prompts per HF generate() call, from the memory estimate")
    # micro-batches
    add("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", choice.actor_micro_batch, "from the memory estimate")
    add("actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu", choice.log_prob_micro_batch,
        "the largest no-gradient micro-batch the estimate fits (actor log-probs)")
    add("actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu", choice.log_prob_micro_batch,
        "as the actor's log-prob pass")
    add("critic.ppo_micro_batch_size_per_gpu", choice.critic_micro_batch, "from the memory estimate")
    add("critic.forward_micro_batch_size_per_gpu", choice.log_prob_micro_batch,
        "the critic's value pass has no gradients: as the actor's log-prob pass")
    # offload
    if w.actor_offload_policy:
        add("actor_rollout_ref.actor.strategy", "fsdp2", "FSDP2 (fully_shard) for the actor; the ref follows "
            "(actor_rollout_ref.ref.strategy interpolates it, and verl builds the ref with the actor's strategy)")
        add("actor_rollout_ref.actor.fsdp_config.offload_policy", True, "CPUOffloadPolicy: the actor's params, "
            "gradients and AdamW states on the CPU, the AdamW step there (FSDP2 only; verl 0.5.0 always offloads the ref)")
        for field_name, (key, why) in OFFLOAD_KNOBS.items():
            if field_name == "rollout_gather_once" and precision.rollout != "hf":
                continue
            on = getattr(choice, field_name)
            add(key, on, why if on else "off: the memory estimate does not fit it beside this phase's batch, or the "
                                        "speed model ranks it slower (tasks/speed.py)")
    for name in OFFLOAD_LADDER:
        on = bool(choice.offload.get(name))
        if w.actor_offload_policy and name.startswith("actor"):
            why = "verl 0.5.0 ignores it under offload_policy (fsdp_workers forces it False): CPUOffloadPolicy offloads"
        elif w.actor_offload_policy and name == "ref_param_offload":
            why = "says what happens: verl 0.5.0 builds the ref with CPUOffloadPolicy under fsdp2 whatever this flag says"
        elif name == "ref_param_offload" and not w.uses_reference:
            why = "no reference model in this run"
        elif name == "ref_param_offload" and w.lora:
            why = "no reference model: with LoRA verl's reference is the actor with its adapter disabled (ref_in_actor)"
        elif name == "actor_optimizer_offload" and w.lora:
            why = "LoRA: the adapters' AdamW states are megabytes; only the frozen base is worth offloading"
        elif name == "actor_param_offload" and w.lora and on:
            why = "the frozen base waits in host RAM between passes: without it the estimate exceeds the budget"
        elif name == "ref_param_offload":
            why = ("not taken: verl 0.5.0 kept the FSDP1 ref's params on the GPU with it on (GPU call 12), so the "
                   "plan counts them resident")
        elif name == "actor_param_offload" and precision.rollout == "hf":
            why = "never with the HF rollout: verl 0.5.0 does not reload offloaded actor params before generation"
        else:
            why = "needed to fit the memory budget" if on else "fits without it (offload costs PCIe time every step)"
        add(OFFLOAD_KEYS[name], on, why)
    # trainer
    add("trainer.n_gpus_per_node", gpu.count, f"{gpu.count} x {gpu.name} on this box")
    add("trainer.nnodes", 1, "one box")
    add("trainer.total_epochs", w.total_epochs, "passes over GSM8K's train split (settings workload.epochs)"
        + ("; the step cap below ends the run first" if w.total_training_steps else ""))
    if w.total_training_steps is not None:
        add("trainer.total_training_steps", w.total_training_steps, "settings.train_steps caps the run")
    add("trainer.logger", list(w.trackers), "the journal keeps the console log"
        + (f"; {', '.join(w.trackers[1:])}: settings tracking (docs/tracking.md)" if len(w.trackers) > 1 else ""))
    add("trainer.project_name", w.project_name, "the trackers' project")
    add("trainer.experiment_name", f"{w.run_name}-{'ppo' if w.uses_critic else 'grpo'}" if w.run_name
        else w.experiment_name, "the trackers' run: the box, the model and the plan's algorithm")
    add("trainer.default_local_dir", w.checkpoint_dir, "checkpoints under the train dir")
    add("trainer.resume_mode", "auto", "a restarted unit resumes from the last checkpoint")
    for key, value, why in retention_overrides(checkpoints or checkpoint_plan(w, gpu.count, precision.train_dtype)):
        add(key, value, why)
    add("trainer.val_before_train", False, "start training at once")
    return o if w.uses_critic else [x for x in o if not x.key.startswith("critic.")]   # verl builds no critic


def plan_env(precision: Precision, gpu: GpuTarget) -> tuple[dict[str, str], list[Reason]]:
    env: dict[str, str] = {}
    reasons: list[Reason] = []
    if precision.rollout == "vllm":
        engine = vllm_engine(gpu)
        env["VLLM_USE_V1"] = "1" if engine == "v1" else "0"
        reasons.append(Reason("VLLM_USE_V1", env["VLLM_USE_V1"],
                              f"pins vLLM 0.8.5's {engine.upper()} engine, the one gpu_memory_utilization was sized "
                              "for (V1 counts everything the process holds in its share, V0 only its own need)"))
    if precision.rollout == "hf":
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
        reasons.append(Reason("PYTORCH_CUDA_ALLOC_CONF", env["PYTORCH_CUDA_ALLOC_CONF"],
                              "less fragmentation between rollout and training phases"))
    else:
        reasons.append(Reason("PYTORCH_CUDA_ALLOC_CONF", "(unset)",
                              "vLLM's sleep mode (free_cache_engine) allocates from a CUDA memory pool and "
                              "refuses to start when expandable_segments:True is set"))
    return env, reasons


def checkpoint_plan(workload: Workload, world_size: int, train_dtype: str = MASTER_DTYPE) -> CheckpointPlan:
    """The rung's checkpoints (tasks/checkpoints.py): one save's bytes for its layout (the actor on
    FSDP2 on the CPU-offload rungs, else FSDP1; a critic on PPO), over ``world_size`` ranks; on a LoRA
    rung the actor's frozen base in ``train_dtype`` (its model_dtype there) and its adapters."""
    from tasks.memory import ModelShape
    from tasks.memory.lora import LORA_MODULES

    w = workload
    targets = LORA_MODULES if w.target_modules == "all-linear" else tuple(w.target_modules)
    plan = plan_checkpoints if not w.lora else functools.partial(
        plan_lora_checkpoints, lora_rank=w.lora_rank, lora_targets=targets, base_dtype=train_dtype)
    return plan(ModelShape.from_config(dict(w.model_config)), critic=w.uses_critic,
                actor_layout="fsdp2" if w.actor_offload_policy else "fsdp", world_size=world_size,
                param_dtype=MASTER_DTYPE, side_files_bytes=w.model_side_bytes,
                keep=w.checkpoint_keep, every=w.save_freq, total_steps=w.total_training_steps)
