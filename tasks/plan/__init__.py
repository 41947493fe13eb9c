"""The training plan: which verl 0.5.0 settings a box's GPU gets, and why.

Pure: ``make_plan(gpu, workload)`` takes what the GPU is (name, compute capability, memory,
count), the workload (model shape, data paths, lengths, batch sizes, steps) and a memory
estimator, and returns a ``TrainingPlan``: Hydra overrides for ``verl.trainer.main_ppo``, the
process environment, the predicted peak GPU memory, and a reason for every setting.

The rules (docs/plan.md gives the reason for each):

* precision: bf16 mixed precision on compute capability >= 8.0; below that fp32 training
  (verl 0.5.0 has no loss scaling, so fp16 training could underflow), fp16 vLLM rollout on 7.x;
* attention: ``sdpa`` everywhere (PyTorch picks a flash kernel on sm80+ itself);
  ``flash_attention_2`` only when flash-attn is installed and the GPU is sm80+;
* rollout: vLLM on >= 7.0, the HF-transformers rollout below (no vLLM on Pascal);
  ``use_torch_compile=False`` below 7.0 (Triton refuses those GPUs). vLLM 0.8.5 runs its V1
  engine on >= 8.0 and V0 below; the plan pins the engine (``VLLM_USE_V1``) and sizes
  ``gpu_memory_utilization`` by that engine's own accounting (``vllm_memory``);
* the fallback ladder (``RUNGS``), best training first, until one fits: PPO with a critic ->
  GRPO (no critic, ``GRPO_N`` samples per prompt, the KL loss of verl's GRPO example) -> PPO and
  GRPO with LoRA adapters on the actor (``workload.finetune``: "auto" takes them where full
  fine-tuning needs the CPU-offload rung; tasks/plan/lora.py) -> GRPO with the actor on FSDP2 CPU
  offload -> the same with shorter responses;
* memory, on every full rung: without gradient checkpointing first, then with it (on the LoRA rungs: the
  (micro-batch, checkpointing) pair the speed model ranks fastest, tasks/speed.py); at each, no offload unless the
  estimate says it does not fit, then the ladder reference params -> actor optimizer ->
  critic optimizer -> actor params -> critic params (fewer offloads = faster). HF rollout
  never gets actor param offload (0.5.0 does not reload an offloaded actor before HF
  generation). Within a level the largest update micro-batch that fits wins; then the
  no-gradient passes (log-probs, values) and the HF rollout's generation chunk each get the
  largest size that still fits. Nothing fits: ``PlanError`` with the shortfall in MiB.

CLI: ``python -m tasks.plan --json --gpu-name NAME --compute-capability X.Y --gpu-memory-mib N``.

The package, one decision a module, in the order they import each other (none imports this package:
tests/unit/test_import_layers.py fails on a cycle):

* ``terms``: what a plan is made of (GpuTarget, Workload, Precision, MemoryChoice, MemoryEstimate,
  Reason, TrainingPlan, PlanError) and the names of the offload settings;
* ``precision``: precision, attention and rollout engine from the compute capability;
* ``estimator``: the memory estimate of one choice (tasks/memory/), the GPU budget, vLLM's share;
* ``memory_fit``: the fastest choice the estimate fits on one rung (offloads, checkpointing,
  micro-batches, the speed model's ranking on the CPU-offload rung);
* ``lora``: the LoRA rungs' overrides, vLLM's rank rule, the finetune reason with both speeds;
* ``overrides``: verl's overrides and the process environment, each with its reason; the checkpoints;
* ``rungs``: ``make_plan``: the fallback ladder of rungs, verl 0.5.0's own checks;
* ``cluster``: a Ray cluster's plan, by its weakest GPU;
* ``workload``: a host's workload from its settings and the catalog's models;
* ``doc_tables``: docs/plan.md's tables; ``cli``: ``python -m tasks.plan``.

Callers import from ``tasks.plan``; every public name is re-exported here.
"""

from __future__ import annotations

