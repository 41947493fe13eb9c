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

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

from verl_lab_box.vllm_share import kv_cache_mib, smallest_share

MIB = 1024.0 * 1024.0
DTYPES = ("fp32", "bf16", "fp16")
ATTNS = ("sdpa", "eager")
ROLES = ("actor", "critic")
DEFAULT_CONFIG = Path("files/models/qwen2.5-0.5b-instruct/config.json")

# ---- constants -----------------------------------------------------------------------------
# CUDA context + loaded kernels and library handles of one process on the H200 (torch 2.11,
# CUDA 13): not part of max_memory_allocated. measured (GPU memory in use minus torch's
# reserved): 610 MiB right after CUDA init, 844-884 MiB after the training/generation cases.
CUDA_CONTEXT_MIB = 884.0
# cuBLAS/cuDNN workspaces torch allocates on the first matmul of a process and keeps: counted
# by max_memory_allocated, but once per process, so reported apart (like the CUDA context)
# and left out of peak_mib. measured: 65 MiB after a warm-up of fp32/bf16/fp16 matmuls + sdpa.
WORKSPACE_MIB = 65.0
# Small tensors a training step keeps between steps (rotary tables, inputs, allocator
# rounding): measured, median over the fit split.
STEP_MISC_MIB = 23.0
# For the verl budget: what a verl 0.5.0 worker process holds outside PyTorch beyond the plain
# torch context (NCCL, Ray, cuBLAS handles, more loaded kernels). Measured on the H200 (torch 2.11,
# CUDA 13): NVML's per-process memory minus torch's reserved, the probe's `outside_torch_mib`
# (bench/gpu/probe/sitecustomize.py), read over every recorded run (bench/gpu/results/ppo-*/call*/
# */probe/*.jsonl, GPU calls 1-8): 1236-1368 MiB, the largest 1368 in the rollout of call 2's h200
# and rtx3090 profiles (ppo-20261203/call2/{h200,rtx3090}); 1304 on every GRPO/CPU-offload run of
# calls 7-8. So CUDA_CONTEXT_MIB + this = 1368 MiB, the largest measured. (Was 1024, inferred:
# 1908 in all, 0.90-0.94 of the measured peaks on the 8-11 GB rung; that margin now sits in the
# plan's budget, OLD_CARD_OUTSIDE_TORCH_MARGIN_MIB.)
VERL_PROCESS_OVERHEAD_MIB = 1368.0 - CUDA_CONTEXT_MIB
# What a real old card's process may hold outside PyTorch beyond what the H200 measured: the product
# runs torch 2.6 with CUDA 11.8/12.x on Pascal..Ada cards, whose context, loaded kernels and NCCL
# were never measured (only the H200 with torch 2.11 / CUDA 13 was). Not a prediction: a safety
# margin, the difference between the old inferred allowance (884 + 1024 = 1908 MiB) and the
# largest measured (1368), so that which plans fit is what it was. tasks/plan/estimator.py's gpu_budget_mib
# takes it off every GPU's budget; held_at_vllm_start_mib counts it (vLLM V1 measures the real
# process at its start).
OLD_CARD_OUTSIDE_TORCH_MARGIN_MIB = 1908.0 - 1368.0
# verl's update phases beyond the single-process step, measured on the H200 with real verl 0.5.0
# under the P40 plan (bench/gpu/results/, fp32, no offload, micro-batch 4): the critic update
# peaked 516 MiB and the actor update 166 MiB above the model; with the optimizer offloaded
# (T4 plan, micro-batch 2) 932 and 789 MiB above: the states loaded back for the update cost
# about a sixth of their size again.
VERL_UPDATE_EXTRA_MIB = {"actor": 170.0, "critic": 520.0}
OFFLOADED_OPTIMIZER_EXTRA = 0.17
# verl's actor update in bf16 without checkpointing, measured (RTX 3090 plan micro-batch 4 and
# H200 plan micro-batch 16, 512 tokens): the autocast weight copies plus, per token, every
# layer's saved activations and 3.0 bytes per vocabulary entry (verl slices the response's
# logits and takes log-softmax in bf16 row by row); the single-process step model, which
# keeps fp32 copies of all logits, over-predicted it by 0.3 GB at 4 and 6.7 GB at 16.
VERL_ACTOR_LOGIT_BYTES_AUTOCAST = 3.0
# verl's no-gradient log-prob pass (compute_log_prob, with entropy), bytes per logit element of
# the whole sequence: measured 8.1 (fp32, P40 plan, micro-batch 8) and 7.8 (bf16, H200 plan,
# micro-batch 64, after the bf16 weight copy)
VERL_LOGPROB_BYTES = 8.1


