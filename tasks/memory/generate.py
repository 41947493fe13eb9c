"""Generation's memory: HF ``model.generate`` (``generate_peak``) and vLLM 0.8.5's share of the training
GPU (``vllm_memory``, by verl_lab_box/vllm_share.py's arithmetic)."""

from __future__ import annotations

from dataclasses import dataclass

from tasks.memory.shape import ATTNS, CUDA_CONTEXT_MIB, MIB, WORKSPACE_MIB, Estimate, ModelShape, _bytes
from tasks.memory.train_step import _attention_path
from verl_lab_box.vllm_share import kv_cache_mib, smallest_share

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
    prefill_tmp: float = (3 * w * s.ffn + 4 * r * s.hidden) * Tp
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
    lora_mib: float = 0.0        # LoRA's stacked adapter buffers (enable_lora: tasks/memory/lora.py)

    @property
    def own_mib(self) -> float:
        """What vLLM counts as its own before the KV cache: weights, profiling activations, non-torch."""
        return self.weights_mib + self.profile_mib + self.non_torch_mib + self.lora_mib

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
                share_max: float = 0.9, tp: int = 1, lora_mib: float = 0.0) -> VllmMemory:
    """The smallest share (in 0.01 steps) whose KV cache holds ``seqs`` sequences of ``seq_len``
    under ``engine``'s accounting; capped at ``share_max`` (then the KV cache may fall short:
    ``kv_granted_mib < kv_wanted_mib`` says so). ``tp`` > 1: one engine spans ``tp`` GPUs and each
    holds 1/tp of the weights, of the heads' KV cache and of the layer activations (inferred: not
    measured), for ``tp`` times the sequences (verl gives the engine its GPUs' share of the batch)."""
    weights = _bytes(dtype) * shape.params("actor") / MIB / tp
    kv_wanted = VLLM_KV_MARGIN * shape.kv_bytes_per_token(dtype) * seqs * seq_len / MIB
    profile = vllm_profile_mib(shape, dtype, max_num_batched_tokens, seqs * tp, tp)
    own = weights + profile + VLLM_NON_TORCH_MIB + lora_mib
    share = smallest_share(engine, gpu_memory_mib, own, kv_wanted, held_at_start_mib)
    share = float(min(share_max, max(share_min, share)))
    granted = kv_cache_mib(engine, share, gpu_memory_mib, own, held_at_start_mib)
    return VllmMemory(engine=engine, share=share, weights_mib=weights, profile_mib=profile,
                      non_torch_mib=VLLM_NON_TORCH_MIB, kv_wanted_mib=kv_wanted, kv_granted_mib=granted,
                      held_at_start_mib=held_at_start_mib, lora_mib=lora_mib)