from tasks.plan.cli import main
from tasks.plan.cluster import cluster_plan, weakest_gpu
from tasks.plan.doc_tables import DOC_GPUS, DOC_MIXED, doc_targets, doc_workload, gpu_table, model_table
from tasks.plan.estimator import (
    VLLM_SHARE_MAX,
    VLLM_SHARE_MIN,
    default_estimator,
    gpu_budget_mib,
    max_num_batched_tokens,
    vllm_memory_for,
)
from tasks.plan.lora import (
    FINETUNES,
    FULL_ACTOR_LR,
    LORA_LR_SCALE,
    finetune_reason,
    lora_memory_reasons,
    lora_overrides,
)
from tasks.plan.memory_fit import (
    FORWARD_MICRO_CHOICES,
    MICRO_BATCH_CHOICES,
    ROLLOUT_CHUNK_CHOICES,
    UNMEASURED_KNOBS,
    gpu_seconds,
    knob_values,
    offload_levels,
    offload_seconds,
    rollout_chunk_choices,
    rollout_tp_choices,
    search_memory,
    search_offload,
    speed_ranked,
)
from tasks.plan.overrides import GRPO_OVERRIDES, MASTER_DTYPE, checkpoint_plan, plan_env, verl_overrides
from tasks.plan.precision import ROLLOUT_ENGINES, VLLM_MIN_CC, choose_precision, rollout_refusal, vllm_engine
from tasks.plan.rungs import ALGORITHMS, GRPO_N, RUNGS, ladder, make_plan, verl_refusal
from tasks.plan.terms import (
    OFFLOAD_KEYS,
    OFFLOAD_KNOBS,
    OFFLOAD_LADDER,
    Estimator,
    GpuTarget,
    MemoryChoice,
    MemoryEstimate,
    PlanError,
    Precision,
    Reason,
    TrainingPlan,
    Workload,
)
from tasks.plan.workload import (
    DEFAULT_MODEL_CONFIG,
    REPO_ROOT,
    catalog_model_config,
    catalog_models,
    load_model_config,
    model_config_path,
    plan_naming_models_that_fit,
    plan_overrides_for_host,
    with_model,
    workload_for,
)

__all__ = [
    "OFFLOAD_LADDER", "OFFLOAD_KEYS", "OFFLOAD_KNOBS", "PlanError", "GpuTarget", "Workload", "Precision",
    "MemoryChoice", "MemoryEstimate", "Estimator", "Reason", "TrainingPlan", "vllm_engine", "ROLLOUT_ENGINES",
    "VLLM_MIN_CC", "rollout_refusal", "choose_precision", "VLLM_SHARE_MAX", "VLLM_SHARE_MIN", "gpu_budget_mib",
    "max_num_batched_tokens", "vllm_memory_for", "default_estimator", "MICRO_BATCH_CHOICES",
    "FORWARD_MICRO_CHOICES", "ROLLOUT_CHUNK_CHOICES", "UNMEASURED_KNOBS", "knob_values", "offload_levels",
    "rollout_chunk_choices", "rollout_tp_choices", "search_memory", "offload_seconds", "search_offload",
    "speed_ranked", "FINETUNES", "FULL_ACTOR_LR", "LORA_LR_SCALE", "finetune_reason", "gpu_seconds",
    "lora_memory_reasons", "lora_overrides",
    "MASTER_DTYPE", "GRPO_OVERRIDES", "verl_overrides", "plan_env", "checkpoint_plan", "GRPO_N", "RUNGS",
    "ALGORITHMS", "make_plan", "verl_refusal", "ladder", "weakest_gpu", "cluster_plan", "REPO_ROOT",
    "DEFAULT_MODEL_CONFIG", "catalog_models", "with_model", "plan_naming_models_that_fit", "load_model_config",
    "model_config_path", "catalog_model_config", "workload_for", "plan_overrides_for_host", "DOC_GPUS",
    "DOC_MIXED", "doc_targets", "gpu_table", "model_table", "doc_workload", "main",
]
