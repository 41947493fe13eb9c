"""verl 0.5.0's PPO iteration with LoRA on the actor (``lora_gpu_budget``), and what patch 0013's merge for the HF
rollout holds (``lora_merge``).

What LoRA changes, read in verl 0.5.0 (``verl/workers/fsdp_workers.py``, ``verl/trainer/ppo/ray_trainer.py``)
and peft 0.16.0 (``peft/tuners/tuners_utils.py``):

* the actor's base weights are frozen: they are loaded in ``actor.fsdp_config.model_dtype`` (the plan sets the
  training dtype: bf16 on bf16 cards, fp32 below) and get no gradients and no AdamW states. The adapters
  (``get_peft_model``) are fp32 whatever the base's dtype (peft's ``autocast_adapter_dtype`` upcasts bf16/fp16
  adapter weights), so AdamW steps fp32 adapters: 4 B each for the weights, 4 for the gradients, 8 for AdamW;
* no reference model is built: with ``lora_rank > 0`` the trainer's ``ref_in_actor`` computes the reference
  log-probs with the actor's own ``compute_log_prob`` under ``disable_adapter()`` (entropy included);
* the forward and the backward through the base run as for full fine-tuning (the activations a backward needs
  are the same: the gradients flow back through every frozen layer to the adapters of the layers below), but
  the backward makes no weight gradient of the base, and a base already in the compute dtype needs no
  half-precision copy (FSDP's mixed precision casts only what differs from ``param_dtype``);
* the HF rollout merges the adapter into the base for generation (patch 0013: ``lora_merge``): one FSDP unit at a
  time on the GPU, each rank's own shard of the adapted decoder layers copied to host memory;
* vLLM keeps its own LoRA buffers (tasks/memory/vllm_lora.py, read in vLLM 0.8.5's source);
* the critic (PPO) is fully fine-tuned: verl 0.5.0's critic LoRA uses the causal-LM task type, which leaves the
  new value head frozen at its random initialisation, so the plan never gives the critic LoRA.

Measured on a GPU (GPU call 15, bench/gpu/results/ppo-20261205/call15: verl 0.5.0 on the H200 under each card's
cap, fp32 and bf16, HF rollout, one GPU, without checkpointing): every LoRA plan's peak within 10% of this model
(0.962-1.072), each phase within a tenth or over (tests/unit/test_gpu_measurements.py replays them). Measured
apart (issue 42, an H100, fp32, the 0.5B's shape, rank 32 on every linear layer, 512 tokens): the update's
activations with checkpointing, ~20% above the model before ``LORA_CKPT_ACTIVATION_SCALE``. Not measured: vLLM's
LoRA path (vLLM never ran on the device), several GPUs with LoRA, patch 0013's merge on a GPU. Those terms are
marked ``# GPU:``.
"""

from __future__ import annotations

from dataclasses import dataclass

from tasks.memory.generate import generate_peak
from tasks.memory.shape import (
    CUDA_CONTEXT_MIB,
    MIB,
    OFFLOADED_OPTIMIZER_EXTRA,
    OLD_CARD_OUTSIDE_TORCH_MARGIN_MIB,
    STEP_MISC_MIB,
    VERL_ACTOR_LOGIT_BYTES_AUTOCAST,
    VERL_LOGPROB_BYTES,
    VERL_PROCESS_OVERHEAD_MIB,
    VERL_UPDATE_EXTRA_MIB,
    Estimate,
    ModelShape,
    _bytes,
)
from tasks.memory.train_step import (
    LOGITS_BWD,
    LOGITS_FWD,
    QUAD_BWD_TRANSIENT,
    QUAD_FWD_TRANSIENT,
    QUAD_SAVED,
    SCORE_MASK_BYTES,
    _attention_path,
    _layer_bwd_transient_bytes_per_token,
    _layer_saved_bytes_per_token,
    _mode,
    train_step_peak,
)
from tasks.memory.verl_budget import VerlWorkload, _transient