def _bytes(dtype: str) -> int:
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    return 4 if dtype == "fp32" else 2


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a decoder-only transformer that memory depends on."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    tied_embeddings: bool
    qkv_bias: bool = True

    @classmethod
    def from_config(cls, cfg: dict) -> "ModelShape":
        """From a Hugging Face ``config.json`` (Qwen2/Llama/Mistral-style names)."""
        try:
            hidden = int(cfg["hidden_size"])
            heads = int(cfg["num_attention_heads"])
            shape = cls(
                layers=int(cfg["num_hidden_layers"]),
                hidden=hidden,
                heads=heads,
                kv_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or hidden // heads),
                ffn=int(cfg["intermediate_size"]),
                vocab=int(cfg["vocab_size"]),
                tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                qkv_bias=bool(cfg.get("attention_bias", cfg.get("model_type") == "qwen2")),
            )
        except KeyError as exc:
            raise ValueError(f"config.json lacks {exc.args[0]!r}") from None
        if shape.heads % shape.kv_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        return shape

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def layer_params(self) -> int:
        h, q, kv, f = self.hidden, self.q_dim, self.kv_dim, self.ffn
        attn = h * q + 2 * h * kv + q * h + ((q + 2 * kv) if self.qkv_bias else 0)
        return attn + 3 * h * f + 2 * h  # + two RMSNorm weights

    @property
    def embed_params(self) -> int:
        return self.vocab * self.hidden

    def params(self, role: str = "actor") -> int:
        """Parameter count: the causal LM (actor/ref) or the token-classification critic."""
        body = self.layers * self.layer_params + self.embed_params + self.hidden
        if role == "critic":
            return body + self.hidden + 1  # score head Linear(hidden, 1) with bias
        return body + (0 if self.tied_embeddings else self.embed_params)

    def kv_bytes_per_token(self, dtype: str) -> int:
        return 2 * self.layers * self.kv_dim * _bytes(dtype)


@dataclass
class Estimate:
    peak_mib: float
    breakdown: dict[str, float] = field(default_factory=dict)
    host_ram_mib: float = 0.0

    def as_json(self) -> dict:
        return {"peak_mib": round(self.peak_mib, 1),
                "breakdown": {k: round(v, 1) for k, v in self.breakdown.items()},
                "host_ram_mib": round(self.host_ram_mib, 1)}


# ---- activations of one training step ---------------------------------------------------------

def _attention_path(s: ModelShape, dtype: str, attn: str) -> str:
    """Which attention code path runs: "flash" (no score matrix) or "scores" (materialised).

    eager always materialises [batch, heads, seq, seq]. sdpa in bf16/fp16 runs a flash kernel.
    sdpa in fp32 with grouped-query attention (kv_heads < heads) falls back to PyTorch's math
    kernel (enable_gqa is not taken by the memory-efficient kernel), which costs what eager
    costs: measured on the H200, fp32 sdpa and fp32 eager allocated the same bytes.
    fp32 sdpa without GQA is assumed to take the memory-efficient kernel: inferred.
    """
    if attn == "eager":
        return "scores"
    if dtype == "fp32" and s.kv_heads < s.heads:
        return "scores"
    return "flash"


def _layer_saved_bytes_per_token(s: ModelShape, autocast: bool, path: str) -> float:
    """Bytes one decoder layer keeps for backward, per token (no checkpointing).

    The residual stream stays fp32 under autocast (the embedding is not autocast and
    RMSNorm computes in fp32), so each layer keeps two fp32 residual tensors and two fp32
    RMSNorm outputs. Under autocast every Linear casts its input afresh (autocast caches
    casts of leaf weights only), so q/k/v keep three bf16 copies and gate/up two.
    """
    h, q, kv, f, nh = s.hidden, s.q_dim, s.kv_dim, s.ffn, s.heads
    a = 2 if autocast else 4
    norms = 2 * 4 * h + 2 * 4 * h                  # residual inputs + normalised (fp32)
    if autocast:
        proj_in = 3 * a * h + 2 * a * h            # q/k/v and gate/up inputs, cast each time
    else:
        proj_in = a * h + a * h                    # one fp32 input shared by q/k/v, gate/up
    mlp = 4 * a * f                                # gate out, silu out, up out, product
    if path == "flash":
        # q and k (cast after rotary), v, the kernel's output (already [b, s, heads, d], so
        # o_proj's .contiguous() input is the same tensor), logsumexp (fp32 per head)
        att = a * q + 2 * a * kv + a * q + 4 * nh
    else:
        # q, k and v repeated to all heads, o_proj's contiguous input
        att = 3 * a * q + a * q
    return norms + proj_in + mlp + att


# Bytes per attention-score element (batch x heads x seq x seq) per layer, "scores" path.
# Under autocast: the fp32 softmax output (4) and its bf16 copy (2) are saved; the moment of
# the softmax also holds the fp32 masked scores (4, the mask is fp32). fp32: the fp32
# probabilities (4) saved, masked scores (4) + softmax output transient.
QUAD_SAVED = {"autocast": 6.0, "fp32": 4.0}
QUAD_FWD_TRANSIENT = {"autocast": 8.0, "fp32": 8.0}
# backward through one layer's scores: grad of probs, its fp32 cast, the softmax grad
QUAD_BWD_TRANSIENT = {"autocast": 10.0, "fp32": 8.0}
# the causal mask, [batch, 1, seq, seq] in the embedding dtype (fp32)
SCORE_MASK_BYTES = 4.0

# Logits of the actor, bytes per token per vocab entry (measured: exact on the H200).
# Forward: under autocast the bf16 logits (2) and their fp32 copy for the loss (4) are alive
# together; fp32: the logits themselves (4). Backward start: the fp32 gradient of the loss (4)
# and its bf16 cast (2) under autocast; in fp32 the gradient (4) plus the fp32 lm_head weight
# gradient.
LOGITS_FWD = {"autocast": 6.0, "fp32": 4.0}
LOGITS_BWD = {"autocast": 6.0, "fp32": 4.0}


def _layer_bwd_transient_bytes_per_token(s: ModelShape, autocast: bool) -> float:
    """Short-lived gradient tensors inside one layer's backward, per token."""
    a = 2 if autocast else 4
    # grads of gate/up/silu outputs alive together, fp32 residual and norm grads
    return 3 * a * s.ffn + 3 * 4 * s.hidden


