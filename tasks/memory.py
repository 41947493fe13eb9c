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

MIB = 1024.0 * 1024.0
DTYPES = ("fp32", "bf16", "fp16")
ATTNS = ("sdpa", "eager")
ROLES = ("actor", "critic")
DEFAULT_CONFIG = Path("files/models/qwen2.5-0.5b-instruct/config.json")

# ---- constants -----------------------------------------------------------------------------
# CUDA context + cuBLAS/cuDNN handles of one process on the H200 (torch 2.11, CUDA 13):
# not part of max_memory_allocated. measured (NVML process memory minus torch reserved).
CUDA_CONTEXT_MIB = 520.0
# Allocations torch makes on the first matmul/attention call (cuBLAS workspaces) that stay
# allocated: counted in max_memory_allocated. measured.
WORKSPACE_MIB = 40.0
# For the verl budget: the CUDA context of a process that also runs NCCL, vLLM's allocator and
# Ray: inferred (not measured), a margin above the plain torch context.
VERL_PROCESS_OVERHEAD_MIB = 1024.0


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

def _layer_saved_bytes_per_token(s: ModelShape, autocast: bool, attn: str) -> float:
    """Bytes one decoder layer keeps for backward, per token (no checkpointing).

    The residual stream stays fp32 under autocast (the embedding is not autocast and
    RMSNorm computes in fp32), so each layer keeps two fp32 residual tensors and two fp32
    RMSNorm outputs. Under autocast every Linear casts its input afresh (autocast caches
    casts of leaf weights only), so q/k/v keep three bf16 copies and gate/up two.
    """
    h, q, kv, f, nh = s.hidden, s.q_dim, s.kv_dim, s.ffn, s.heads
    if autocast:
        a = 2
        norms = 2 * 4 * h + 2 * 4 * h            # residual inputs + normalised (fp32)
        proj_in = 3 * a * h + 2 * a * h + a * q   # q/k/v, gate/up inputs; o_proj input
        mlp = 4 * a * f                           # gate out, silu out, up out, product
        if attn == "sdpa":
            att = a * q + 2 * a * kv + a * q + 4 * nh   # q, k, v, out (flash), logsumexp
        else:
            att = 3 * a * q                       # q, repeated k and v (bf16 copies)
    else:
        a = 4
        norms = 2 * 4 * h + 2 * 4 * h
        proj_in = a * h + a * h + a * q           # one fp32 input shared by q/k/v, gate/up
        mlp = 4 * a * f
        if attn == "sdpa":
            att = a * q + 2 * a * kv + a * q + 4 * nh
        else:
            att = 3 * a * q
    return norms + proj_in + mlp + att


# Bytes per attention-score element (batch x heads x seq x seq) per layer.
# eager under autocast: fp32 softmax output (4) + its bf16 copy (2) are saved; the moment of
# the softmax also holds the fp32 masked scores (4). fp32 eager: the fp32 probabilities (4)
# saved, masked scores (4) + softmax output transient.
QUAD_SAVED = {("autocast", "eager"): 6.0, ("fp32", "eager"): 4.0,
              ("autocast", "sdpa"): 0.0, ("fp32", "sdpa"): 0.0}
QUAD_FWD_TRANSIENT = {("autocast", "eager"): 8.0, ("fp32", "eager"): 8.0,
                      ("autocast", "sdpa"): 0.0, ("fp32", "sdpa"): 0.0}
# backward of one layer's attention scores: grad of probs, its fp32 cast, softmax grad.
QUAD_BWD_TRANSIENT = {("autocast", "eager"): 10.0, ("fp32", "eager"): 8.0,
                      ("autocast", "sdpa"): 0.0, ("fp32", "sdpa"): 0.0}
# the eager causal mask, [batch, 1, seq, seq] in the embedding dtype (fp32), live during forward
EAGER_MASK_BYTES = 4.0

# Logits, bytes per token per vocab entry. Forward: under autocast the bf16 logits (2) and
# their fp32 copy for the loss (4) are alive together; fp32: the logits themselves (4).
# Backward start: the fp32 gradient of the loss (4) and its bf16 cast (2) / fp32 (4).
LOGITS_FWD = {"autocast": 6.0, "fp32": 4.0}
LOGITS_BWD = {"autocast": 6.0, "fp32": 4.0}


