"""GPU memory estimates for training and generation with a Hugging Face causal LM, and for verl.

Pure Python (no torch): everything is computed from the model's ``config.json``.

Interface (used by the training planner)::

    from tasks.memory import (ModelShape, train_step_peak, generate_peak, VerlWorkload,
                              verl_gpu_budget, Estimate)
    shape = ModelShape.from_config(json.load(open("files/models/qwen2.5-0.5b-instruct/config.json")))
    Estimate(peak_mib: float, breakdown: dict[str, float], host_ram_mib: float = 0.0)
    train_step_peak(shape, role="actor"|"critic", dtype="fp32"|"bf16"|"fp16",
                    attn="sdpa"|"eager", grad_ckpt=bool, micro_batch=int, seq_len=int) -> Estimate
    generate_peak(shape, batch=int, prompt_len=int, new_tokens=int, dtype=str,
                  attn="sdpa") -> Estimate
    verl_gpu_budget(shape, VerlWorkload(...)) -> Estimate
        # breakdown keys: actor_states, actor_activations, critic_states, critic_activations,
        # ref_states, rollout, cuda_context (+ phase_* totals); host_ram_mib = offloaded states

CLI (from the repository root)::

    python -m tasks.memory --json --role actor --dtype bf16 --attn sdpa --grad-ckpt \\
        --micro-batch 4 --seq-len 1024
    python -m tasks.memory --json --role generate --batch 64 --prompt-len 512 --new-tokens 256 --dtype bf16

What ``train_step_peak`` estimates (and bench/gpu/calibrate_memory.py measures on a GPU):
``torch.cuda.max_memory_allocated()`` over >= 3 single-process training steps, minus what was
allocated before the model was built. A step: fp32 master weights; forward under
``torch.autocast(dtype)`` (no autocast for fp32) with ``use_cache=False``; loss =
``logits.float().mean()``; ``backward()``; ``torch.optim.AdamW`` (torch's default foreach
implementation) ``step()``; ``zero_grad(set_to_none=True)``. ``--grad-ckpt`` is
``model.gradient_checkpointing_enable()`` with transformers' default, which is
``use_reentrant=False`` in transformers 5.x (non-reentrant checkpointing of each decoder layer).
The CUDA context is not in ``max_memory_allocated``: it is reported in the breakdown as
``cuda_context`` and left out of ``peak_mib``.

What ``generate_peak`` estimates: the peak allocated during ``model.generate`` (greedy,
``min_new_tokens == max_new_tokens``, weights in ``dtype``, no autocast, DynamicCache),
weights included.

Where the numbers come from. The byte counts per tensor follow the code paths of
transformers 5.x's Qwen2/Llama-style decoder (RMSNorm in fp32, q/k/v/o and gate/up/down
projections, rotary, sdpa or eager attention) and of torch autograd (which tensors a backward
needs). They are *derived*, then *measured* on an H200 (torch 2.11, transformers 5.17):
constants marked ``# measured`` were set from bench/gpu/results/memory-h200.json (fit split);
the held-out split was never used to set them (docs/memory.md has the table). Everything in
``verl_gpu_budget`` beyond the single-process step is *inferred* from verl 0.5.0's design (one
colocated process on one GPU, phases one after another); it has not been measured.
"""

from __future__ import annotations

from tasks.memory.cli import main
from tasks.memory.generate import (
    DECODE_LOGITS_EXTRA,
    DECODE_PREV_LOGITS,
    VLLM_KV_MARGIN,
    VLLM_NON_TORCH_MIB,
    VllmMemory,
    generate_peak,
    vllm_memory,
    vllm_profile_mib,
)
from tasks.memory.lora import (
    LORA_CKPT_ACTIVATION_SCALE,
    LORA_MODULES,
    LoraMerge,
    LoraSpec,
    adapted_base_params,
    adapter_params,
    lora_gpu_budget,
    lora_held_at_vllm_start_mib,
    lora_merge,
)
from tasks.memory.shape import (
    ATTNS,
    CUDA_CONTEXT_MIB,
    DEFAULT_CONFIG,
    DTYPES,
    MIB,
    OFFLOADED_OPTIMIZER_EXTRA,
    OLD_CARD_OUTSIDE_TORCH_MARGIN_MIB,
    ROLES,
    STEP_MISC_MIB,
    VERL_ACTOR_LOGIT_BYTES_AUTOCAST,
    VERL_LOGPROB_BYTES,
    VERL_PROCESS_OVERHEAD_MIB,
    VERL_UPDATE_EXTRA_MIB,
    WORKSPACE_MIB,
    Estimate,
    ModelShape,
)
from tasks.memory.train_step import (
    LOGITS_BWD,
    LOGITS_FWD,
    QUAD_BWD_TRANSIENT,
    QUAD_FWD_TRANSIENT,
    QUAD_SAVED,
    SCORE_MASK_BYTES,
    train_step_peak,
)
from tasks.memory.verl_budget import VerlWorkload, held_at_vllm_start_mib, verl_gpu_budget
from tasks.memory.vllm_lora import VLLM_LORA_RANKS, vllm_lora_buffers, vllm_lora_mib

__all__ = [
    "MIB", "DTYPES", "ATTNS", "ROLES", "DEFAULT_CONFIG", "CUDA_CONTEXT_MIB", "WORKSPACE_MIB", "STEP_MISC_MIB",
    "VERL_PROCESS_OVERHEAD_MIB", "OLD_CARD_OUTSIDE_TORCH_MARGIN_MIB", "VERL_UPDATE_EXTRA_MIB",
    "OFFLOADED_OPTIMIZER_EXTRA", "VERL_ACTOR_LOGIT_BYTES_AUTOCAST", "VERL_LOGPROB_BYTES", "ModelShape", "Estimate",
    "QUAD_SAVED", "QUAD_FWD_TRANSIENT", "QUAD_BWD_TRANSIENT", "SCORE_MASK_BYTES", "LOGITS_FWD", "LOGITS_BWD",
    "train_step_peak", "DECODE_LOGITS_EXTRA", "DECODE_PREV_LOGITS", "generate_peak", "VLLM_NON_TORCH_MIB",
    "VLLM_KV_MARGIN", "VllmMemory", "vllm_profile_mib", "vllm_memory", "VerlWorkload", "verl_gpu_budget",
    "held_at_vllm_start_mib", "LORA_MODULES", "LORA_CKPT_ACTIVATION_SCALE", "VLLM_LORA_RANKS", "LoraSpec",
    "LoraMerge", "adapter_params", "adapted_base_params", "lora_gpu_budget", "lora_held_at_vllm_start_mib",
    "lora_merge", "vllm_lora_buffers", "vllm_lora_mib", "main",
]