def _mode(dtype: str) -> str:
    _bytes(dtype)
    return "fp32" if dtype == "fp32" else "autocast"


def train_step_peak(shape: ModelShape, role: str = "actor", dtype: str = "bf16",
                    attn: str = "sdpa", grad_ckpt: bool = False, micro_batch: int = 1,
                    seq_len: int = 512) -> Estimate:
    """Peak allocated memory of one single-process training step (see module docstring).

    The peak is the largest of three moments of a step after the first (AdamW states exist):
    the end of the forward (saved activations + logits), the backward (its start, with the
    logits' gradient; its end, with all gradients), and the AdamW step (weights, gradients,
    two states and one temporary of the size of all parameters).
    """
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    if attn not in ATTNS:
        raise ValueError(f"attn must be one of {ATTNS}, got {attn!r}")
    if micro_batch < 1 or seq_len < 1:
        raise ValueError("micro_batch and seq_len must be >= 1")
    mode = _mode(dtype)
    autocast = mode == "autocast"
    path = _attention_path(shape, dtype, attn)
    s = shape
    P = s.params(role)
    T = micro_batch * seq_len
    E = micro_batch * s.heads * seq_len * seq_len if path == "scores" else 0
    L = s.layers
    tied_head = role == "actor" and s.tied_embeddings

    weights = 4.0 * P
    grads = 4.0 * P
    adam = 8.0 * P
    adam_temp = 4.0 * P        # foreach AdamW: sqrt(exp_avg_sq) for all params at once
    resident = weights + adam + STEP_MISC_MIB * MIB  # between steps >= 2
    # bf16 copies of weights made by autocast, kept by autograd until backward passes them
    # (the embedding lookup is not autocast; the actor's lm_head is)
    layer_casts = 2.0 * L * s.layer_params if autocast else 0.0
    head_cast = (2.0 * (s.embed_params if role == "actor" else s.hidden + 1)) if autocast else 0.0

    layer_saved = _layer_saved_bytes_per_token(s, autocast, path) * T + QUAD_SAVED[mode] * E
    # after the last layer: final-norm input and output (fp32), the head's input
    head_saved = (4 + 4 + (2 if autocast else 4)) * s.hidden * T
    if role == "critic":
        head_saved += 1 * s.hidden * T   # dropout mask (p=0.1); the score head gets its cast
    mask = SCORE_MASK_BYTES * micro_batch * seq_len * seq_len if path == "scores" else 0.0
    bwd_tmp = _layer_bwd_transient_bytes_per_token(s, autocast) * T + QUAD_BWD_TRANSIENT[mode] * E
    fwd_score_tmp = QUAD_FWD_TRANSIENT[mode] * E

    if role == "actor":
        logits_fwd = LOGITS_FWD[mode] * s.vocab * T
        # backward start: the loss gradient; in fp32 it is alive while the lm_head weight
        # gradient (fp32, vocab x hidden) is made
        logits_bwd = max(LOGITS_BWD[mode] * s.vocab * T,
                         (2.0 if autocast else 4.0) * s.vocab * T + 4.0 * s.embed_params)
    else:
        logits_fwd = logits_bwd = 0.0
    # the end of backward: every gradient, plus the embedding's dense gradient being added to
    # the tied lm_head's one
    bwd_end = resident + grads + (4.0 * s.embed_params if tied_head else 0.0)

    if not grad_ckpt:
        saved = layer_casts + head_cast + L * layer_saved + head_saved
        activations = L * layer_saved + head_saved
        fwd = resident + max(saved + logits_fwd,
                             saved - head_saved + fwd_score_tmp + mask)   # last layer's softmax
        bwd_start = resident + saved + max(logits_bwd, bwd_tmp)
        bwd = max(bwd_start, bwd_end)
    else:
        ckpt_in = 4.0 * s.hidden * T            # a checkpointed layer keeps its fp32 input
        activations = L * ckpt_in + head_saved + mask
        saved = activations + head_cast
        one_layer = layer_saved + (2.0 * s.layer_params if autocast else 0.0)
        # forward: autocast's cache holds every layer's weight casts until autocast exits
        fwd = resident + saved + layer_casts + max(logits_fwd, one_layer + fwd_score_tmp)
        bwd_start = resident + saved + logits_bwd
        head_grad = 4.0 * (s.embed_params if role == "actor" else s.hidden + 1)
        # the last layer is recomputed and back-propagated first, the first layer last
        bwd_first = resident + activations + head_grad + one_layer + bwd_tmp
        grads_before_layer0 = grads - 4.0 * s.layer_params - (0.0 if tied_head else 4.0 * s.embed_params)
        bwd_last = resident + grads_before_layer0 + ckpt_in + mask + one_layer + bwd_tmp
        bwd = max(bwd_start, bwd_first, bwd_last, bwd_end)
    opt = resident + grads + adam_temp
    peak = max(fwd, bwd, opt)
    bd = {
        "weights": weights / MIB,
        "gradients": grads / MIB,
        "adamw_states": adam / MIB,
        "adamw_step_temp": adam_temp / MIB,
        "autocast_weight_copies": (layer_casts + head_cast) / MIB,
        "activations_saved": activations / MIB,
        "logits_transient": max(logits_fwd, logits_bwd) / MIB,
        "phase_forward": fwd / MIB,
        "phase_backward": bwd / MIB,
        "phase_backward_start": bwd_start / MIB,
        "phase_optimizer": opt / MIB,
        "cublas_workspace": WORKSPACE_MIB,
        "cuda_context": CUDA_CONTEXT_MIB,
    }
    return Estimate(peak_mib=peak / MIB, breakdown=bd)