def _layer_transient_bytes_per_token(s: ModelShape, autocast: bool, backward: bool) -> float:
    """Largest short-lived tensors inside one layer (not kept for backward), per token."""
    a = 2 if autocast else 4
    h, f = s.hidden, s.ffn
    if not backward:
        # the fp32 RMSNorm output feeding the casts, the fp32 rotary q/k before their cast
        return 4 * h + 4 * s.q_dim
    # backward through the MLP: grads of gate/up/silu outputs alive together + fp32 residual grad
    return 3 * a * f + 3 * 4 * h


def _mode(dtype: str) -> str:
    _bytes(dtype)
    return "fp32" if dtype == "fp32" else "autocast"


def train_step_peak(shape: ModelShape, role: str = "actor", dtype: str = "bf16",
                    attn: str = "sdpa", grad_ckpt: bool = False, micro_batch: int = 1,
                    seq_len: int = 512) -> Estimate:
    """Peak allocated memory of one single-process training step (see module docstring)."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    if attn not in ATTNS:
        raise ValueError(f"attn must be one of {ATTNS}, got {attn!r}")
    if micro_batch < 1 or seq_len < 1:
        raise ValueError("micro_batch and seq_len must be >= 1")
    mode = _mode(dtype)
    autocast = mode == "autocast"
    s = shape
    P = s.params(role)
    T = micro_batch * seq_len
    E = micro_batch * s.heads * seq_len * seq_len      # attention-score elements per layer
    L = s.layers

    weights = 4.0 * P
    grads = 4.0 * P
    adam = 8.0 * P
    adam_temp = 4.0 * P        # foreach AdamW: sqrt(exp_avg_sq) for all params at once
    # bf16 copies of the weights made by autocast, kept by autograd until backward passes
    # each layer (the embedding lookup is not autocast; a tied lm_head is cast).
    cast_params = L * s.layer_params + (s.hidden + 1 if role == "critic" else s.embed_params)
    casts = 2.0 * cast_params if autocast else 0.0

    layer_saved = _layer_saved_bytes_per_token(s, autocast, attn) * T + QUAD_SAVED[(mode, attn)] * E
    # after the last layer: final norm input/output (fp32) and the head's input
    head_saved = (4 * s.hidden + 4 * s.hidden + (2 if autocast else 4) * s.hidden) * T
    if role == "critic":
        head_saved += (1 + 4) * s.hidden * T   # dropout mask + dropout output (p=0.1)
    ckpt_saved = 4.0 * s.hidden * T            # a checkpointed layer keeps its fp32 input

    if role == "actor":
        logits_fwd = LOGITS_FWD[mode] * s.vocab * T
        logits_bwd = LOGITS_BWD[mode] * s.vocab * T
        head_grad = (4.0 + (2.0 if autocast else 0.0)) * s.embed_params  # lm_head weight grad
    else:
        logits_fwd = logits_bwd = 12.0 * T
        head_grad = 0.0
    fwd_layer_tmp = _layer_transient_bytes_per_token(s, autocast, False) * T \
        + QUAD_FWD_TRANSIENT[(mode, attn)] * E
    bwd_layer_tmp = _layer_transient_bytes_per_token(s, autocast, True) * T \
        + QUAD_BWD_TRANSIENT[(mode, attn)] * E
    eager_mask = EAGER_MASK_BYTES * micro_batch * seq_len * seq_len if attn == "eager" else 0.0
    workspace = WORKSPACE_MIB * MIB
    resident = weights + adam + workspace      # steps >= 2 (AdamW states exist)

    if not grad_ckpt:
        activations = L * layer_saved + head_saved
        fwd = resident + casts + activations + max(logits_fwd, fwd_layer_tmp) + eager_mask
        bwd = resident + casts + activations + logits_bwd + head_grad
        # late in backward: nearly all grads, one layer's activations + its backward temporaries
        bwd_late = resident + grads + layer_saved + bwd_layer_tmp
        bwd = max(bwd, bwd_late)
    else:
        activations = L * ckpt_saved + head_saved
        one_layer = layer_saved + 2.0 * s.layer_params * (1 if autocast else 0)
        # forward: autocast's weight-cast cache lives until autocast exits
        fwd = resident + casts + activations + max(logits_fwd, layer_saved + fwd_layer_tmp) \
            + eager_mask
        bwd_start = resident + activations + logits_bwd + head_grad \
            + (2.0 * s.embed_params if autocast and role == "actor" else 0.0)
        bwd_first_layer = resident + activations + head_grad + one_layer + bwd_layer_tmp + eager_mask
        bwd_last_layer = resident + grads + ckpt_saved + one_layer + bwd_layer_tmp + eager_mask
        bwd = max(bwd_start, bwd_first_layer, bwd_last_layer)
    opt = weights + grads + adam + adam_temp + workspace
    peak = max(fwd, bwd, opt)
    bd = {
        "weights": weights / MIB,
        "gradients": grads / MIB,
        "adamw_states": adam / MIB,
        "adamw_step_temp": adam_temp / MIB,
        "autocast_weight_copies": casts / MIB,
        "activations_saved": activations / MIB,
        "logits_transient": max(logits_fwd, logits_bwd) / MIB,
        "eager_mask": eager_mask / MIB,
        "workspace": workspace / MIB,
        "phase_forward": fwd / MIB,
        "phase_backward": bwd / MIB,
        "phase_optimizer": opt / MIB,
        "cuda_context": CUDA_CONTEXT_MIB,
    }
    return Estimate(peak_mib=peak / MIB, breakdown=bd)


# ---- generation -------------------------------------------------------------------------------

def generate_peak(shape: ModelShape, batch: int = 1, prompt_len: int = 128, new_tokens: int = 128,
                  dtype: str = "bf16", attn: str = "sdpa") -> Estimate:
    """Peak allocated memory of HF ``model.generate`` (greedy), weights included."""
    if batch < 1 or prompt_len < 1 or new_tokens < 1:
        raise ValueError("batch, prompt_len and new_tokens must be >= 1")
    if attn not in ATTNS:
        raise ValueError(f"attn must be one of {ATTNS}, got {attn!r}")
    s = shape
    w = _bytes(dtype)
    weights = float(w * s.params("actor"))
    kv_tok = s.kv_bytes_per_token(dtype)
    total_len = prompt_len + new_tokens
    kv_final = batch * (total_len - 1) * kv_tok          # the last token is never fed back
    kv_prompt = batch * prompt_len * kv_tok
    Tp = batch * prompt_len
    # prefill, per token: MLP silu(gate), up, product alive together; residual and norm output
    prefill_tmp = (3 * w * s.ffn + 3 * w * s.hidden) * Tp
    if attn == "eager":
        E = batch * s.heads * prompt_len * prompt_len
        prefill_tmp = max(prefill_tmp, (4 + 2 * w) * E + w * batch * prompt_len * prompt_len
                          + 2 * w * s.q_dim * Tp)
    # next-token logits: [batch, vocab] in w, an fp32 copy, and a processed copy
    logits = batch * s.vocab * (w + 4 + 4)
    # torch.cat growing one layer's K (or V): old and new alive together
    cat_tmp = batch * total_len * s.kv_dim * w
    decode_tmp = cat_tmp
    if attn == "eager":
        decode_tmp += 2 * batch * s.q_dim * total_len * w + batch * s.heads * total_len * (4 + 2 * w)
    workspace = WORKSPACE_MIB * MIB
    prefill = weights + kv_prompt + prefill_tmp + logits + workspace
    decode = weights + kv_final + decode_tmp + logits + workspace
    peak = max(prefill, decode)
    bd = {
        "weights": weights / MIB,
        "kv_cache": kv_final / MIB,
        "prefill_transient": prefill_tmp / MIB,
        "logits": logits / MIB,
        "workspace": workspace / MIB,
        "phase_prefill": prefill / MIB,
        "phase_decode": decode / MIB,
        "cuda_context": CUDA_CONTEXT_MIB,
    }
    return Estimate(peak_mib=peak / MIB, breakdown=bd)


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
    rollout_batch: int = 64            # sequences generated at once
    prompt_len: int = 128
    response_len: int = 384
    vllm_gpu_memory_utilization: float = 0.4
    gpu_memory_mib: int = 143771
    use_critic: bool = True
    use_ref: bool = False
    actor_param_offload: bool = False
    actor_optimizer_offload: bool = False
    ref_param_offload: bool = False
    critic_param_offload: bool = False
    critic_optimizer_offload: bool = False
    # inferred: verl 0.5.0 puts vLLM to sleep (weights to host, KV cache freed) between
    # rollouts. False charges vLLM's share to every phase.
    vllm_sleep: bool = True

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
                     "gpu_memory_mib"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")


def _transient(est: Estimate) -> float:
    """A training step's memory beyond weights, grads and optimizer states (MiB)."""
    b = est.breakdown
    return est.peak_mib - b["weights"] - b["gradients"] - b["adamw_states"]


