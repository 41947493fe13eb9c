"""verl 0.5.0's PPO iteration on one GPU (``verl_gpu_budget``): the resident states of the actor,
critic and ref, each phase's transient (rollout, log-prob and value passes, the updates), offloads
and the CPU-offload rung; and what the process holds when vLLM starts (``held_at_vllm_start_mib``)."""

from __future__ import annotations

from dataclasses import dataclass

from tasks.memory.generate import generate_peak
from tasks.memory.shape import (
    ATTNS,
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
from tasks.memory.train_step import _attention_path, _layer_saved_bytes_per_token, train_step_peak

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

    actor_act = _actor_update_mib(s, wl, P_a, offp, lean_update)
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
    ref_pass = gathered + 4.0 * s.vocab * lp_micro * seq / MIB     # read only where offloaded (offp)
    actor_pass_floor = ref_pass         # the actor's pass holds at least what the ref's does
    # patches 0007-0008: a pass gathered once holds the whole model in its compute dtype from start to end
    # (inferred: FSDP2 keeps every unit's unsharded parameters; to be measured on the GPU)
    whole = _bytes(wl.train_dtype) * s.params("actor") / MIB     # unsharded: the whole model on every GPU
    if wl.ref_gather_once:
        ref_pass = whole + 4.0 * s.vocab * lp_micro * seq / MIB
    # the critic's value pass: one layer's activations and the hidden states (inferred)
    values_pass = lp_micro * seq * (4.0 * s.hidden * 4 + 3.0 * 4 * s.ffn) / MIB \
        + (2.0 * P_c / MIB if wl.train_dtype != "fp32" else 0.0)

    rollout = _rollout_mib(s, wl, gathered, whole, params_a)
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
    host = _host_ram_mib(s, wl, params_a, opt_a, ref_params, params_c, opt_c, P_a)
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


def _actor_update_mib(s: ModelShape, wl: VerlWorkload, P_a: float, offp: bool, lean_update: bool) -> float:
    """The actor update's memory beyond its states (before the gathered units and knobs): the measured bf16 update
    without checkpointing, else train_step_peak's transient, plus verl's fp32 policy-loss terms."""
    seq = wl.seq_len
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
    return actor_act


def _rollout_mib(s: ModelShape, wl: VerlWorkload, gathered: float, whole: float, params_a: float) -> float:
    """What the rollout adds: vLLM's own memory while awake, or HF generation on the actor's own module."""
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
    return rollout


def _host_ram_mib(s: ModelShape, wl: VerlWorkload, params_a: float, opt_a: float, ref_params: float, params_c: float,
                  opt_c: float, P_a: float) -> float:
    """What waits in host RAM: the offloaded states (and vLLM's weights while it sleeps)."""
    offp = wl.actor_offload_policy
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
    return host


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