# ---- generation -------------------------------------------------------------------------------

# Next-token logits during decoding, bytes per sequence per vocab entry beyond the model's own
# [batch, vocab] logits: the fp32 copy, the processed scores (min_new_tokens masks eos), and
# the previous step's fp32 copies still referenced. measured (bf16, fit split): 20.
DECODE_LOGITS_EXTRA = 20.0
# While a decode step runs a layer, the previous step's fp32 logits and scores are alive.
DECODE_PREV_LOGITS = 8.0


def generate_peak(shape: ModelShape, batch: int = 1, prompt_len: int = 128, new_tokens: int = 128,
                  dtype: str = "bf16", attn: str = "sdpa", residual_dtype: str | None = None) -> Estimate:
    """Peak allocated memory of HF ``model.generate`` (greedy), weights included.

    ``residual_dtype``: the dtype of the residual stream (the embedding's output, the norms, the residual adds)
    when it differs from the matmuls' (``dtype``): generating under half-precision autocast over fp32 weights
    keeps it fp32 (verl's HF rollout on fp32 plans with an fp16 rollout: GPU call 13, and the T4 profile).

    Two moments: the prefill (the prompt's KV cache of every layer, plus the MLP of the last
    layer over all prompt tokens, or eager's score matrix), and the last decode step (the whole
    KV cache plus the next-token logits, or the repeated K/V of one layer when attention runs
    PyTorch's math kernel: fp32 sdpa with GQA, or eager).
    """
    if batch < 1 or prompt_len < 1 or new_tokens < 1:
        raise ValueError("batch, prompt_len and new_tokens must be >= 1")
    if attn not in ATTNS:
        raise ValueError(f"attn must be one of {ATTNS}, got {attn!r}")
    s = shape
    w = _bytes(dtype)
    path = _attention_path(s, dtype, attn)
    weights = float(w * s.params("actor"))
    kv_tok = s.kv_bytes_per_token(dtype)
    total_len = prompt_len + new_tokens
    kv_final = batch * (total_len - 1) * kv_tok          # the last token is never fed back
    kv_prompt = batch * prompt_len * kv_tok
    Tp = batch * prompt_len
    # prefill MLP: silu(gate), up and their product alive together, with the residual stream,
    # the norm output and their neighbours (measured: 4 hidden-sized tensors)
    r = _bytes(residual_dtype or dtype)
    prefill_tmp = (3 * w * s.ffn + 4 * r * s.hidden) * Tp
    if attn == "eager":
        E = batch * s.heads * prompt_len * prompt_len
        # masked scores (w), softmax(dtype=fp32) output (4) and, for bf16 input, the fp32 copy
        # of its input that softmax makes first (fp16 has a fused half-to-float path)
        per_e = w + 4 + (4 if dtype == "bf16" else 0)
        per_e = max(per_e, w + 4 + w)                    # then the cast back to the model dtype
        scores = per_e * E + w * batch * prompt_len * prompt_len \
            + w * (2 * s.hidden + 3 * s.q_dim) * Tp      # mask; residual, norm out, q, repeated k/v
        prefill_tmp = max(prefill_tmp, scores)
    elif path == "scores":
        E = batch * s.heads * prompt_len * prompt_len
        prefill_tmp = max(prefill_tmp, 8.0 * E + w * 3 * s.q_dim * Tp)
    logits_moment = batch * s.vocab * (w + DECODE_LOGITS_EXTRA) \
        + batch * total_len * s.kv_dim * w               # torch.cat growing one layer's K or V
    attn_moment = 0.0
    if path == "scores":
        rep = 2 * batch * s.q_dim * total_len * w        # K and V repeated to every head
        attn_moment = batch * s.vocab * DECODE_PREV_LOGITS + rep \
            + batch * s.heads * total_len * (4 + 2 * w)
    prefill = weights + kv_prompt + prefill_tmp
    decode = weights + kv_final + max(logits_moment, attn_moment)
    peak = max(prefill, decode)
    bd = {
        "weights": weights / MIB,
        "kv_cache": kv_final / MIB,
        "prefill_transient": prefill_tmp / MIB,
        "decode_transient": max(logits_moment, attn_moment) / MIB,
        "phase_prefill": prefill / MIB,
        "phase_decode": decode / MIB,
        "cublas_workspace": WORKSPACE_MIB,
        "cuda_context": CUDA_CONTEXT_MIB,
    }
    return Estimate(peak_mib=peak / MIB, breakdown=bd)


# ---- vLLM 0.8.5 on the training GPU -----------------------------------------------------------
# How vLLM 0.8.5 turns gpu_memory_utilization into a KV cache, V1 and V0, read in the release's
# files: verl_lab_box/vllm_share.py, the one place of that arithmetic (the training launcher sizes
# the share again with it at start, for what other processes hold on the GPU then). The plan sizes
# it for a GPU with nothing else on it and nvidia-smi's memory.total.
VLLM_NON_TORCH_MIB = 256.0     # inferred: what vLLM's worker adds outside torch (cuBLAS, NCCL)
VLLM_KV_MARGIN = 1.1           # inferred: 16-token block rounding and the scheduler's watermark


