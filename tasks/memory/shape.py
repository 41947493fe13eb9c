"""The units of the memory model: the model's shape read from its ``config.json`` (``ModelShape``), an
estimate (``Estimate``), and the constants every estimate shares (the CUDA context, what a verl
process holds outside PyTorch, verl's update and log-prob passes as measured on the H200)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

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
    def from_config(cls, cfg: dict) -> ModelShape:
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