# The linear layers of a Qwen2/Llama decoder layer; PEFT's "all-linear" takes every one of them (not the head).
LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# The update's activations with gradient checkpointing (lora_update_transient_mib's checkpointed moments and verl's
# fp32 log-softmax), times this. measured (issue 42: an H100, fp32, Qwen2.5-0.5B's shape, rank 32 on every linear
# layer, 512 tokens; the update's peak less the resident states, against the model before this factor), MiB:
# micro-batch 1 792 vs 665 (1.19), 4: 3145 vs 2590 (1.21), 8: 6288 vs 5157 (1.22); without checkpointing
# 2416 vs 2290 (1.05, left as it is: GPU call 15's LoRA updates without checkpointing were 0.87-1.01 of it).
# Taken for bf16 too (not measured there).
LORA_CKPT_ACTIVATION_SCALE = 1.22


@dataclass(frozen=True)
class LoraSpec:
    """The actor's LoRA: rank, the decoder's linear layers it adapts, the frozen base's dtype."""

    rank: int = 32
    targets: tuple[str, ...] = LORA_MODULES
    base_dtype: str = "bf16"

    def __post_init__(self):
        _bytes(self.base_dtype)
        if self.rank < 1:
            raise ValueError("LoRA rank must be >= 1")
        unknown = set(self.targets) - set(LORA_MODULES)
        if unknown or not self.targets:
            raise ValueError(f"LoRA targets must be some of {LORA_MODULES}, not {sorted(unknown) or 'none'}")


def module_dims(shape: ModelShape) -> dict[str, tuple[int, int]]:
    """(in, out) features of each linear layer of one decoder layer."""
    h, q, kv, f = shape.hidden, shape.q_dim, shape.kv_dim, shape.ffn
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, f), "up_proj": (h, f), "down_proj": (f, h)}


def adapter_params(shape: ModelShape, lora: LoraSpec) -> int:
    """PEFT's LoRA parameters: lora_A (rank x in) and lora_B (out x rank) for each targeted layer."""
    dims = module_dims(shape)
    return shape.layers * sum(lora.rank * (dims[m][0] + dims[m][1]) for m in lora.targets)


def adapted_base_params(shape: ModelShape, lora: LoraSpec) -> int:
    """The base weights the adapters adapt (in x out of every targeted linear layer): what patch 0013 merges into."""
    dims = module_dims(shape)
    return shape.layers * sum(dims[m][0] * dims[m][1] for m in lora.targets)


@dataclass(frozen=True)
class LoraMerge:
    """What patch 0013's merge for the HF rollout holds, per rank: host memory (its copies, kept for the run), GPU
    memory beside the resident states while it merges."""

    host_mib: float
    gpu_mib: float


def lora_merge(shape: ModelShape, lora: LoraSpec, n_gpus: int) -> LoraMerge:
    """Patch 0013 as issue 42 made it (files/patches/verl-0.5.0/0013-*.diff, ``_AdapterMerge``): the ranks take one
    decision together; each rank copies only its own shard of every FSDP1 unit that holds an adapted weight to host
    memory (verl's wrap policy makes each decoder layer a unit: the whole layer's flat parameter, its norms and biases
    too, in the base's dtype), so a box holds the decoder once whatever its GPU count, kept for the run; it merges
    one unit at a time: the decoder layer summoned alone with its nested lora_A and lora_B units (on one GPU, NO_SHARD,
    nothing is gathered), each weight's (B @ A) x alpha/r made in fp32, the weight added to it in fp32 and the sum
    rounded once into the weight; the restore copies the shard back, no gather. The most it holds on the GPU is the
    largest decoder layer with its adapters and one weight's fp32 delta, never the whole model."""
    b = _bytes(lora.base_dtype)
    dims = module_dims(shape)
    layer_adapters = sum(lora.rank * (dims[m][0] + dims[m][1]) for m in lora.targets)
    unit = b * shape.layer_params + 4.0 * layer_adapters if n_gpus > 1 else 0.0
    delta = 4.0 * max(dims[m][0] * dims[m][1] for m in lora.targets)
    # GPU: from 0013's code (its CPU test measures the allocator's peak); on one GPU the generate phase's peak was
    # within 1.2% of the plan's (GPU call 16, 0013's first version); several GPUs have not run it
    return LoraMerge(host_mib=b * shape.layers * shape.layer_params / n_gpus / MIB, gpu_mib=(unit + delta) / MIB)


