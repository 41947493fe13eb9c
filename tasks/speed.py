"""How long a training step takes: on the CPU-offload rung (``offload_step_seconds``: the actor and the ref
on FSDP2 with CPUOffloadPolicy), to rank the configurations that fit (tasks/plan/memory_fit.py takes the
fastest), and with everything on the GPU (``gpu_step_seconds``: the PPO/GRPO and LoRA rungs, for the plan's
reason ``finetune``: tasks/plan/lora.py).

Pure Python, plain values. What it rests on (docs/plan.md, "Speed on the CPU-offload rung"):

* on that rung a step's time is mostly copies between host and GPU and work on the host, not GPU
  compute: every FSDP2 gather copies a unit's fp32 parameters from host memory (verl 0.5.0 gathers every
  unit again for every forward, and again for every backward: one forward per generated token in HF
  generation, one per micro-batch in the log-prob passes and the update); every gradient reduction
  copies the unit's gradients to the host and, after a mini-batch's first micro-batch, adds them to
  the host's sum there; every optimizer step runs AdamW on the host;
* patches 0007-0008 (the knobs ``gather_once`` and ``accumulate_grads_unsharded``) change how many of
  those a step makes, not their cost: a gathered pass copies the model once, an unsharded accumulation
  reduces once per mini-batch; patch 0009 (``optim.fused``) changes the AdamW step's cost;
* GPU compute is counted as FLOPs (2 per parameter per token forward, twice that backward, one more
  forward with gradient checkpointing) at one throughput: it only separates configurations that
  differ in recomputation;
* with the models on the GPU (``gpu_step_seconds``) an update micro-batch also costs a fixed time per decoder
  layer whatever its size (``MICRO_LAYER_S``: kernel launches, the modules' Python, FSDP's hooks), which is why
  small micro-batches are slow there: bound by launches and Python, not FLOPs. The offload rung's update is
  bound by its copies instead, and its model has no such term (its constants were measured with it in them).

The constants are seconds on the device's H200 and H100 (PCIe to their host, 16 CPUs, torch 2.11; the same GH100
compute): a real card's box differs in all of them, so the seconds are a ranking, not a forecast. Where each was
measured (or, until the speed runs measure it, inferred) is written beside it. What that means on a real card: an
older card's FLOPs are slower (a GTX 1080's fp32 peak is 8.9 TFLOPS, a P40's 11.8, against the 33 measured here)
while launches and Python cost about the same host time, so there the FLOPs weigh 3-5x more against the
per-micro-batch cost, and checkpointing (one more forward) buys a larger micro-batch at a higher price. By this
model at the GTX 1080's peak rate the 0.5B's LoRA update costs, ms a sequence: micro-batch 2 194, 8 with
checkpointing 191 (a tie; 66 against 111 at the H100's rate); at a sustained 6.6 TFLOPS micro-batch 2 wins (234
against 250). The plan ranks by the balance that was measured, the H100's.
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 1024.0 ** 3

# One gather of fp32 parameters from pinned host memory to the GPU, FSDP2's copy-out included, seconds
# per GiB. measured, GPU call 13 (RTX 2080 Ti plan, the model gathered once per pass against once per
# forward): the ref's log-prob pass saved 1.84 s for 31 gathers of the 1.84 GiB model (0.032 s/GiB; its
# profile: 1.44 s of host-to-device copies in 32), generation 8.6 s for 255 (0.018 s/GiB)
GATHER_S_PER_GIB = 0.025
# One reduction of gradients to the host: the device-to-host copy, seconds per GiB; and the host-side sum
# when a mini-batch's earlier micro-batches left gradients there (the copy is then blocking, into pageable
# memory, and torch adds on the host). inferred from the same runs: the update took 68 s for 32
# micro-batches and 4 AdamW steps, about 40 s of it not gathers, compute or AdamW.
REDUCE_S_PER_GIB = 0.06
HOST_SUM_S_PER_GIB = 0.6
# One AdamW step on the host, seconds per 10^9 parameters: verl builds torch.optim.AdamW with its defaults,
# the per-tensor loop for parameters torch's foreach path does not take (CPU DTensors); inferred from calls
# 9-10: ~4 s a step for the 0.5B (measured on this project's CPU machine, one thread: 12.3 s per 10^9);
# torch's fused AdamW (patch 0009) took 0.77 s per 10^9 on the same machine and thread, 16x less.
ADAM_S_PER_GPARAM = 8.0
FUSED_ADAM_S_PER_GPARAM = ADAM_S_PER_GPARAM * 0.77 / 12.3
# GPU compute, seconds per 10^12 FLOPs. fp32 measured, GPU call 13: the gathered ref pass, 256 x 512 tokens
# (129.5 TFLOP at 2 per parameter per token), took 3.87 s (33 TFLOPS: fp32 GEMMs without TF32); half
# precision inferred at twice that.
COMPUTE_S_PER_TFLOP = {"fp32": 0.030, "bf16": 0.015, "fp16": 0.015}
# HF generate(): one decoding step of a chunk, seconds beside its gathers and FLOPs, whatever the chunk's
# size (calls 9-10: a chunk of 128 took as long as one of 256), in the weights' own dtype and under
# half-precision autocast over fp32 weights. measured: GPU call 10 (GTX 1080 Ti plan, fp32: 256 steps in
# 29.8 s with their gathers), call 13 (RTX 2080 Ti plan, fp16 autocast: 39.1 s gathered once); what a step
# spends it on is to be profiled
DECODE_STEP_S = {"same": 0.07, "autocast": 0.14}
# An update micro-batch's fixed cost with the models on the GPU, seconds per decoder layer: kernel launches, the
# modules' Python and FSDP's hooks, whatever the micro-batch's size. measured (issue 42: an H100, fp32, Qwen2.5-0.5B's
# shape (24 layers), LoRA rank 32 on every linear layer, 512 tokens a sequence), ms per sequence of the update:
# micro-batch 1: 237, 2: 95, 4 with checkpointing: 89, 8 with checkpointing: 50. With the FLOPs at
# COMPUTE_S_PER_TFLOP (fp32: 15.2 ms a pass of a sequence), the least-squares fit (of log time) is 161 ms a
# micro-batch, 6.7 ms a layer; the model gives 191, 111, 86, 66 ms (the same order; micro-batch 1 measured slower
# and 8 faster than a fixed cost explains). One shape cannot tell a cost per layer from one per micro-batch: taken
# as per layer (a 28-layer 1.5B pays 28 of them). Measured with LoRA's adapters (PEFT's wrapper and two FSDP units
# more per linear layer: verl's LoRA wrap policy); full fine-tuning's layers have fewer modules, taken the same
# until a run measures them (the plan's search uses it on the LoRA rungs only: tasks/plan/memory_fit.py).
MICRO_LAYER_S = 0.0067


@dataclass(frozen=True)
class OffloadStep:
    """One step of GRPO on the CPU-offload rung, as the plan would run it (sequences per GPU)."""

    params: int                      # the actor's parameters (the ref is the same model)
    train_dtype: str                 # FSDP param dtype: fp32 or bf16
    sequences: int                   # per step: prompts x rollout.n
    mini_batch: int                  # sequences per optimizer step
    micro_batch: int                 # update micro-batch
    log_prob_micro_batch: int        # actor and ref log-prob passes
    rollout_chunk: int               # sequences per HF generate() call (0: vLLM generates, not counted)
    prompt_len: int
    response_len: int
    grad_ckpt: bool = True
    rollout_dtype: str | None = None     # HF generation's dtype (None: train_dtype); fp16/bf16 over fp32: autocast
    rollout_gather_once: bool = False
    actor_gather_once: bool = False
    ref_gather_once: bool = False
    accumulate_grads_unsharded: bool = False
    fused_adamw: bool = False


def offload_step_seconds(step: OffloadStep) -> dict[str, float]:
    """Seconds per phase of one step (``rollout``, ``actor_log_prob``, ``ref_log_prob``, ``update``) and in
    all (``step``), by the model above."""
    s = step
    model_gib = 4.0 * s.params / GIB               # the host keeps fp32 shards: what a gather copies
    tflop_token = 2.0 * s.params / 1e12            # one forward of one token
    compute = COMPUTE_S_PER_TFLOP[s.train_dtype]
    seq = s.prompt_len + s.response_len
    out = {}
    if s.rollout_chunk:
        chunks = -(-s.sequences // s.rollout_chunk)
        forwards = chunks * s.response_len
        gathers = 1 if s.rollout_gather_once else forwards
        gen = s.rollout_dtype or s.train_dtype
        autocast = gen != s.train_dtype and s.train_dtype == "fp32"
        out["rollout"] = gathers * model_gib * GATHER_S_PER_GIB \
            + forwards * DECODE_STEP_S["autocast" if autocast else "same"] \
            + s.sequences * seq * tflop_token * COMPUTE_S_PER_TFLOP[gen]
    passes = -(-s.sequences // s.log_prob_micro_batch)
    for name, once in (("actor_log_prob", s.actor_gather_once), ("ref_log_prob", s.ref_gather_once)):
        out[name] = (1 if once else passes) * model_gib * GATHER_S_PER_GIB + s.sequences * seq * tflop_token * compute
    minis = -(-s.sequences // s.mini_batch)
    micros = -(-s.mini_batch // s.micro_batch)
    gathers = minis * (1 if s.actor_gather_once else 2 * micros)
    reduces = minis * (1 if s.accumulate_grads_unsharded else micros)
    sums = minis * (0 if s.accumulate_grads_unsharded else micros - 1)
    flops_factor = 3.0 + (1.0 if s.grad_ckpt else 0.0)           # forward, backward (2x), recomputed forward
    out["update"] = gathers * model_gib * GATHER_S_PER_GIB + reduces * model_gib * REDUCE_S_PER_GIB \
        + sums * model_gib * HOST_SUM_S_PER_GIB \
        + minis * s.params / 1e9 * (FUSED_ADAM_S_PER_GPARAM if s.fused_adamw else ADAM_S_PER_GPARAM) \
        + s.sequences * seq * tflop_token * flops_factor * compute
    out["step"] = sum(out.values())
    return {k: round(v, 2) for k, v in out.items()}


# ---- everything on the GPU: full fine-tuning on the PPO/GRPO rungs, LoRA on the LoRA rungs --------------------

@dataclass(frozen=True)
class GpuStep:
    """One step of a plan that keeps its models on the GPU (sequences per GPU): no gathers from host memory,
    no host-side sums, AdamW on the GPU (memory-bound: milliseconds, not counted)."""

    params: int                      # the actor's parameters
    layers: int                      # decoder layers (each costs MICRO_LAYER_S an update micro-batch)
    train_dtype: str
    sequences: int
    micro_batch: int                 # update micro-batch (FLOPs do not depend on it; the fixed costs do)
    rollout_chunk: int               # sequences per HF generate() call (0: vLLM generates, not counted)
    prompt_len: int
    response_len: int
    grad_ckpt: bool = False
    rollout_dtype: str | None = None
    lora: bool = False               # the actor trains adapters: its backward makes no weight gradient of the base
    reference: bool = False          # a reference log-prob pass (GRPO's KL loss); with LoRA the actor without adapter
    critic_params: int = 0           # PPO: the critic's value pass and update (fully fine-tuned)


def gpu_step_seconds(step: GpuStep) -> dict[str, float]:
    """Seconds per phase (``rollout``, ``actor_log_prob``, ``ref_log_prob``, ``critic``, ``update``) and in all
    (``step``) of a step whose models stay on the GPU, with the constants above (HF generation's decoding steps,
    FLOPs at one throughput, each update micro-batch's fixed cost per layer). The update's backward is twice a
    forward with full fine-tuning (input and weight gradients) and once with LoRA (input gradients through the frozen
    base; the adapters' weight gradients are rank-sized). The no-gradient passes' micro-batches are not counted (the
    plan gives them the largest that fits, the fastest anyway)."""
    s = step
    tflop_token = 2.0 * s.params / 1e12
    compute = COMPUTE_S_PER_TFLOP[s.train_dtype]
    tokens = s.sequences * (s.prompt_len + s.response_len)
    out = {}
    if s.rollout_chunk:
        gen = s.rollout_dtype or s.train_dtype
        autocast = gen != s.train_dtype and s.train_dtype == "fp32"
        out["rollout"] = -(-s.sequences // s.rollout_chunk) * s.response_len \
            * DECODE_STEP_S["autocast" if autocast else "same"] + tokens * tflop_token * COMPUTE_S_PER_TFLOP[gen]
    out["actor_log_prob"] = tokens * tflop_token * compute
    out["ref_log_prob"] = out["actor_log_prob"] if s.reference else 0.0
    critic_tflop = 2.0 * s.critic_params / 1e12
    micro_batches = -(-s.sequences // s.micro_batch)      # the critic's update takes the actor's micro-batch
    out["critic"] = tokens * critic_tflop * compute * (1.0 + 3.0 + (1.0 if s.grad_ckpt else 0.0)) \
        + (micro_batches * s.layers * MICRO_LAYER_S if s.critic_params else 0.0)
    passes = (2.0 if s.lora else 3.0) + (1.0 if s.grad_ckpt else 0.0)
    out["update"] = tokens * tflop_token * passes * compute + micro_batches * s.layers * MICRO_LAYER_S
    out["step"] = sum(out.values())
    return {k: round(v, 2) for k, v in out.items()}