@dataclass(frozen=True)
class VllmMemory:
    """vLLM's memory on the training GPU for one share (all MiB)."""

    engine: str                  # "v0" | "v1"
    share: float                 # gpu_memory_utilization
    weights_mib: float
    profile_mib: float           # activations of the profiling forward (the generation peak)
    non_torch_mib: float
    kv_wanted_mib: float         # one step's sequences at full length
    kv_granted_mib: float        # what vLLM's accounting gives the KV cache at this share
    held_at_start_mib: float     # what the process holds when vLLM starts (V1 counts it)

    @property
    def own_mib(self) -> float:
        """What vLLM counts as its own before the KV cache: weights, profiling activations, non-torch."""
        return self.weights_mib + self.profile_mib + self.non_torch_mib

    @property
    def rollout_mib(self) -> float:
        """What vLLM adds on top of the training states while it generates (awake)."""
        return self.own_mib + self.kv_granted_mib


def vllm_profile_mib(shape: ModelShape, dtype: str, max_num_batched_tokens: int, max_num_seqs: int,
                     tp: int = 1) -> float:
    """Activation peak of vLLM's profiling forward: one layer's residual, hidden states, q/k/v,
    attention output, gate/up and activated MLP over max_num_batched_tokens tokens, with half
    again for the allocator, plus the sampler's fp32 logits, probabilities, log-probabilities,
    sorted values, int64 sort indices and masks for max_num_seqs sequences (inferred from the
    model runner's dummy runs)."""
    w = _bytes(dtype)
    layer = max_num_batched_tokens * (2 * shape.hidden + (2 * shape.q_dim + 2 * shape.kv_dim + 3 * shape.ffn) / tp) * w
    sampler = max_num_seqs * shape.vocab * 4 * 8
    return (1.5 * layer + sampler) / MIB


def vllm_memory(shape: ModelShape, *, engine: str, dtype: str, gpu_memory_mib: int, seqs: int, seq_len: int,
                max_num_batched_tokens: int, held_at_start_mib: float, share_min: float = 0.05,
                share_max: float = 0.9, tp: int = 1) -> VllmMemory:
    """The smallest share (in 0.01 steps) whose KV cache holds ``seqs`` sequences of ``seq_len``
    under ``engine``'s accounting; capped at ``share_max`` (then the KV cache may fall short:
    ``kv_granted_mib < kv_wanted_mib`` says so). ``tp`` > 1: one engine spans ``tp`` GPUs and each
    holds 1/tp of the weights, of the heads' KV cache and of the layer activations (inferred: not
    measured), for ``tp`` times the sequences (verl gives the engine its GPUs' share of the batch)."""
    weights = _bytes(dtype) * shape.params("actor") / MIB / tp
    kv_wanted = VLLM_KV_MARGIN * shape.kv_bytes_per_token(dtype) * seqs * seq_len / MIB
    profile = vllm_profile_mib(shape, dtype, max_num_batched_tokens, seqs * tp, tp)
    own = weights + profile + VLLM_NON_TORCH_MIB
    share = smallest_share(engine, gpu_memory_mib, own, kv_wanted, held_at_start_mib)
    share = float(min(share_max, max(share_min, share)))
    granted = kv_cache_mib(engine, share, gpu_memory_mib, own, held_at_start_mib)
    return VllmMemory(engine=engine, share=share, weights_mib=weights, profile_mib=profile,
                      non_torch_mib=VLLM_NON_TORCH_MIB, kv_wanted_mib=kv_wanted, kv_granted_mib=granted,
                      held_at_start_mib=held_at_start_mib)


# ---- verl on one GPU ------------------------------------------------------------------------

