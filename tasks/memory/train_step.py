"""One single-process training step's peak (``train_step_peak``): weights, gradients, AdamW states,
the activations a backward needs with and without gradient checkpointing, the logits."""

from __future__ import annotations

from tasks.memory.shape import (
    ATTNS,
    CUDA_CONTEXT_MIB,
    MIB,
    ROLES,
    STEP_MISC_MIB,
    WORKSPACE_MIB,
    Estimate,
    ModelShape,
    _bytes,
)

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