def lora_update_transient_mib(shape: ModelShape, dtype: str, attn: str, grad_ckpt: bool, micro_batch: int,
                              seq_len: int, adapter: int, base_dtype: str) -> float:
    """The update's memory beyond the resident states with LoRA: train_step_peak's moments (tasks/memory/
    train_step.py) with the base's gradients, AdamW states, AdamW temporary and the lm_head's weight gradient
    gone (the adapters' instead), and no weight copies where the base is already in the compute dtype."""
    s = shape
    mode = _mode(dtype)
    autocast = mode == "autocast"
    path = _attention_path(s, dtype, attn)
    T = micro_batch * seq_len
    E = micro_batch * s.heads * seq_len * seq_len if path == "scores" else 0
    L = s.layers
    adam_temp = 4.0 * adapter                        # foreach AdamW's temporary over the adapters
    casts = autocast and base_dtype == "fp32"         # half-precision copies of an fp32 base
    layer_casts = 2.0 * L * s.layer_params if casts else 0.0
    head_cast = 2.0 * s.embed_params if casts else 0.0
    layer_saved = _layer_saved_bytes_per_token(s, autocast, path) * T + QUAD_SAVED[mode] * E
    head_saved = (4 + 4 + (2 if autocast else 4)) * s.hidden * T
    mask = SCORE_MASK_BYTES * micro_batch * seq_len * seq_len if path == "scores" else 0.0
    bwd_tmp = _layer_bwd_transient_bytes_per_token(s, autocast) * T + QUAD_BWD_TRANSIENT[mode] * E
    fwd_score_tmp = QUAD_FWD_TRANSIENT[mode] * E
    logits_fwd = LOGITS_FWD[mode] * s.vocab * T
    logits_bwd = LOGITS_BWD[mode] * s.vocab * T        # no lm_head weight gradient: the head is frozen
    if not grad_ckpt:
        saved = layer_casts + head_cast + L * layer_saved + head_saved
        fwd = max(saved + logits_fwd, saved - head_saved + fwd_score_tmp + mask)
        bwd = saved + max(logits_bwd, bwd_tmp)
    else:
        ckpt_in = 4.0 * s.hidden * T
        activations = L * ckpt_in + head_saved + mask
        one_layer = layer_saved + (2.0 * s.layer_params if casts else 0.0)
        fwd = activations + head_cast + layer_casts + max(logits_fwd, one_layer + fwd_score_tmp)
        bwd = max(activations + head_cast + logits_bwd, activations + one_layer + bwd_tmp)
    # the adapters' gradients are counted by the caller (through the whole update, as verl accumulates them)
    return (max(fwd, bwd, adam_temp) + STEP_MISC_MIB * MIB) / MIB