@dataclass(frozen=True)
class VerlWorkload:
    """What a verl 0.5.0 PPO run puts on one GPU (FSDP, one colocated process)."""

    train_dtype: str = "bf16"          # FSDP mixed-precision param dtype (fp32 = no mixed precision)
    attn: str = "sdpa"
    grad_ckpt: bool = True
    micro_batch: int = 4               # ppo_micro_batch_size_per_gpu (also used for log-prob passes)
    seq_len: int = 512                 # prompt + response tokens of one sample
    rollout: str = "vllm"              # "vllm" | "hf"
    rollout_dtype: str = "bf16"
    rollout_batch: int = 64            # sequences per HF generate() call (prompts x rollout.n, patch 0005)
    prompt_len: int = 128
    response_len: int = 384
    vllm_gpu_memory_utilization: float = 0.4
    # what vLLM adds while it generates (VllmMemory.rollout_mib); None: the share x GPU memory
    vllm_rollout_mib: float | None = None
    gpu_memory_mib: int = 143771
    log_prob_micro_batch: int | None = None    # no-gradient passes; None: micro_batch
    critic_micro_batch: int | None = None      # None: micro_batch
    use_critic: bool = True
    use_ref: bool = False
    actor_param_offload: bool = False
    actor_optimizer_offload: bool = False
    ref_param_offload: bool = False
    critic_param_offload: bool = False
    critic_optimizer_offload: bool = False
    n_gpus: int = 1                    # FSDP shards params, grads and optimizer states over the box's GPUs
    # FSDP2 + CPUOffloadPolicy for the actor (verl 0.5.0 then offloads the ref the same way): no critic
    actor_offload_policy: bool = False
    # inferred: verl 0.5.0 puts vLLM to sleep (weights to host, KV cache freed) between
    # rollouts. False charges vLLM's share to every phase.
    vllm_sleep: bool = True
    # patches 0007-0008, with actor_offload_policy: the whole model gathered once (in its compute dtype) for
    # HF generation, for the actor's log-prob pass and each update mini-batch, for the ref's pass; the update's
    # gradients accumulated unsharded (fp32) through a mini-batch
    rollout_gather_once: bool = False
    actor_gather_once: bool = False
    ref_gather_once: bool = False
    accumulate_grads_unsharded: bool = False

    def __post_init__(self):
        _bytes(self.train_dtype)
        _bytes(self.rollout_dtype)
        if self.attn not in ATTNS:
            raise ValueError(f"attn must be one of {ATTNS}")
        if self.rollout not in ("vllm", "hf"):
            raise ValueError("rollout must be 'vllm' or 'hf'")
        if not 0.0 < self.vllm_gpu_memory_utilization <= 1.0:
            raise ValueError("vllm_gpu_memory_utilization must be in (0, 1]")
        for name in ("micro_batch", "seq_len", "rollout_batch", "prompt_len", "response_len",
                     "gpu_memory_mib", "n_gpus"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.actor_offload_policy and self.use_critic:
            raise ValueError("actor_offload_policy has no critic: verl 0.5.0 cannot FSDP2-wrap it")
        if self.gathers_once and not self.actor_offload_policy:
            raise ValueError("the gather-once knobs (patches 0007-0008) are planned only with actor_offload_policy")

    @property
    def gathers_once(self) -> bool:
        return self.rollout_gather_once or self.actor_gather_once or self.ref_gather_once \
            or self.accumulate_grads_unsharded


def _transient(est: Estimate) -> float:
    """A training step's memory beyond weights, grads and optimizer states (MiB)."""
    b = est.breakdown
    return est.peak_mib - b["weights"] - b["gradients"] - b["adamw_states"]


def verl_gpu_budget(shape: ModelShape, workload: VerlWorkload) -> Estimate:
    """Peak GPU memory of a verl 0.5.0 PPO iteration on one GPU.

    Resident: the FSDP states (fp32 params, AdamW states) of the actor and the critic and the
    ref model's params, except what is offloaded (verl 0.5.0 parks offloaded actor/critic states
    in host RAM between phases and loads them back for their own update, so an update phase still
    holds its own full states; gradients live only inside an update: verl zeroes them after the
    last optimizer step). Each phase adds its transient: rollout (what vLLM adds while awake, or
    HF generation's KV cache + logits + one half-precision copy of the actor's weights), the
    ref/actor log-prob and critic value passes (no gradients), the critic update, the actor
    update. The peak is the largest phase plus the process overhead.

    Micro-batches and the HF chunk count sequences (with rollout.n > 1, prompts x n). On n_gpus > 1
    FSDP keeps 1/n_gpus of every model's states per GPU and gathers one unit at a time while it
    computes: the embedding (the root unit) and two decoder layers (the next one prefetched) in
    the compute dtype (inferred: not measured on several GPUs; the transients stay unsharded).

    ``actor_offload_policy`` (FSDP2 + CPUOffloadPolicy): nothing of the actor or ref stays on the GPU
    between phases; each pass holds the units FSDP gathers (the same embedding + two layers), an
    update also their gradients (the root's, the tied embedding's, lives through the backward),
    and no full half-precision copy. Measured (GPU call 7, fp32, HF rollout): the actor's
    log-prob pass peaks after the root is released, the ref's (no entropy) while it is held.
    With patches 0007-0008's knobs a pass holds the whole model (compute dtype) instead of the
    units (``rollout_gather_once``, ``actor_gather_once`` for the actor's log-prob pass and update,
    ``ref_gather_once``), and ``accumulate_grads_unsharded`` adds every gradient in fp32 to the update.
    """
    wl = workload
    s = shape
    P_a, P_c = s.params("actor") / wl.n_gpus, s.params("critic") / wl.n_gpus
    seq = wl.seq_len
    lp_micro = wl.log_prob_micro_batch or wl.micro_batch
    c_micro = wl.critic_micro_batch or wl.micro_batch
    states_a = 16.0 * P_a / MIB          # fp32 params + fp32 grads + AdamW m, v
    params_a, grads_a, opt_a = 4.0 * P_a / MIB, 4.0 * P_a / MIB, 8.0 * P_a / MIB
    params_c, grads_c, opt_c = 4.0 * P_c / MIB, 4.0 * P_c / MIB, 8.0 * P_c / MIB
    # verl loads the ref in bf16 unless told otherwise; an fp32 plan loads it in fp32
    ref_bytes = 4 if wl.train_dtype == "fp32" else 2
    ref_params = (ref_bytes * P_a / MIB) if wl.use_ref else 0.0

    # what stays on the GPU outside a model's own update (grads exist only during updates)
    res_actor = (0.0 if wl.actor_param_offload else params_a) \
        + (0.0 if wl.actor_optimizer_offload else opt_a)
    res_critic = 0.0
    if wl.use_critic:
        res_critic = (0.0 if wl.critic_param_offload else params_c) \
            + (0.0 if wl.critic_optimizer_offload else opt_c)
    # verl 0.5.0 keeps an FSDP1 ref's params on the GPU whatever ref.fsdp_config.param_offload says
    # (GPU call 12: the 942 MiB bf16 ref was resident from init to the OOM with param_offload=True)
    res_ref = ref_params
    offp = wl.actor_offload_policy
    # FSDP2 CPU offload with checkpointing: a unit's weights and gradients move between CPU and GPU as
    # its backward runs, so the update holds the checkpointed inputs and the logits, nothing that
    # grows with the model (GPU call 8: 5202 and 2637 MiB at micro 8 and 4, 641 MiB a sequence + 73)
    # (fp32, as measured; bf16 keeps the larger estimate until it is measured)
    lean_update = offp and wl.grad_ckpt and wl.train_dtype == "fp32"
    if offp:
        res_actor = res_ref = 0.0

    if wl.train_dtype != "fp32" and not wl.grad_ckpt:
        path = _attention_path(s, wl.train_dtype, wl.attn)
        per_token = s.layers * _layer_saved_bytes_per_token(s, True, path) + VERL_ACTOR_LOGIT_BYTES_AUTOCAST * s.vocab
        actor_act = ((0.0 if offp else 2.0 * s.layers * s.layer_params) + wl.micro_batch * seq * per_token) / MIB
        if not offp:   # at small micro-batches the AdamW step's foreach temporary (one fp32 copy) is larger
            actor_act = max(actor_act, 4.0 * P_a / MIB)     # (GPU call 12: micro-batch 1 OOMed in update_actor)
    else:
        step = train_step_peak(s, "actor", wl.train_dtype, wl.attn, wl.grad_ckpt, wl.micro_batch, seq)
        actor_act = _transient(step)
        if lean_update:   # no AdamW temporary on the GPU to stand in for activations: the backward's start,
            # without the lm_head's gradient (it leaves for the CPU with its unit; measured, GPU call 8)
            actor_act = step.breakdown["phase_backward_start"] - step.breakdown["weights"] \
                - step.breakdown["adamw_states"] - STEP_MISC_MIB - 4.0 * s.embed_params / MIB
        # verl's policy loss adds log-softmax and entropy over the response logits in fp32 (inferred;
        # matches the fp32 measurements within 1%)
        actor_act += 2.0 * 4.0 * s.vocab * wl.micro_batch * wl.response_len / MIB
    critic_act = 0.0
    if wl.use_critic:
        critic_act = _transient(train_step_peak(s, "critic", wl.train_dtype, wl.attn,
                                                wl.grad_ckpt, c_micro, seq))
    half_copy_a = 2.0 * P_a / MIB * (1 if wl.train_dtype != "fp32" and not offp else 0)
    gathered = 0.0 if wl.n_gpus == 1 and not offp else _bytes(wl.train_dtype) * (s.embed_params + 2 * s.layer_params) / MIB
    # a no-grad forward for log-probs and entropy (measured, VERL_LOGPROB_BYTES)
    logprob_pass = VERL_LOGPROB_BYTES * s.vocab * lp_micro * seq / MIB + half_copy_a
    # offload: the ref's pass (no entropy) holds the root and its fp32 logits (measured); the actor's peaks in
    # the entropy, after the root is released (measured)
    ref_pass = gathered + 4.0 * s.vocab * lp_micro * seq / MIB if offp else None
    actor_pass_floor = ref_pass         # the actor's pass holds at least what the ref's does
    # patches 0007-0008: a pass gathered once holds the whole model in its compute dtype from start to end
    # (inferred: FSDP2 keeps every unit's unsharded parameters; to be measured on the GPU)
    whole = _bytes(wl.train_dtype) * s.params("actor") / MIB     # unsharded: the whole model on every GPU
    if wl.ref_gather_once:
        ref_pass = whole + 4.0 * s.vocab * lp_micro * seq / MIB
    # the critic's value pass: one layer's activations and the hidden states (inferred)
    values_pass = lp_micro * seq * (4.0 * s.hidden * 4 + 3.0 * 4 * s.ffn) / MIB \
        + (2.0 * P_c / MIB if wl.train_dtype != "fp32" else 0.0)

    if wl.rollout == "vllm":
        rollout = wl.vllm_rollout_mib if wl.vllm_rollout_mib is not None \
            else wl.vllm_gpu_memory_utilization * wl.gpu_memory_mib
    else:
        # autocast over fp32 weights (an fp32 plan generating in half precision) keeps the residual stream fp32
        gen = generate_peak(s, wl.rollout_batch, wl.prompt_len, wl.response_len, wl.rollout_dtype,
                            wl.attn, residual_dtype=wl.train_dtype if wl.train_dtype == "fp32" else None)
        # the actor's FSDP module generates: its params are already resident; generating in
        # half precision holds one half copy of every weight (FSDP's mixed-precision compute
        # copy, or autocast's casts over fp32 params: measured +1237 MiB on the T4 profile)
        rollout = gen.peak_mib - gen.breakdown["weights"] + (whole if wl.rollout_gather_once else gathered) \
            + (_bytes(wl.rollout_dtype) * s.params("actor") / MIB if wl.rollout_dtype != "fp32" else 0.0)
        if wl.actor_param_offload:
            rollout += params_a   # HF rollout needs the actor's params on the GPU
    always = rollout if (wl.rollout == "vllm" and not wl.vllm_sleep) else 0.0
    resident = res_actor + res_critic + res_ref + always
    overhead = CUDA_CONTEXT_MIB + VERL_PROCESS_OVERHEAD_MIB
    if wl.actor_gather_once:
        logprob_pass = whole + logprob_pass
    else:
        logprob_pass = max(logprob_pass, actor_pass_floor) if offp else logprob_pass + gathered
    grads_a = 4.0 * (s.embed_params + s.layer_params) / MIB if offp else grads_a   # offload: the units' in flight
    values_pass += gathered if wl.use_critic else 0.0
    if wl.actor_gather_once:
        actor_act += whole
    else:
        actor_act += 0.0 if lean_update else gathered
    if wl.accumulate_grads_unsharded:   # every gradient, unsharded, in fp32 until the mini-batch's last backward
        actor_act += 4.0 * s.params("actor") / MIB
    critic_act += gathered if wl.use_critic else 0.0

    phases = {
        "phase_rollout": resident - always + rollout,
        # an offloaded ref runs under FSDP's CPUOffload: one unit at a time on the GPU
        "phase_ref_logprob": resident + ((ref_pass if offp else logprob_pass) if wl.use_ref else 0.0),
        "phase_actor_logprob": resident + logprob_pass
        + (params_a if wl.actor_param_offload else 0.0),
        "phase_critic_values": (resident + values_pass + (params_c if wl.critic_param_offload else 0.0))
        if wl.use_critic else 0.0,
        "phase_critic_update": (resident + (params_c if wl.critic_param_offload else 0.0)
                                + ((1 + OFFLOADED_OPTIMIZER_EXTRA) * opt_c if wl.critic_optimizer_offload else 0.0)
                                + grads_c + critic_act + VERL_UPDATE_EXTRA_MIB["critic"]) if wl.use_critic else 0.0,
        "phase_actor_update": resident + (params_a if wl.actor_param_offload else 0.0)
        + ((1 + OFFLOADED_OPTIMIZER_EXTRA) * opt_a if wl.actor_optimizer_offload else 0.0) + actor_act
        + (0.0 if lean_update else grads_a + VERL_UPDATE_EXTRA_MIB["actor"]),
    }
    peak = max(phases.values()) + overhead
    host = 0.0
    if wl.actor_param_offload or offp:
        host += params_a + (4.0 * P_a / MIB if offp else 0.0)   # offload policy: the gradients too
    if wl.actor_optimizer_offload or offp:
        host += opt_a
    if wl.use_ref and offp:
        host += ref_params
    if wl.use_critic and wl.critic_param_offload:
        host += params_c
    if wl.use_critic and wl.critic_optimizer_offload:
        host += opt_c
    if wl.rollout == "vllm" and wl.vllm_sleep:
        host += _bytes(wl.rollout_dtype) * s.params("actor") / MIB   # vLLM's weights while asleep (inferred)
    bd = {
        "actor_states": states_a,
        "actor_activations": actor_act,
        "critic_states": (16.0 * P_c / MIB) if wl.use_critic else 0.0,
        "critic_activations": critic_act,
        "ref_states": ref_params,
        "rollout": rollout,
        "cuda_context": overhead,
        "resident": resident,
        **phases,
    }
    return Estimate(peak_mib=peak, breakdown=bd, host_ram_mib=host)


def held_at_vllm_start_mib(shape: ModelShape, workload: VerlWorkload) -> float:
    """What a verl 0.5.0 process holds when it starts vLLM: the critic's, the ref's and the actor's
    FSDP params (their shards) unless offloaded (optimizer states come with the first update;
    ray_trainer.init_workers builds the critic and the ref before the actor and its rollout) and
    the process overhead."""
    wl = workload
    held = 0.0 if wl.actor_param_offload or wl.actor_offload_policy else 4.0 * shape.params("actor") / MIB
    if wl.use_critic and not wl.critic_param_offload:
        held += 4.0 * shape.params("critic") / MIB
    if wl.use_ref and not wl.actor_offload_policy:
        held += (4 if wl.train_dtype == "fp32" else 2) * shape.params("actor") / MIB
    held /= wl.n_gpus
    # vLLM V1 counts what the real process holds at its start: the old card's unmeasured margin too
    return held + CUDA_CONTEXT_MIB + VERL_PROCESS_OVERHEAD_MIB + OLD_CARD_OUTSIDE_TORCH_MARGIN_MIB


# ---- CLI -------------------------------------------------------------------------------------

def _print_readable(est: Estimate, title: str) -> None:
    print(title)
    for k, v in est.breakdown.items():
        print(f"  {k:26} {v:12.1f} MiB")
    print(f"  {'peak (allocated)':26} {est.peak_mib:12.1f} MiB   (CUDA context not included)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tasks.memory", description="GPU memory estimate")
    ap.add_argument("--json", action="store_true", help="print JSON")
    ap.add_argument("--model-config", default=str(DEFAULT_CONFIG))
    ap.add_argument("--role", choices=ROLES + ("generate",), default="actor")
    ap.add_argument("--dtype", choices=DTYPES, default="bf16")
    ap.add_argument("--attn", choices=ATTNS, default="sdpa")
    ap.add_argument("--grad-ckpt", action="store_true")
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    args = ap.parse_args(argv)
    try:
        cfg = json.loads(Path(args.model_config).read_text())
        shape = ModelShape.from_config(cfg)
        if args.role == "generate":
            est = generate_peak(shape, args.batch, args.prompt_len, args.new_tokens, args.dtype,
                                args.attn)
            title = (f"generate {args.dtype} {args.attn} batch={args.batch} "
                     f"prompt={args.prompt_len} new={args.new_tokens}")
        else:
            est = train_step_peak(shape, args.role, args.dtype, args.attn, args.grad_ckpt,
                                  args.micro_batch, args.seq_len)
            title = (f"train {args.role} {args.dtype} {args.attn} grad_ckpt={args.grad_ckpt} "
                     f"micro_batch={args.micro_batch} seq_len={args.seq_len}")
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(est.as_json()))
    else:
        _print_readable(est, title)
    return 0


if __name__ == "__main__":
    sys.exit(main())