def verl_gpu_budget(shape: ModelShape, workload: VerlWorkload) -> Estimate:
    """Peak GPU memory of a verl 0.5.0 PPO iteration on one GPU (inferred model).

    Resident: the FSDP states (fp32 params, fp32 grads, AdamW states) of the actor and the
    critic and the ref model's params, except what is offloaded (verl 0.5.0 parks offloaded
    actor/critic states in host RAM between phases and loads them back for their own update,
    so an update phase still holds its own full states). Each phase adds its transient:
    rollout (vLLM's share of the GPU, or HF generation's KV cache + logits + one bf16 copy of
    the actor's weights), ref/actor log-prob passes, critic update, actor update. The peak is
    the largest phase plus the process overhead.
    """
    wl = workload
    s = shape
    P_a, P_c = s.params("actor"), s.params("critic")
    seq = wl.seq_len
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
    res_ref = 0.0 if wl.ref_param_offload else ref_params

    actor_step = train_step_peak(s, "actor", wl.train_dtype, wl.attn, wl.grad_ckpt,
                                 wl.micro_batch, seq)
    actor_act = _transient(actor_step)
    # verl's policy loss adds log-softmax and entropy over the response logits in fp32 (inferred)
    actor_act += 2.0 * 4.0 * s.vocab * wl.micro_batch * wl.response_len / MIB
    critic_act = 0.0
    if wl.use_critic:
        critic_act = _transient(train_step_peak(s, "critic", wl.train_dtype, wl.attn,
                                                wl.grad_ckpt, wl.micro_batch, seq))
    # a no-grad forward for log-probs: logits in bf16 + fp32 log-softmax (inferred)
    logprob_pass = (6.0 + 4.0) * s.vocab * wl.micro_batch * seq / MIB \
        + 2.0 * P_a / MIB * (1 if wl.train_dtype != "fp32" else 0)

    if wl.rollout == "vllm":
        rollout = wl.vllm_gpu_memory_utilization * wl.gpu_memory_mib
    else:
        gen = generate_peak(s, wl.rollout_batch, wl.prompt_len, wl.response_len, wl.rollout_dtype,
                            wl.attn)
        # the actor's FSDP module generates: its params are already resident; the bf16
        # compute copy (FSDP mixed precision) is the generation "weights"
        rollout = gen.peak_mib - gen.breakdown["weights"] \
            + (_bytes(wl.rollout_dtype) * P_a / MIB if wl.train_dtype != "fp32" else 0.0)
        if wl.actor_param_offload:
            rollout += params_a   # HF rollout needs the actor's params on the GPU
    always = rollout if (wl.rollout == "vllm" and not wl.vllm_sleep) else 0.0
    resident = res_actor + res_critic + res_ref + always
    overhead = CUDA_CONTEXT_MIB + VERL_PROCESS_OVERHEAD_MIB

    phases = {
        "phase_rollout": resident - always + rollout,
        "phase_ref_logprob": resident + (logprob_pass if wl.use_ref else 0.0)
        + (ref_params if wl.ref_param_offload else 0.0) * 0.0,
        "phase_actor_logprob": resident + logprob_pass
        + (params_a if wl.actor_param_offload else 0.0),
        "phase_critic_update": (resident + (params_c if wl.critic_param_offload else 0.0)
                                + (opt_c if wl.critic_optimizer_offload else 0.0)
                                + grads_c + critic_act) if wl.use_critic else 0.0,
        "phase_actor_update": resident + (params_a if wl.actor_param_offload else 0.0)
        + (opt_a if wl.actor_optimizer_offload else 0.0) + grads_a + actor_act,
    }
    peak = max(phases.values()) + overhead
    host = 0.0
    if wl.actor_param_offload:
        host += params_a
    if wl.actor_optimizer_offload:
        host += opt_a
    if wl.use_ref and wl.ref_param_offload:
        host += ref_params
    if wl.use_critic and wl.critic_param_offload:
        host += params_c
    if wl.use_critic and wl.critic_optimizer_offload:
        host += opt_c
    if wl.rollout == "vllm" and wl.vllm_sleep:
        host += _bytes(wl.rollout_dtype) * P_a / MIB   # vLLM's weights while asleep (inferred)
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