def lora_gpu_budget(shape: ModelShape, workload: VerlWorkload, lora: LoraSpec) -> Estimate:
    """Peak GPU memory of a verl 0.5.0 PPO/GRPO iteration whose actor trains LoRA adapters (module docstring),
    phase by phase as ``verl_gpu_budget``: resident the frozen base (unless ``actor_param_offload`` parks it
    in host RAM: vLLM only), the adapters and their AdamW states, the fully trained critic's states; each
    phase adds its transient. ``workload.use_ref`` runs the reference pass through the actor itself."""
    wl, s = workload, shape
    if wl.actor_offload_policy or wl.gathers_once:
        raise ValueError("LoRA is planned without the CPU-offload rung's FSDP2 offload policy and its knobs")
    n = wl.n_gpus
    P_a, P_c = s.params("actor"), s.params("critic") / n
    A = adapter_params(s, lora)
    base = _bytes(lora.base_dtype) * P_a / n / MIB
    ad_params, ad_grads, ad_opt = 4.0 * A / n / MIB, 4.0 * A / n / MIB, 8.0 * A / n / MIB
    params_c, grads_c, opt_c = 4.0 * P_c / MIB, 4.0 * P_c / MIB, 8.0 * P_c / MIB
    seq = wl.seq_len
    lp_micro = wl.log_prob_micro_batch or wl.micro_batch
    c_micro = wl.critic_micro_batch or wl.micro_batch

    res_actor = (0.0 if wl.actor_param_offload else base) + ad_params + ad_opt
    res_critic = 0.0
    if wl.use_critic:
        res_critic = (0.0 if wl.critic_param_offload else params_c) + (0.0 if wl.critic_optimizer_offload else opt_c)
    gathered = 0.0 if n == 1 else _bytes(wl.train_dtype) * (s.embed_params + 2 * s.layer_params) / MIB
    # a half-precision compute copy only where the base is fp32 and the compute is not (never planned)
    half_copy = 2.0 * P_a / n / MIB if lora.base_dtype == "fp32" and wl.train_dtype != "fp32" else 0.0

    if wl.train_dtype != "fp32" and not wl.grad_ckpt:
        # the full plans' measured bf16 update (verl_budget.py), without the weight copies (a bf16 base needs none)
        path = _attention_path(s, wl.train_dtype, wl.attn)
        per_token = s.layers * _layer_saved_bytes_per_token(s, True, path) + VERL_ACTOR_LOGIT_BYTES_AUTOCAST * s.vocab
        actor_act = max(wl.micro_batch * seq * per_token / MIB, 4.0 * A / MIB) + half_copy
    else:
        actor_act = lora_update_transient_mib(s, wl.train_dtype, wl.attn, wl.grad_ckpt, wl.micro_batch, seq, A,
                                              lora.base_dtype)
        actor_act += 2.0 * 4.0 * s.vocab * wl.micro_batch * wl.response_len / MIB   # log-softmax, entropy (fp32)
        actor_act = actor_act * (LORA_CKPT_ACTIVATION_SCALE if wl.grad_ckpt else 1.0) + half_copy
    actor_act += gathered
    critic_act = 0.0
    if wl.use_critic:
        critic_act = _transient(train_step_peak(s, "critic", wl.train_dtype, wl.attn, wl.grad_ckpt, c_micro, seq)) \
            + gathered
    # the actor's log-prob pass, and the ref's: the same module under disable_adapter(), entropy included
    logprob_pass = VERL_LOGPROB_BYTES * s.vocab * lp_micro * seq / MIB + half_copy + gathered
    values_pass = lp_micro * seq * (4.0 * s.hidden * 4 + 3.0 * 4 * s.ffn) / MIB \
        + (2.0 * P_c / MIB if wl.train_dtype != "fp32" else 0.0) + gathered

    # the HF rollout merges the adapter for generation (patch 0013), before and after generating: one unit at a time
    merge = lora_merge(s, lora, n) if wl.rollout == "hf" else LoraMerge(host_mib=0.0, gpu_mib=0.0)
    if wl.rollout == "vllm":
        rollout = wl.vllm_rollout_mib if wl.vllm_rollout_mib is not None \
            else wl.vllm_gpu_memory_utilization * wl.gpu_memory_mib
        if wl.actor_param_offload:
            # the sharding manager loads the base back to collect the adapter while vLLM's weights wake up
            rollout = max(rollout, base + _bytes(wl.rollout_dtype) * P_a / n / MIB)
    else:
        gen = generate_peak(s, wl.rollout_batch, wl.prompt_len, wl.response_len, wl.rollout_dtype, wl.attn,
                            residual_dtype=wl.train_dtype if wl.train_dtype == "fp32" else None)
        # the actor's own module generates: its base is resident; a half-precision rollout over an fp32 base
        # holds autocast's copy of every weight (as the full plans, measured on the T4 profile)
        rollout = gen.peak_mib - gen.breakdown["weights"] + gathered \
            + (_bytes(wl.rollout_dtype) * P_a / MIB if wl.rollout_dtype != lora.base_dtype else 0.0)
        rollout = max(rollout, merge.gpu_mib)
    always = rollout if (wl.rollout == "vllm" and not wl.vllm_sleep) else 0.0
    resident = res_actor + res_critic + always
    base_back = base if wl.actor_param_offload else 0.0      # an offloaded base is loaded for each pass
    phases = {
        "phase_rollout": resident - always + rollout,
        "phase_ref_logprob": resident + base_back + logprob_pass if wl.use_ref else 0.0,
        "phase_actor_logprob": resident + base_back + logprob_pass,
        "phase_critic_values": (resident + values_pass + (params_c if wl.critic_param_offload else 0.0))
        if wl.use_critic else 0.0,
        "phase_critic_update": (resident + (params_c if wl.critic_param_offload else 0.0)
                                + ((1 + OFFLOADED_OPTIMIZER_EXTRA) * opt_c if wl.critic_optimizer_offload else 0.0)
                                + grads_c + critic_act + VERL_UPDATE_EXTRA_MIB["critic"]) if wl.use_critic else 0.0,
        # GPU: verl's update extra (170 MiB measured for full fine-tuning) taken as is
        "phase_actor_update": resident + base_back + ad_grads + actor_act + VERL_UPDATE_EXTRA_MIB["actor"],
    }
    overhead = CUDA_CONTEXT_MIB + VERL_PROCESS_OVERHEAD_MIB
    host = (base if wl.actor_param_offload else 0.0) \
        + (params_c if wl.use_critic and wl.critic_param_offload else 0.0) \
        + (opt_c if wl.use_critic and wl.critic_optimizer_offload else 0.0) \
        + (_bytes(wl.rollout_dtype) * P_a / MIB if wl.rollout == "vllm" and wl.vllm_sleep else 0.0) \
        + merge.host_mib
    bd = {
        "actor_states": base + ad_params + ad_grads + ad_opt,
        "lora_frozen_base": base,
        "lora_adapter_states": ad_params + ad_grads + ad_opt,
        "lora_adapter_params": float(A),
        "actor_activations": actor_act,
        "critic_states": (16.0 * P_c / MIB) if wl.use_critic else 0.0,
        "critic_activations": critic_act,
        "ref_states": 0.0,
        "rollout": rollout,
        "lora_merge_gpu": merge.gpu_mib,
        "lora_merge_host": merge.host_mib,
        "cuda_context": overhead,
        "resident": resident,
        **phases,
    }
    return Estimate(peak_mib=max(phases.values()) + overhead, breakdown=bd, host_ram_mib=host)


def lora_held_at_vllm_start_mib(shape: ModelShape, workload: VerlWorkload, lora: LoraSpec) -> float:
    """What the process holds when vLLM starts with LoRA: the critic's params (unless offloaded), the actor's
    frozen base (unless offloaded) and adapters, no ref; the process overhead and the old card's margin."""
    wl = workload
    held = (0.0 if wl.actor_param_offload else _bytes(lora.base_dtype) * shape.params("actor")) \
        + 4.0 * adapter_params(shape, lora)
    if wl.use_critic and not wl.critic_param_offload:
        held += 4.0 * shape.params("critic")
    return held / wl.n_gpus / MIB + CUDA_CONTEXT_MIB + VERL_PROCESS_OVERHEAD_MIB + OLD_CARD_OUTSIDE_TORCH_MARGIN_MIB
