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
  GRPO (no critic, ``GRPO_N`` samples per prompt, the KL loss of verl's GRPO example) -> GRPO
  with shorter responses. No LoRA rung: not proven on a GPU yet;
* memory, on every rung: without gradient checkpointing first, then with it; at each, no offload unless the
  estimate says it does not fit, then the ladder reference params -> actor optimizer ->
  critic optimizer -> actor params -> critic params (fewer offloads = faster). HF rollout
  never gets actor param offload (0.5.0 does not reload an offloaded actor before HF
  generation). Within a level the largest update micro-batch that fits wins; then the
  no-gradient passes (log-probs, values) and the HF rollout's generation chunk each get the
  largest size that still fits. Nothing fits: ``PlanError`` with the shortfall in MiB.

CLI: ``python -m tasks.plan --json --gpu-name NAME --compute-capability X.Y --gpu-memory-mib N``.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass, field, replace
from math import gcd
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from verl_lab_box.gsm8k import VAL_ROWS
from tasks.checkpoints import DEFAULT_EVERY, DEFAULT_KEEP, CheckpointPlan, plan_checkpoints, retention_overrides, \
    side_files_bytes
from tasks.gpu_support import refusal as gpu_refusal
from tasks.verl_config import VERL_VERSION, Override, override_lines

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL_CONFIG = REPO_ROOT / "files" / "models" / "qwen2.5-0.5b-instruct" / "config.json"

# The offload ladder, in the order the plan escalates (names shared with tasks/doctor.py).
OFFLOAD_LADDER: tuple[str, ...] = (
    "ref_param_offload",
    "actor_optimizer_offload",
    "critic_optimizer_offload",
    "actor_param_offload",
    "critic_param_offload",
)
OFFLOAD_KEYS: dict[str, str] = {
    "ref_param_offload": "actor_rollout_ref.ref.fsdp_config.param_offload",
    "actor_optimizer_offload": "actor_rollout_ref.actor.fsdp_config.optimizer_offload",
    "critic_optimizer_offload": "critic.model.fsdp_config.optimizer_offload",
    "actor_param_offload": "actor_rollout_ref.actor.fsdp_config.param_offload",
    "critic_param_offload": "critic.model.fsdp_config.param_offload",
}
MICRO_BATCH_CHOICES = (16, 8, 4, 2, 1)          # update micro-batches (sequences per GPU)
FORWARD_MICRO_CHOICES = (64, 32, 16, 8, 4, 2, 1)  # no-gradient passes: actor log-probs, critic values
ROLLOUT_CHUNK_CHOICES = (256, 128, 64, 32, 16, 8, 4, 2, 1)   # prompts per HF generate() call
VLLM_SHARE_MAX = 0.9       # never give vLLM more of the GPU than this
MASTER_DTYPE = "fp32"      # the actor's and critic's weights (so their AdamW states and saves): model_dtype
VLLM_SHARE_MIN = 0.05

# The fallback ladder, best training first: (rung, algorithm, response tokens (None: the workload's),
# the actor on FSDP2 with CPUOffloadPolicy, why).
GRPO_N = 4   # samples per prompt: verl's GSM8K GRPO example takes 5; 4 keeps PPO's 256 sequences a step in 64 x 4
_OFFLOAD_WHY = ("the actor on FSDP2 with CPUOffloadPolicy (actor_rollout_ref.actor.strategy=fsdp2, fsdp_config."
                "offload_policy=True): its params, gradients and AdamW states live on the CPU and the AdamW step runs "
                "there; the GPU holds the layers FSDP gathers while they compute, activations, logits and the "
                "rollout; verl offloads the ref the same way. Slower: every micro-batch moves the weights in and the "
                "gradients out over PCIe. Critic-free: verl 0.5.0 cannot FSDP2-wrap the critic (GPU call 6)")
RUNGS: tuple[tuple[str, str, int | None, bool, str], ...] = (
    ("ppo", "ppo", None, False, "PPO with a learned critic (GAE): verl's GSM8K quick start"),
    ("grpo", "grpo", None, False, f"GRPO: no critic (no critic params, gradients, optimizer states or passes); each "
                                  f"prompt sampled {GRPO_N} times, the advantage is a reward against its group's"),
    ("grpo-cpu-offload", "grpo", None, True, f"GRPO with {_OFFLOAD_WHY}"),
    ("grpo-cpu-offload-response-192", "grpo", 192, True, "GRPO, actor on FSDP2 CPU offload, responses cut to 192 "
                                                         "tokens: GSM8K answers longer lose their '#### n' (score 0)"),
    ("grpo-cpu-offload-response-128", "grpo", 128, True, "GRPO, actor on FSDP2 CPU offload, responses cut to 128 "
                                                         "tokens: many GSM8K answers lose their '#### n' (score 0)"),
)
ALGORITHMS = ("auto", "ppo", "grpo")
# The CPU-offload rung's speed knobs (files/patches/verl-0.5.0/0007-0009): MemoryChoice field -> (override, why)
OFFLOAD_KNOBS: dict[str, tuple[str, str]] = {
    "rollout_gather_once": ("actor_rollout_ref.rollout.gather_once",
                            "HF generation gathers the FSDP2 actor once per call and holds it (patch 0007): verl "
                            "0.5.0 gathers every unit from host memory again for every generated token"),
    "actor_gather_once": ("actor_rollout_ref.actor.fsdp_config.gather_once",
                          "the actor's log-prob pass and each update mini-batch gather it once and hold it (patches "
                          "0007-0008): verl 0.5.0 gathers every unit again for every micro-batch, twice in an update"),
    "ref_gather_once": ("actor_rollout_ref.ref.fsdp_config.gather_once",
                        "the ref's log-prob pass gathers it once and holds it (patch 0007)"),
    "accumulate_grads_unsharded": ("actor_rollout_ref.actor.fsdp_config.accumulate_grads_unsharded",
                                   "gradients add up unsharded on the GPU and go to the host once per mini-batch "
                                   "(patch 0008): verl 0.5.0 copies them out after every micro-batch and sums them "
                                   "on the host"),
    "fused_adamw": ("actor_rollout_ref.actor.optim.fused",
                    "torch's fused AdamW steps the actor's parameters on the host in one kernel (patch 0009): verl "
                    "0.5.0's AdamW runs torch's per-tensor loop over the CPU-offloaded DTensors (16x slower "
                    "single-threaded, measured on CPU: docs/plan.md)"),
}
# Knobs the plan leaves off until a GPU run has measured their memory (issue 29: every new setting's estimate
# calibrated on the GPU like the others). The update's two (the actor held gathered through each mini-batch,
# gradients summed unsharded on the GPU: patches 0007-0008) never ran to its end on a GPU: GPU call 13 cut the
# update under the profiler. Measured: the gathered generation and log-prob passes (call 13, within 4% of the
# model); the fused AdamW holds no GPU memory. bench/gpu/run_speed.sh measures the rest; then empty this.
UNMEASURED_KNOBS = frozenset({"actor_gather_once", "accumulate_grads_unsharded"})


def knob_values(knob: str) -> tuple[bool, ...]:
    """The values the plan tries for a speed knob: (True, False), or (False,) while it is unmeasured."""
    return (False,) if knob in UNMEASURED_KNOBS else (True, False)
# verl 0.5.0's GSM8K GRPO example (examples/grpo_trainer/run_qwen2-7b.sh): the KL to the reference in the loss
GRPO_OVERRIDES: tuple[tuple[str, Any, str], ...] = (
    ("actor_rollout_ref.actor.kl_loss_coef", 0.001, "verl's GSM8K GRPO example"),
    ("actor_rollout_ref.actor.kl_loss_type", "low_var_kl", "verl's GSM8K GRPO example"),
    ("actor_rollout_ref.actor.entropy_coeff", 0, "verl's GSM8K GRPO example: no entropy bonus"),
    ("algorithm.use_kl_in_reward", False, "verl's GSM8K GRPO example: the KL is in the loss, not the reward"),
)


class PlanError(ValueError):
    """No plan exists for this GPU and workload. ``reason`` says why (and by how much), ``fix`` what
    to change, ``key`` which setting it is about ("workload", "workload.<key>", "gpu"); ``str()`` is
    the reason, then "Change: " and the fix."""

    def __init__(self, reason: str, fix: str | None = None, key: str = "workload"):
        self.reason, self.fix, self.key = reason, fix, key
        super().__init__(reason + (f" Change: {fix}" if fix else ""))


@dataclass(frozen=True)
class GpuTarget:
    """The GPU the plan is for: every GPU of the box is taken to be this one. A box of mixed GPU
    models is planned for its weakest (``mixed`` then lists what the box has)."""

    name: str
    compute_capability: str
    memory_mib: int
    count: int = 1
    mixed: tuple[tuple[int, str, str, int], ...] = ()   # a mixed box: (count, name, cc, MiB) per model

    @property
    def cc(self) -> tuple[int, int]:
        from tasks.facts.gpu import parse_compute_capability

        return parse_compute_capability(self.compute_capability)

    @property
    def arch_list(self) -> str:
        """TORCH_CUDA_ARCH_LIST for kernels built on the box (Apex): every compute capability it has."""
        from tasks.facts.gpu import parse_compute_capability

        ccs = {self.compute_capability} | {cc for _, _, cc, _ in self.mixed}
        return ";".join(sorted(ccs, key=parse_compute_capability))

    @property
    def names(self) -> list[str]:
        """The GPU models nvidia-smi should list (the launcher checks them)."""
        return sorted({name for _, name, _, _ in self.mixed} or {self.name})

    def mixed_words(self) -> str:
        return "; ".join(f"{n} x {name} (cc {cc}, {mib} MiB)" for n, name, cc, mib in self.mixed)

    @classmethod
    def from_inventory(cls, inventory) -> "GpuTarget":
        """From a ``tasks.facts.gpu.GpuInventory``; raises PlanError when it has no usable GPU. A box
        of mixed models is planned for the weakest: precision and rollout by the lowest compute
        capability, memory by the smallest GPU, every GPU in the count (FSDP gives each the same share)."""
        from tasks.facts.gpu import parse_compute_capability

        if not inventory.ok:
            raise PlanError(f"no usable NVIDIA GPU: {inventory.problem or 'nvidia-smi listed none'}")
        gpus = inventory.gpus
        unknown = sorted({g.name for g in gpus if not g.compute_capability})
        if unknown:
            raise PlanError(f"the compute capability of {', '.join(map(repr, unknown))} is unknown; "
                            "set gpu_override in host data")
        weakest = min(gpus, key=lambda g: (parse_compute_capability(g.compute_capability), g.memory_total_mib))
        models = sorted({(g.name, g.compute_capability) for g in gpus}, key=lambda m: parse_compute_capability(m[1]))
        mixed = () if len(models) == 1 else tuple(
            (sum(g.name == n for g in gpus), n, cc, min(g.memory_total_mib for g in gpus if g.name == n))
            for n, cc in models)
        return cls(name=weakest.name, compute_capability=weakest.compute_capability,
                   memory_mib=min(g.memory_total_mib for g in gpus), count=len(gpus), mixed=mixed)


@dataclass(frozen=True)
class Workload:
    """What to train: the model, the data, lengths, batch sizes, steps (a GSM8K PPO run)."""

    model_path: str
    train_files: str
    val_files: str
    checkpoint_dir: str
    total_training_steps: int | None = None      # a step cap; None: total_epochs over the train split
    model_config: Mapping[str, Any] = field(default_factory=dict, repr=False)   # the HF config.json
    train_batch_size: int = 256          # sequences per step (verl quick start, GSM8K PPO: 256 prompts, mini-batch 64;
    ppo_mini_batch_size: int = 64        # GRPO rungs: these / GRPO_N prompts, GRPO_N samples each)
    max_prompt_length: int = 256
    max_response_length: int = 256
    rollout_n: int = 1
    use_kl_loss: bool = False            # True builds the reference model
    algorithm: str = "auto"              # "ppo" | "grpo" | "auto": the ladder (RUNGS)
    total_epochs: int = 1
    save_freq: int = DEFAULT_EVERY       # steps between checkpoint saves (settings checkpoints.every)
    checkpoint_keep: int = DEFAULT_KEEP  # whole saves kept at any time (settings checkpoints.keep)
    model_side_bytes: int = 0            # the model's config and tokenizer files (catalog sizes)
    experiment_name: str = "qwen2.5-0.5b-gsm8k"
    flash_attn_installed: bool = False
    rollout_engine: str = "auto"         # workload.rollout: "auto" (vLLM where the GPU has it), "vllm", "hf"
    val_rows: int = VAL_ROWS             # rows of val_small.parquet (HF chunks must divide them)
    train_rows: int | None = None        # prompts of the train split (verl's dataloader needs a whole batch)
    actor_offload_policy: bool = False   # the actor (and ref) on FSDP2 with CPUOffloadPolicy (RUNGS)

    @property
    def uses_reference(self) -> bool:
        return self.use_kl_loss

    @property
    def uses_critic(self) -> bool:
        return self.algorithm != "grpo"

    @property
    def sequence_length(self) -> int:
        return self.max_prompt_length + self.max_response_length


@dataclass(frozen=True)
class Precision:
    train_dtype: str           # "bf16" | "fp32" (fp16 training is never planned: no loss scaling in 0.5.0)
    rollout: str               # "vllm" | "hf"
    rollout_dtype: str         # vLLM / HF generation dtype: "bfloat16" | "float16" | "float32"
    attn_implementation: str   # "sdpa" | "flash_attention_2"
    use_torch_compile: bool


@dataclass(frozen=True)
class MemoryChoice:
    """One point of the memory search: offloads, micro-batches and the vLLM share."""

    offload: Mapping[str, bool]
    actor_micro_batch: int
    log_prob_micro_batch: int           # actor log-prob and critic value passes (no gradients)
    critic_micro_batch: int
    rollout_micro_batch: int            # sequences generated at once: the HF chunk, or vLLM's max_num_seqs
    vllm_gpu_memory_utilization: float | None = None
    grad_ckpt: bool = False             # gradient checkpointing of actor and critic
    rollout_tp: int = 1                 # vLLM tensor parallel size (GPUs one rollout engine spans)
    # the CPU-offload rung's speed knobs (patches 0007-0009: OFFLOAD_KNOBS)
    rollout_gather_once: bool = False
    actor_gather_once: bool = False
    ref_gather_once: bool = False
    accumulate_grads_unsharded: bool = False
    fused_adamw: bool = False


@dataclass(frozen=True)
class MemoryEstimate:
    """What the estimator says about one MemoryChoice."""

    peak_mib: int
    budget_mib: int                      # what may be used on this GPU
    breakdown: Mapping[str, int] = field(default_factory=dict)
    vllm_gpu_memory_utilization: float | None = None
    # what the launcher sizes vLLM's share again from at start (verl_lab_box/vllm_share.py): the
    # engine, the share, vLLM's own MiB, what the process holds when vLLM starts, the KV cache wanted
    vllm: Mapping[str, Any] | None = None

    @property
    def fits(self) -> bool:
        return self.peak_mib <= self.budget_mib


# (gpu, workload, precision, choice) -> MemoryEstimate
Estimator = Callable[[GpuTarget, Workload, Precision, MemoryChoice], MemoryEstimate]


@dataclass(frozen=True)
class Reason:
    setting: str
    value: Any
    why: str


@dataclass
class TrainingPlan:
    gpu: GpuTarget
    precision: Precision
    memory: MemoryChoice
    estimate: MemoryEstimate
    overrides: list[Override]
    env: dict[str, str]
    reasons: list[Reason]
    workload: Workload | None = None     # the rung's workload (algorithm, batch, lengths)
    rung: str = "ppo"
    verl_version: str = VERL_VERSION
    checkpoints: CheckpointPlan | None = None   # the bytes of a save, what is kept (tasks/checkpoints.py)

    @property
    def override_lines(self) -> list[str]:
        return override_lines(self.overrides)

    def to_dict(self) -> dict[str, Any]:
        return {
            "verl_version": self.verl_version,
            "gpu": {k: v for k, v in asdict(self.gpu).items() if k != "mixed" or v},   # "mixed" only on a mixed box
            "rung": self.rung,
            "workload": {k: getattr(self.workload, k) for k in ("algorithm", "rollout_n", "train_batch_size",
                         "ppo_mini_batch_size", "max_prompt_length", "max_response_length", "total_training_steps",
                         "total_epochs", "actor_offload_policy")} if self.workload else None,
            "rollout": self.precision.rollout,
            "rollout_dtype": self.precision.rollout_dtype,
            "train_dtype": self.precision.train_dtype,
            "attn_implementation": self.precision.attn_implementation,
            "use_torch_compile": self.precision.use_torch_compile,
            "offload": dict(self.memory.offload),
            "offload_knobs": {k: getattr(self.memory, k) for k in OFFLOAD_KNOBS},
            "gradient_checkpointing": self.memory.grad_ckpt,
            "micro_batches": {
                "actor": self.memory.actor_micro_batch,
                "log_prob": self.memory.log_prob_micro_batch,
                "critic": self.memory.critic_micro_batch,
                "rollout": self.memory.rollout_micro_batch,
                "rollout_tp": self.memory.rollout_tp,
            },
            "vllm_gpu_memory_utilization": self.memory.vllm_gpu_memory_utilization,
            "vllm": dict(self.estimate.vllm) if self.estimate.vllm else None,
            "predicted_peak_mib": self.estimate.peak_mib,
            "predicted_host_ram_mib": int(self.estimate.breakdown.get("host_ram", 0)),
            "budget_mib": self.estimate.budget_mib,
            "breakdown": dict(self.estimate.breakdown),
            "overrides": self.override_lines,
            "override_reasons": [{"override": o.text(), "why": o.why} for o in self.overrides],
            "env": dict(self.env),
            "reasons": [asdict(r) for r in self.reasons],
            **({"checkpoints": self.checkpoints.to_dict(self.gpu.count)} if self.checkpoints else {}),
        }


# ---------------------------------------------------------------- decisions

def vllm_engine(gpu: GpuTarget) -> str:
    """The engine vLLM 0.8.5 runs on this GPU: ``v1`` on compute capability >= 8.0 (its default
    there), ``v0`` below (V1 refuses < 8.0: ``EngineArgs._is_v1_supported_oracle``)."""
    return "v1" if gpu.cc >= (8, 0) else "v0"


ROLLOUT_ENGINES = ("auto", "vllm", "hf")      # workload.rollout (tasks/settings.py WORKLOAD_ROLLOUTS)
VLLM_MIN_CC = (7, 0)


def rollout_refusal(rollout_engine: str, gpu: GpuTarget) -> tuple[str, str] | None:
    """(why, fix) where ``rollout_engine`` cannot run on ``gpu``; None where it can. vLLM 0.8.5
    needs compute capability >= 7.0 (its installation requirements: no vLLM on Pascal)."""
    if rollout_engine not in ROLLOUT_ENGINES:
        return f"{rollout_engine!r} is not one of {', '.join(ROLLOUT_ENGINES)}", "set workload.rollout to one of them"
    if rollout_engine == "vllm" and gpu.cc < VLLM_MIN_CC:
        return (f"vLLM 0.8.5 needs compute capability >= 7.0, and {gpu.name} has {gpu.compute_capability}",
                "set workload.rollout to 'auto' or 'hf' (the HF-transformers rollout runs on every GPU)")
    return None


def choose_precision(gpu: GpuTarget, flash_attn_installed: bool = False,
                     rollout_engine: str = "auto") -> tuple[Precision, list[Reason]]:
    refusal = rollout_refusal(rollout_engine, gpu)
    if refusal:
        raise PlanError(f"workload.rollout = {rollout_engine!r}: {refusal[0]}.", fix=refusal[1], key="workload.rollout")
    cc = gpu.cc
    ccs = gpu.compute_capability
    reasons: list[Reason] = []
    if cc >= (8, 0):
        train = "bf16"
        reasons.append(Reason("train_dtype", train, f"compute capability {ccs} >= 8.0 has bf16: FSDP mixed "
                                                    "precision with bf16 params, fp32 gradient reduction"))
    else:
        train = "fp32"
        reasons.append(Reason("train_dtype", train, f"compute capability {ccs} < 8.0 has no bf16, and verl "
                                                    f"{VERL_VERSION} has no loss scaling for fp16 training: fp32"))
    if cc >= VLLM_MIN_CC and rollout_engine != "hf":
        rollout = "vllm"
        rdtype = "bfloat16" if cc >= (8, 0) else "float16"
        asked = " (workload.rollout = 'vllm')" if rollout_engine == "vllm" else ""
        reasons.append(Reason("rollout", rollout, f"vLLM runs on compute capability >= 7.0 ({ccs}){asked}; "
                                                  f"engine {vllm_engine(gpu).upper()} on this GPU"))
        reasons.append(Reason("rollout_dtype", rdtype,
                              "bf16 generation on sm80+" if rdtype == "bfloat16"
                              else f"no bf16 on {ccs}; fp16 is fast there and fine for generation"))
    elif cc >= VLLM_MIN_CC:
        rollout = "hf"
        rdtype = "bfloat16" if cc >= (8, 0) else "float16"
        reasons.append(Reason("rollout", rollout, "the HF-transformers rollout was asked for (workload.rollout = "
                                                  f"'hf') although vLLM runs on {ccs}: no vLLM share, no vLLM in "
                                                  "the env; generation is slower"))
        reasons.append(Reason("rollout_dtype", rdtype, "generation under autocast in the GPU's fast half "
                                                       "precision over the training weights"))
    else:
        rollout = "hf"
        rdtype = "float32"
        reasons.append(Reason("rollout", rollout, f"vLLM needs compute capability >= 7.0; {ccs} gets the "
                                                  f"HF-transformers rollout (verl {VERL_VERSION} still has it)"))
        reasons.append(Reason("rollout_dtype", rdtype, f"no bf16 on {ccs}, and generation runs on the fp32 "
                                                       "training weights"))
    if flash_attn_installed and cc >= (8, 0):
        attn = "flash_attention_2"
        reasons.append(Reason("attn_implementation", attn, "flash-attn is installed and the GPU is sm80+"))
    else:
        attn = "sdpa"
        why = ("PyTorch's sdpa runs on every GPU (a flash kernel on sm80+, memory-efficient/math below); "
               + ("flash-attn is not installed" if cc >= (8, 0) else f"FlashAttention 2 needs sm80+, this is {ccs}"))
        reasons.append(Reason("attn_implementation", attn, why))
    compile_ok = cc >= (7, 0)
    reasons.append(Reason("use_torch_compile", compile_ok,
                          "Triton supports this GPU" if compile_ok
                          else f"Triton refuses compute capability {ccs} < 7.0"))
    return Precision(train, rollout, rdtype, attn, compile_ok), reasons


def offload_levels(workload: Workload, precision: Precision) -> list[dict[str, bool]]:
    """The cumulative offload states to try, fewest first."""
    steps = [k for k in OFFLOAD_LADDER
             if k != "ref_param_offload"        # no effect in verl 0.5.0: its FSDP1 ref stays on the GPU (call 12)
             and not (k == "actor_param_offload" and precision.rollout == "hf")
             and not (k.startswith("critic") and not workload.uses_critic)]
    levels = []
    on: set[str] = set()
    levels.append({k: False for k in OFFLOAD_LADDER})
    for k in steps:
        on.add(k)
        levels.append({kk: kk in on for kk in OFFLOAD_LADDER})
    return levels


def _divisors(per_gpu: int, choices: Sequence[int]) -> list[int]:
    return [m for m in choices if m <= per_gpu and per_gpu % m == 0] or [1]


def _micro_choices(per_gpu: int) -> list[int]:
    return _divisors(per_gpu, MICRO_BATCH_CHOICES)


def rollout_chunk_choices(workload: Workload, gpu: GpuTarget) -> list[int]:
    """HF generate() chunks, largest first: each divides the per-GPU training batch and, since
    validation runs through the same rollout (HFRollout splits a batch into equal chunks), leaves
    the validation rows in equal chunks too."""
    per_gpu = workload.train_batch_size * workload.rollout_n // gpu.count
    val_per_gpu = max(1, -(-workload.val_rows // gpu.count))     # verl pads validation to the GPU count
    return [m for m in _divisors(per_gpu, ROLLOUT_CHUNK_CHOICES)
            if m >= val_per_gpu or val_per_gpu % (val_per_gpu // m) == 0] or [1]


def rollout_tp_choices(gpu: GpuTarget, workload: Workload) -> list[int]:
    """vLLM tensor parallel sizes to try, smallest first: 1, then each power of two that divides the
    GPU count and the model's attention and KV heads (vLLM splits heads over the GPUs)."""
    heads = int(workload.model_config.get("num_attention_heads") or 1)
    kv = int(workload.model_config.get("num_key_value_heads") or heads)
    return [tp for tp in (1, 2, 4, 8) if tp == 1 or (gpu.count % tp == 0 and heads % tp == 0 and kv % tp == 0)]


def search_memory(gpu: GpuTarget, workload: Workload, precision: Precision,
                  estimator: Estimator) -> tuple[MemoryChoice, MemoryEstimate, list[Reason]]:
    """The fastest choice the estimate fits: no checkpointing before checkpointing, fewer offloads
    before more, the largest update micro-batch; then the largest no-gradient micro-batch and
    HF generation chunk (each of those changes only its own phase of the estimate)."""
    mini_per_gpu = workload.ppo_mini_batch_size * workload.rollout_n // gpu.count
    batch_per_gpu = workload.train_batch_size * workload.rollout_n // gpu.count
    best_failure: MemoryEstimate | None = None
    tried = 0
    found: tuple[MemoryChoice, MemoryEstimate] | None = None
    if workload.actor_offload_policy:
        return search_offload(gpu, workload, precision, estimator)
    candidates = [(ckpt, level, micro) for ckpt in (False, True) for level in offload_levels(workload, precision)
                  for micro in _micro_choices(mini_per_gpu)]
    # vLLM across several GPUs only where one GPU cannot hold the rollout (TP costs an all-reduce per layer)
    tps = rollout_tp_choices(gpu, workload) if precision.rollout == "vllm" else [1]
    for tp, (ckpt, level, micro) in ((tp, c) for tp in tps for c in candidates):
        choice = MemoryChoice(offload=level, actor_micro_batch=micro, log_prob_micro_batch=1,
                              critic_micro_batch=micro, rollout_micro_batch=1, grad_ckpt=ckpt, rollout_tp=tp)
        est = estimator(gpu, workload, precision, choice)
        tried += 1
        if est.fits:
            found = (choice, est)
            break
        if best_failure is None or est.peak_mib < best_failure.peak_mib:
            best_failure = est
    if found is None:
        assert best_failure is not None
        raise _no_fit(gpu, workload, best_failure)
    choice, est = found

    def grow(choice, est, field, sizes):
        """The largest of ``sizes`` (descending) for ``field`` that still fits; estimates tried."""
        for n, m in enumerate(sizes, 1):
            if m <= getattr(choice, field):
                return choice, est, n - 1
            bigger = replace(choice, **{field: m})
            e = estimator(gpu, workload, precision, bigger)
            if e.fits:
                return bigger, e, n
        return choice, est, len(sizes)

    choice, est, n = grow(choice, est, "log_prob_micro_batch", _divisors(batch_per_gpu, FORWARD_MICRO_CHOICES))
    tried += n
    choice, est, n = grow(choice, est, "rollout_micro_batch", rollout_chunk_choices(workload, gpu)
                          if precision.rollout == "hf" else _divisors(batch_per_gpu, ROLLOUT_CHUNK_CHOICES))
    tried += n
    if est.vllm_gpu_memory_utilization is not None:
        choice = replace(choice, vllm_gpu_memory_utilization=est.vllm_gpu_memory_utilization)
    return choice, est, _memory_reasons(gpu, workload, precision, choice, est, tried)


def offload_seconds(gpu: GpuTarget, workload: Workload, precision: Precision, choice: MemoryChoice) -> dict[str, float]:
    """The speed model's seconds per phase of one step of ``choice`` on the CPU-offload rung (tasks/speed.py)."""
    from tasks.memory import ModelShape
    from tasks.speed import OffloadStep, offload_step_seconds

    n = workload.rollout_n
    return offload_step_seconds(OffloadStep(
        params=ModelShape.from_config(dict(workload.model_config)).params("actor"),
        train_dtype=precision.train_dtype, sequences=workload.train_batch_size * n // gpu.count,
        mini_batch=workload.ppo_mini_batch_size * n // gpu.count, micro_batch=choice.actor_micro_batch,
        log_prob_micro_batch=choice.log_prob_micro_batch,
        rollout_chunk=choice.rollout_micro_batch if precision.rollout == "hf" else 0,
        prompt_len=workload.max_prompt_length, response_len=workload.max_response_length, grad_ckpt=choice.grad_ckpt,
        rollout_dtype=_MEM_DTYPE[precision.rollout_dtype], **{k: getattr(choice, k) for k in OFFLOAD_KNOBS}))


def search_offload(gpu: GpuTarget, workload: Workload, precision: Precision,
                   estimator: Estimator) -> tuple[MemoryChoice, MemoryEstimate, list[Reason]]:
    """The CPU-offload rung (FSDP2 + CPUOffloadPolicy): phase by phase, the choice the speed model ranks fastest
    (tasks/speed.py: host-device copies, host-side sums, the host's AdamW, recomputation) among those the memory
    estimate fits. The phases' memory is independent (the peak is the largest), so each is chosen with the
    earlier ones fixed and the later ones at their smallest: the update (patch 0008's gathering and unsharded
    accumulation, checkpointing, micro-batch; the actor's gathering also holds in its log-prob pass), then the
    log-prob passes (the ref's gathering, the micro-batch), then the HF rollout (its gathering, the chunk; vLLM:
    the most sequences that fit). Ties go to the larger batch, then to no checkpointing."""
    # vLLM across several GPUs only where one GPU cannot hold the rollout (TP costs an all-reduce per layer)
    tps = rollout_tp_choices(gpu, workload) if precision.rollout == "vllm" else [1]
    for tp in tps:
        try:
            return _search_offload_tp(gpu, workload, precision, estimator, tp)
        except PlanError as exc:
            if tp == tps[-1] or not hasattr(exc, "short_mib"):
                raise
    raise AssertionError("unreachable")


def _search_offload_tp(gpu: GpuTarget, workload: Workload, precision: Precision, estimator: Estimator,
                       tp: int) -> tuple[MemoryChoice, MemoryEstimate, list[Reason]]:
    mini_per_gpu = workload.ppo_mini_batch_size * workload.rollout_n // gpu.count
    batch_per_gpu = workload.train_batch_size * workload.rollout_n // gpu.count
    level = {k: k == "ref_param_offload" for k in OFFLOAD_LADDER}
    tried = 0
    best_failure: MemoryEstimate | None = None

    def fastest(options: list[MemoryChoice], phases: tuple[str, ...], size: Callable[[MemoryChoice], int]):
        nonlocal tried, best_failure
        fits = []
        for option in options:
            est = estimator(gpu, workload, precision, option)
            tried += 1
            if est.fits:
                seconds = offload_seconds(gpu, workload, precision, option)
                fits.append((sum(seconds[p] for p in phases), -size(option), option.grad_ckpt, option, est))
            elif best_failure is None or est.peak_mib < best_failure.peak_mib:
                best_failure = est
        if not fits:
            raise _no_fit(gpu, workload, best_failure)
        return min(fits, key=lambda f: f[:3])[3:]

    start = MemoryChoice(offload=level, actor_micro_batch=1, log_prob_micro_batch=1, critic_micro_batch=1,
                         rollout_micro_batch=1, grad_ckpt=True, rollout_tp=tp)
    choice, est = fastest([replace(start, actor_micro_batch=m, critic_micro_batch=m, grad_ckpt=ckpt, actor_gather_once=g,
                                   accumulate_grads_unsharded=a, fused_adamw=f)
                           for m in _micro_choices(mini_per_gpu) for ckpt in (False, True)
                           for g in knob_values("actor_gather_once") for a in knob_values("accumulate_grads_unsharded")
                           for f in knob_values("fused_adamw")],
                          ("update", "actor_log_prob"), lambda c: c.actor_micro_batch)
    choice, est = fastest([replace(choice, log_prob_micro_batch=m, ref_gather_once=g)
                           for m in _divisors(batch_per_gpu, FORWARD_MICRO_CHOICES) for g in knob_values("ref_gather_once")],
                          ("actor_log_prob", "ref_log_prob"), lambda c: c.log_prob_micro_batch)
    if precision.rollout == "hf":
        choice, est = fastest([replace(choice, rollout_micro_batch=m, rollout_gather_once=g)
                               for m in rollout_chunk_choices(workload, gpu) for g in knob_values("rollout_gather_once")],
                              ("rollout",), lambda c: c.rollout_micro_batch)
    else:   # vLLM: its share follows the sequences it runs at once; the speed model does not count vLLM
        choice, est = fastest([replace(choice, rollout_micro_batch=m)
                               for m in _divisors(batch_per_gpu, ROLLOUT_CHUNK_CHOICES)],
                              (), lambda c: c.rollout_micro_batch)
    if est.vllm_gpu_memory_utilization is not None:
        choice = replace(choice, vllm_gpu_memory_utilization=est.vllm_gpu_memory_utilization)
    return choice, est, _memory_reasons(gpu, workload, precision, choice, est, tried)


def _no_fit(gpu: GpuTarget, workload: Workload, best_failure: MemoryEstimate) -> PlanError:
    short = best_failure.peak_mib - best_failure.budget_mib
    phases = {k: v for k, v in best_failure.breakdown.items() if k.startswith("phase_")}
    worst = max(phases, key=phases.get) if phases else None
    where = f" The largest phase is {worst[len('phase_'):]} ({phases[worst]} MiB before process overhead)." if worst else ""
    bd = best_failure.breakdown
    if bd.get("vllm_kv_granted", 0) < bd.get("vllm_kv_wanted", 0):
        where += (f" vLLM cannot hold the rollout: at most {VLLM_SHARE_MAX} of the GPU leaves its KV cache "
                  f"{max(0, bd['vllm_kv_granted'])} MiB of the {bd['vllm_kv_wanted']} MiB one sequence-wave needs "
                  "beside its weights (more GPUs let an engine span several).")
    err = PlanError(
        f"{workload.experiment_name} ({workload.algorithm.upper()}) does not fit {gpu.count} x {gpu.name} "
        f"({gpu.memory_mib} MiB): even with gradient "
        f"checkpointing, every allowed offload and micro-batch 1 the estimated peak is {best_failure.peak_mib} MiB "
        f"against a budget of {best_failure.budget_mib} MiB, short by {short} MiB.{where}",
        fix=f"use a GPU with more memory (or more GPUs), train a smaller model, or shorten the sequences (prompt "
            f"{workload.max_prompt_length} + response {workload.max_response_length} tokens).")
    err.short_mib = short
    return err


def _memory_reasons(gpu, workload, precision, choice, est, tried) -> list[Reason]:
    on = [k for k in OFFLOAD_LADDER if choice.offload.get(k)]
    policy = workload.actor_offload_policy
    reasons = [Reason("gradient_checkpointing", choice.grad_ckpt,
                      ("the speed model ranks the fastest update that fits with it (tasks/speed.py)" if policy
                       else "without it no offload level and micro-batch fits the budget")
                      + " (it recomputes each layer in the backward pass: about a third more update compute)"
                      if choice.grad_ckpt else
                      "the estimate fits without it (it would recompute every layer in the backward pass)"),
               Reason("offload", "actor_offload_policy, ref" if policy else (", ".join(on) or "none"),
                      "FSDP2's CPUOffloadPolicy keeps the actor's and the ref's params (and the actor's gradients and "
                      "AdamW states) on the CPU; the FSDP1 offload flags are ignored for the actor" if policy else
                      (f"the estimate fits {est.budget_mib} MiB without offload (offload costs PCIe transfers "
                       "every step)" if not on else
                       f"without {on[-1]} the estimate exceeds the {est.budget_mib} MiB budget; "
                       "offloads are taken in ladder order, fewest first"))]
    reasons.append(Reason("micro_batches", f"actor {choice.actor_micro_batch}, critic {choice.critic_micro_batch}, "
                                           f"log-prob/values {choice.log_prob_micro_batch}",
                          (f"the fastest the speed model ranks among those that fit (of {', '.join(map(str, MICRO_BATCH_CHOICES))} "
                           "dividing the per-GPU mini-batch; tasks/speed.py): without the gather-once knobs every "
                           "micro-batch moves the weights in and the gradients out over PCIe, with them once per "
                           "mini-batch" if policy else
                           f"updates: the largest micro-batch (of {', '.join(map(str, MICRO_BATCH_CHOICES))}) dividing "
                           "the per-GPU mini-batch that fits; no-gradient passes: the largest that still fits")
                          + f" ({tried} candidates estimated)"))
    if policy:
        seconds = offload_seconds(gpu, workload, precision, choice)
        plain = offload_seconds(gpu, workload, precision, replace(choice, **{k: False for k in OFFLOAD_KNOBS}))
        knobs = [k for k in OFFLOAD_KNOBS if getattr(choice, k)]
        reasons.append(Reason("offload_speed_knobs", ", ".join(knobs) or "none",
                              f"speed model: {seconds['step']:.0f} s a step on the device's H200 (update "
                              f"{seconds['update']:.0f} s), {plain['step']:.0f} s with none of them at these batches "
                              "(tasks/speed.py; each knob's memory is in the estimate)"))
    reasons.append(Reason("rollout_micro_batch", choice.rollout_micro_batch,
                          ("sequences per HF generate() call" if precision.rollout == "hf" else
                           "sequences vLLM runs at once (its KV cache and sampler are sized for them)")
                          + ": the most that fit (generation time is per decoding step, nearly flat in the number of "
                            "sequences)"))
    reasons.append(Reason("predicted_peak_mib", est.peak_mib,
                          f"memory estimate of the largest phase; budget {est.budget_mib} MiB of {gpu.memory_mib} MiB"))
    return reasons


# ---------------------------------------------------------------- overrides

def verl_overrides(gpu: GpuTarget, workload: Workload, precision: Precision,
                   choice: MemoryChoice, checkpoints: CheckpointPlan | None = None) -> list[Override]:
    o: list[Override] = []
    add = lambda key, value, why: o.append(Override(key, value, why))  # noqa: E731
    w = workload
    # data
    add("data.train_files", w.train_files, "GSM8K train split in verl's RL format (data stage)")
    add("data.val_files", w.val_files, "GSM8K test split in verl's RL format (data stage)")
    add("data.train_batch_size", w.train_batch_size, "prompts per step (verl's GSM8K quick start: 256, mini-batch 64)"
        + (f"; x rollout.n {w.rollout_n} = PPO's sequences a step" if w.rollout_n > 1 else ""))
    add("data.max_prompt_length", w.max_prompt_length, "GSM8K questions with the chat template and instruction fit in this; longer ones are filtered")
    add("data.max_response_length", w.max_response_length, "room for a step-by-step answer ending in '#### n'")
    add("data.filter_overlong_prompts", True,
        "drop prompts longer than max_prompt_length instead of crashing (default truncation=error)")
    # model
    add("actor_rollout_ref.model.path", w.model_path, "the local model snapshot (model stage); offline")
    add("critic.model.path", w.model_path, "the critic starts from the same model (GAE needs a value model)")
    add("algorithm.adv_estimator", "gae" if w.uses_critic else "grpo",
        "PPO with a learned critic" if w.uses_critic else "GRPO: group-relative advantages, no critic model")
    add("actor_rollout_ref.rollout.n", w.rollout_n, "samples per prompt" + (" (GRPO's group)" if w.rollout_n > 1 else ""))
    add("actor_rollout_ref.actor.ppo_mini_batch_size", w.ppo_mini_batch_size, "prompts per actor update")
    add("actor_rollout_ref.actor.use_kl_loss", w.use_kl_loss,
        "reference model only when the KL loss is on (it costs a model copy)")
    if not w.uses_critic:
        for key, value, why in GRPO_OVERRIDES:
            add(key, value, why)
    # precision
    mp = {"param_dtype": precision.train_dtype, "reduce_dtype": "fp32", "buffer_dtype": "fp32"}
    for role, label in (("actor_rollout_ref.actor", "actor"), ("actor_rollout_ref.ref", "reference"),
                        ("critic.model", "critic")):
        for fld, val in mp.items():
            add(f"{role}.fsdp_config.mixed_precision.{fld}", val,
                f"{label} FSDP {fld}: {precision.train_dtype} training on compute capability {gpu.compute_capability}"
                if fld == "param_dtype" else f"{label} {fld} in fp32 for stable sums")
        add(f"{role}.fsdp_config.model_dtype", MASTER_DTYPE if role != "actor_rollout_ref.ref" or precision.train_dtype == "fp32"
            else "bf16",
            f"{label} weights are loaded in this dtype"
            + (" (fp32 master weights; the optimizer must not run in half precision)" if role != "actor_rollout_ref.ref"
               else (" (bf16: inference only)" if precision.train_dtype == "bf16" else " (no bf16 on this GPU)")))
    # attention
    for key, label in (("actor_rollout_ref.model.override_config._attn_implementation", "actor and reference"),
                       ("critic.model.override_config._attn_implementation", "critic (project patch reads it)")):
        add(key, precision.attn_implementation, f"{label}: verl {VERL_VERSION} hard-codes flash_attention_2 otherwise")
    rmpad = precision.attn_implementation == "flash_attention_2"
    add("actor_rollout_ref.model.use_remove_padding", rmpad,
        "padding removal uses flash-attn's kernels" if rmpad else "padding removal needs flash-attn")
    add("critic.model.use_remove_padding", rmpad,
        "padding removal uses flash-attn's kernels" if rmpad else "padding removal needs flash-attn")
    for key, label in (("actor_rollout_ref.model.enable_gradient_checkpointing", "actor"),
                       ("critic.model.enable_gradient_checkpointing", "critic")):
        add(key, choice.grad_ckpt,
            f"{label}: needed to fit the memory budget"
            + (" at a larger update micro-batch (fewer PCIe round trips)" if w.actor_offload_policy else "")
            + " (recomputes each layer in the backward pass)" if choice.grad_ckpt
            else f"{label}: the estimate fits without it, and it costs a recomputed forward in every update")
    add("actor_rollout_ref.actor.use_torch_compile", precision.use_torch_compile,
        "Triton supports this GPU" if precision.use_torch_compile
        else f"Triton refuses compute capability {gpu.compute_capability} < 7.0")
    # rollout
    add("actor_rollout_ref.rollout.name", precision.rollout,
        "vLLM on compute capability >= 7.0" if precision.rollout == "vllm" else
        "no vLLM below compute capability 7.0" if gpu.cc < VLLM_MIN_CC else "workload.rollout = 'hf' asks for it")
    add("actor_rollout_ref.rollout.dtype", precision.rollout_dtype, "generation dtype for this GPU")
    add("actor_rollout_ref.rollout.tensor_model_parallel_size", choice.rollout_tp,
        "the rollout fits one GPU (default is 2)" if choice.rollout_tp == 1 else
        f"vLLM's weights and KV cache do not fit one GPU beside the training states: each rollout engine spans "
        f"{choice.rollout_tp} GPUs (tensor parallel)")
    if precision.rollout == "vllm":
        share = choice.vllm_gpu_memory_utilization
        add("actor_rollout_ref.rollout.gpu_memory_utilization", share,
            "share of the whole GPU that vLLM's V1 engine may fill, counting the training states this process "
            "already holds when vLLM starts" if vllm_engine(gpu) == "v1" else
            "vLLM V0's own share of the GPU (weights, profiling activations, KV cache) on top of the training "
            "states")
        add("actor_rollout_ref.rollout.max_num_batched_tokens", max_num_batched_tokens(w),
            "chunked prefill needs max_num_batched_tokens >= prompt + response length")
        add("actor_rollout_ref.rollout.engine_kwargs.vllm.max_num_seqs", choice.rollout_micro_batch * choice.rollout_tp,
            "sequences at once: the share of a step of the GPUs the engine spans, when the memory estimate fits it (else in waves); "
            "rollout.max_num_seqs is never passed to vLLM in 0.5.0")
    else:
        add("actor_rollout_ref.rollout.micro_batch_size", choice.rollout_micro_batch,
            "prompts per HF generate() call, from the memory estimate")
    # micro-batches
    add("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", choice.actor_micro_batch, "from the memory estimate")
    add("actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu", choice.log_prob_micro_batch,
        "the largest no-gradient micro-batch the estimate fits (actor log-probs)")
    add("actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu", choice.log_prob_micro_batch,
        "as the actor's log-prob pass")
    add("critic.ppo_micro_batch_size_per_gpu", choice.critic_micro_batch, "from the memory estimate")
    add("critic.forward_micro_batch_size_per_gpu", choice.log_prob_micro_batch,
        "the critic's value pass has no gradients: as the actor's log-prob pass")
    # offload
    if w.actor_offload_policy:
        add("actor_rollout_ref.actor.strategy", "fsdp2", "FSDP2 (fully_shard) for the actor; the ref follows "
            "(actor_rollout_ref.ref.strategy interpolates it, and verl builds the ref with the actor's strategy)")
        add("actor_rollout_ref.actor.fsdp_config.offload_policy", True, "CPUOffloadPolicy: the actor's params, "
            "gradients and AdamW states on the CPU, the AdamW step there (FSDP2 only; verl 0.5.0 always offloads the ref)")
        for field_name, (key, why) in OFFLOAD_KNOBS.items():
            if field_name == "rollout_gather_once" and precision.rollout != "hf":
                continue
            on = getattr(choice, field_name)
            add(key, on, why if on else "off: the memory estimate does not fit it beside this phase's batch, or the "
                                        "speed model ranks it slower (tasks/speed.py)")
    for name in OFFLOAD_LADDER:
        on = bool(choice.offload.get(name))
        if w.actor_offload_policy and name.startswith("actor"):
            why = "verl 0.5.0 ignores it under offload_policy (fsdp_workers forces it False): CPUOffloadPolicy offloads"
        elif w.actor_offload_policy and name == "ref_param_offload":
            why = "says what happens: verl 0.5.0 builds the ref with CPUOffloadPolicy under fsdp2 whatever this flag says"
        elif name == "ref_param_offload" and not w.uses_reference:
            why = "no reference model in this run"
        elif name == "ref_param_offload":
            why = ("not taken: verl 0.5.0 kept the FSDP1 ref's params on the GPU with it on (GPU call 12), so the "
                   "plan counts them resident")
        elif name == "actor_param_offload" and precision.rollout == "hf":
            why = "never with the HF rollout: verl 0.5.0 does not reload offloaded actor params before generation"
        else:
            why = "needed to fit the memory budget" if on else "fits without it (offload costs PCIe time every step)"
        add(OFFLOAD_KEYS[name], on, why)
    # trainer
    add("trainer.n_gpus_per_node", gpu.count, f"{gpu.count} x {gpu.name} on this box")
    add("trainer.nnodes", 1, "one box")
    add("trainer.total_epochs", w.total_epochs, "passes over GSM8K's train split (settings workload.epochs)"
        + ("; the step cap below ends the run first" if w.total_training_steps else ""))
    if w.total_training_steps is not None:
        add("trainer.total_training_steps", w.total_training_steps, "settings.train_steps caps the run")
    add("trainer.logger", ["console"], "the journal keeps the console log; no wandb account needed")
    add("trainer.project_name", "verl-lab", "names the checkpoint folder")
    add("trainer.experiment_name", w.experiment_name, "names the checkpoint folder")
    add("trainer.default_local_dir", w.checkpoint_dir, "checkpoints under the train dir")
    add("trainer.resume_mode", "auto", "a restarted unit resumes from the last checkpoint")
    for key, value, why in retention_overrides(checkpoints or checkpoint_plan(w, gpu.count)):
        add(key, value, why)
    add("trainer.val_before_train", False, "start training at once")
    return o if w.uses_critic else [x for x in o if not x.key.startswith("critic.")]   # verl builds no critic


def plan_env(precision: Precision, gpu: GpuTarget) -> tuple[dict[str, str], list[Reason]]:
    env: dict[str, str] = {}
    reasons: list[Reason] = []
    if precision.rollout == "vllm":
        engine = vllm_engine(gpu)
        env["VLLM_USE_V1"] = "1" if engine == "v1" else "0"
        reasons.append(Reason("VLLM_USE_V1", env["VLLM_USE_V1"],
                              f"pins vLLM 0.8.5's {engine.upper()} engine, the one gpu_memory_utilization was sized "
                              "for (V1 counts everything the process holds in its share, V0 only its own need)"))
    if precision.rollout == "hf":
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
        reasons.append(Reason("PYTORCH_CUDA_ALLOC_CONF", env["PYTORCH_CUDA_ALLOC_CONF"],
                              "less fragmentation between rollout and training phases"))
    else:
        reasons.append(Reason("PYTORCH_CUDA_ALLOC_CONF", "(unset)",
                              "vLLM's sleep mode (free_cache_engine) allocates from a CUDA memory pool and "
                              "refuses to start when expandable_segments:True is set"))
    return env, reasons


def make_plan(gpu: GpuTarget, workload: Workload, estimator: Estimator | None = None) -> TrainingPlan:
    if gpu.count < 1:
        raise PlanError("the plan needs at least one GPU")
    refused = gpu_refusal(gpu.arch_list.split(";"))
    if refused:
        raise PlanError(refused[0], fix=refused[1], key="gpu")
    for name in ("train_batch_size", "ppo_mini_batch_size", "max_prompt_length", "max_response_length",
                 "total_training_steps", "rollout_n", "total_epochs"):
        if getattr(workload, name) is not None and getattr(workload, name) < 1:
            raise PlanError(f"workload {name} must be >= 1")
    if workload.train_batch_size < workload.ppo_mini_batch_size:
        raise PlanError("train_batch_size must be >= ppo_mini_batch_size")
    if workload.algorithm not in ALGORITHMS:
        raise PlanError(f"workload algorithm must be one of {', '.join(ALGORITHMS)}, not {workload.algorithm!r}")
    estimator = estimator or default_estimator
    precision, reasons = choose_precision(gpu, workload.flash_attn_installed, workload.rollout_engine)
    if gpu.mixed:
        reasons.insert(0, Reason("gpu", f"{gpu.count} x {gpu.name} ({gpu.memory_mib} MiB)",
                                 f"the box mixes GPU models ({gpu.mixed_words()}): planned for the weakest, "
                                 "precision and rollout by the lowest compute capability, memory by the smallest GPU; "
                                 "FSDP gives every GPU the same share, so the larger ones keep memory unused"))
    failed: list[tuple[str, PlanError]] = []
    for rung, w, why in ladder(workload, gpu):
        try:
            choice, est, mem_reasons = search_memory(gpu, w, precision, estimator)
        except PlanError as exc:
            if not hasattr(exc, "short_mib"):
                raise
            failed.append((rung, exc))
            continue
        before = "; ".join(f"{r} is short by {e.short_mib} MiB" for r, e in failed)
        rung_reason = Reason("rung", rung, why + (f" ({before})" if before else ""))
        env, env_reasons = plan_env(precision, gpu)
        cp = checkpoint_plan(w, gpu.count)
        plan = TrainingPlan(gpu=gpu, precision=precision, memory=choice, estimate=est, workload=w, rung=rung,
                            overrides=verl_overrides(gpu, w, precision, choice, cp), env=env, checkpoints=cp,
                            reasons=reasons + [rung_reason, *_batch_reasons(workload, w)] + mem_reasons + env_reasons
                            + [Reason(*r) for r in cp.reasons])
        verl_refusal(plan)
        return plan
    tried = ", ".join(f"{r} short by {e.short_mib} MiB" for r, e in failed)
    err = PlanError(f"{failed[-1][1].reason} Rungs tried: {tried} (no LoRA rung: not proven on a GPU yet).",
                    fix=failed[-1][1].fix)
    err.short_mib = failed[-1][1].short_mib     # the last rung tried: the one the message describes
    raise err


def checkpoint_plan(workload: Workload, world_size: int) -> CheckpointPlan:
    """The rung's checkpoints (tasks/checkpoints.py): one save's bytes for its layout (the actor on
    FSDP2 on the CPU-offload rungs, else FSDP1; a critic on PPO), over ``world_size`` ranks."""
    from tasks.memory import ModelShape

    return plan_checkpoints(ModelShape.from_config(dict(workload.model_config)), critic=workload.uses_critic,
                            actor_layout="fsdp2" if workload.actor_offload_policy else "fsdp", world_size=world_size,
                            param_dtype=MASTER_DTYPE, side_files_bytes=workload.model_side_bytes,
                            keep=workload.checkpoint_keep, every=workload.save_freq,
                            total_steps=workload.total_training_steps)


def verl_refusal(plan: TrainingPlan) -> None:
    """PlanError where verl 0.5.0's own checks (tasks/verl_rules.py) refuse the plan's config, with
    verl's words: a workload verl would stop on is refused before any host changes."""
    from tasks.verl_rules import violations

    w = plan.workload
    found = violations({o.key: o.value for o in plan.overrides}, w.model_config, w.train_rows, w.val_rows)
    if not found:
        return
    first, more = found[0], len(found) - 1
    reason = (f"verl {VERL_VERSION} would refuse this run ({first.where}): \"{first.message}\""
              + (f" (and {more} more of its checks)" if more else ""))
    if first.setting.startswith("workload."):
        raise PlanError(reason, fix=first.fix or f"change {first.setting}", key=first.setting)
    raise PlanError(reason, fix=f"{first.setting} is the plan's own choice: this is a bug of verl-lab's plan; report "
                                "it with the workload and the GPU", key="workload")


def ladder(workload: Workload, gpu: GpuTarget) -> list[tuple[str, Workload, str]]:
    """The rungs ``workload.algorithm`` allows ("auto": all of RUNGS; else that algorithm at the
    workload's lengths), each as the workload it trains, with batches every GPU gets a share of."""
    out = []
    for rung, algorithm, response, offload_policy, why in RUNGS:
        if workload.algorithm not in ("auto", algorithm) or \
                (response and (workload.algorithm != "auto" or response >= workload.max_response_length)):
            continue
        w = replace(workload, algorithm=algorithm, max_response_length=response or workload.max_response_length,
                    actor_offload_policy=offload_policy)
        if algorithm == "grpo":   # PPO's sequences a step: prompts / GRPO_N, each sampled GRPO_N times
            w = replace(w, rollout_n=GRPO_N, use_kl_loss=True, train_batch_size=max(1, w.train_batch_size // GRPO_N),
                        ppo_mini_batch_size=max(1, w.ppo_mini_batch_size // GRPO_N))
        step = gpu.count // gcd(gpu.count, w.rollout_n)    # prompts whose sequences split evenly over the GPUs
        mini = -(-w.ppo_mini_batch_size // step) * step
        out.append((rung, replace(w, ppo_mini_batch_size=mini,
                                  train_batch_size=max(mini, -(-w.train_batch_size // step) * step)), why))
    return out


def _batch_reasons(asked: Workload, w: Workload) -> list[Reason]:
    n_why = (f"{w.rollout_n} samples per prompt for GRPO's group baseline: {w.train_batch_size} prompts x "
             f"{w.rollout_n} = {w.train_batch_size * w.rollout_n} sequences a step" if w.rollout_n > 1 else "one sample per prompt")
    grown = w.train_batch_size * w.rollout_n > asked.train_batch_size * asked.rollout_n
    return [Reason("rollout_n", w.rollout_n, n_why),
            Reason("train_batch_size", w.train_batch_size,
                   f"prompts a step, mini-batch {w.ppo_mini_batch_size}"
                   + (": rounded up so every GPU gets an equal share of sequences (verl divides them)" if grown else ""))]


# ---------------------------------------------------------------- a cluster of boxes

def weakest_gpu(targets: Mapping[str, GpuTarget]) -> tuple[GpuTarget, str]:
    """The per-node GPU the cluster plans for: the lowest compute capability decides precision and
    rollout, the smallest memory the memory plan, the smallest count ``n_gpus_per_node``."""
    low_cc = min(targets.items(), key=lambda kv: (kv[1].cc, kv[1].memory_mib))
    low_mem = min(targets.items(), key=lambda kv: (kv[1].memory_mib, kv[1].cc))
    count = min(t.count for t in targets.values())
    name = low_cc[1].name if low_mem[1].memory_mib >= low_cc[1].memory_mib \
        else f"{low_cc[1].name} (with {low_mem[1].name}'s memory)"
    gpu = GpuTarget(name, low_cc[1].compute_capability, min(low_cc[1].memory_mib, low_mem[1].memory_mib), count)
    uneven = len({t.count for t in targets.values()}) > 1
    why = (f"precision and rollout by the lowest compute capability ({low_cc[1].name} on {low_cc[0]}, "
           f"{low_cc[1].compute_capability}), memory by the smallest ({low_mem[1].memory_mib} MiB on {low_mem[0]}), "
           f"{count} GPU(s) per node" + (" (the smallest count: verl's resource pool is even; other GPUs stay idle)"
                                        if uneven else ""))
    return gpu, why


def cluster_plan(targets: Mapping[str, GpuTarget], workload: Workload, estimator=None) -> TrainingPlan:
    """The plan of a cluster (``targets``: each member's GPU target): make_plan for the weakest
    GPU at the cluster's world size (batches and FSDP sharding over every GPU), then verl's node
    split; ``plan.gpu`` is the per-node target the launcher checks on each box."""
    per_node, why = weakest_gpu(targets)
    nodes = len(targets)
    plan = make_plan(replace(per_node, count=per_node.count * nodes), workload, estimator)
    split = {"trainer.n_gpus_per_node": (per_node.count, f"{per_node.count} x {per_node.name} on each node"),
             "trainer.nnodes": (nodes, f"{nodes} boxes in the Ray cluster ({', '.join(sorted(targets))})")}
    overrides = [Override(o.key, *split[o.key]) if o.key in split else o for o in plan.overrides]
    return replace(plan, gpu=per_node, overrides=overrides,
                   reasons=[Reason("cluster", f"{nodes} x {per_node.count} x {per_node.name}", why), *plan.reasons])


# ---------------------------------------------------------------- the memory estimator

_MEM_DTYPE = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "bf16": "bf16", "fp32": "fp32", "fp16": "fp16"}


def gpu_budget_mib(gpu: GpuTarget) -> int:
    """What a plan may use of one GPU: total minus what the driver keeps (an idle H200 shows
    615 MiB in use of 143771) and allocator fragmentation: 5%, at least 512 MiB; and minus the
    margin for what a real old card's process may hold outside PyTorch beyond what the H200
    measured (tasks/memory.py: OLD_CARD_OUTSIDE_TORCH_MARGIN_MIB, never measured; the predicted
    peak counts only the measured 1368 MiB)."""
    from tasks.memory import OLD_CARD_OUTSIDE_TORCH_MARGIN_MIB

    return gpu.memory_mib - max(512, gpu.memory_mib // 20) - int(OLD_CARD_OUTSIDE_TORCH_MARGIN_MIB)


def max_num_batched_tokens(workload: Workload) -> int:
    """vLLM's chunked-prefill budget: at least one whole sequence (prompt + response)."""
    return max(8192, workload.sequence_length)


def vllm_memory_for(gpu: GpuTarget, workload: Workload, precision: Precision, choice: MemoryChoice):
    """vLLM's share and footprint for this plan's engine (tasks.memory.vllm_memory)."""
    from tasks.memory import ModelShape, held_at_vllm_start_mib, vllm_memory

    shape = ModelShape.from_config(dict(workload.model_config))
    return vllm_memory(
        shape, engine=vllm_engine(gpu), dtype=_MEM_DTYPE[precision.rollout_dtype], gpu_memory_mib=gpu.memory_mib,
        seqs=choice.rollout_micro_batch, seq_len=workload.sequence_length, tp=choice.rollout_tp,
        max_num_batched_tokens=max_num_batched_tokens(workload),
        held_at_start_mib=held_at_vllm_start_mib(shape, _verl_workload(gpu, workload, precision, choice)),
        share_min=VLLM_SHARE_MIN, share_max=VLLM_SHARE_MAX)


def _verl_workload(gpu: GpuTarget, workload: Workload, precision: Precision, choice: MemoryChoice,
                   vllm_rollout_mib: float | None = None):
    from tasks.memory import VerlWorkload

    off = choice.offload
    return VerlWorkload(
        train_dtype=precision.train_dtype,
        # the estimator models sdpa and eager; flash_attention_2 needs no more than sdpa
        attn="sdpa" if precision.attn_implementation in ("sdpa", "flash_attention_2") else "eager",
        grad_ckpt=choice.grad_ckpt,
        micro_batch=choice.actor_micro_batch,
        critic_micro_batch=choice.critic_micro_batch,
        log_prob_micro_batch=choice.log_prob_micro_batch,
        seq_len=workload.sequence_length,
        rollout=precision.rollout,
        rollout_dtype=_MEM_DTYPE[precision.rollout_dtype],
        rollout_batch=choice.rollout_micro_batch,
        prompt_len=workload.max_prompt_length,
        response_len=workload.max_response_length,
        vllm_rollout_mib=vllm_rollout_mib,
        gpu_memory_mib=gpu.memory_mib,
        use_critic=workload.uses_critic,
        use_ref=workload.uses_reference,
        n_gpus=gpu.count,
        actor_param_offload=bool(off.get("actor_param_offload")),
        actor_optimizer_offload=bool(off.get("actor_optimizer_offload")),
        ref_param_offload=bool(off.get("ref_param_offload")),
        actor_offload_policy=workload.actor_offload_policy,
        critic_param_offload=bool(off.get("critic_param_offload")),
        critic_optimizer_offload=bool(off.get("critic_optimizer_offload")),
        **{k: getattr(choice, k) for k in OFFLOAD_KNOBS if k != "fused_adamw"},    # no GPU memory of its own
    )


def default_estimator(gpu: GpuTarget, workload: Workload, precision: Precision, choice: MemoryChoice) -> MemoryEstimate:
    """The project's memory model (tasks/memory.py: verl_gpu_budget) for one choice."""
    from tasks.memory import ModelShape, verl_gpu_budget

    if not workload.model_config:
        raise PlanError("the workload has no model config.json: the memory estimate needs the model's shape")
    shape = ModelShape.from_config(dict(workload.model_config))
    vllm = vllm_memory_for(gpu, workload, precision, choice) if precision.rollout == "vllm" else None
    est = verl_gpu_budget(shape, _verl_workload(gpu, workload, precision, choice,
                                                vllm.rollout_mib if vllm else None))
    breakdown = {k: int(round(v)) for k, v in est.breakdown.items()}
    breakdown["host_ram"] = int(round(est.host_ram_mib))   # offloaded states (and vLLM's weights asleep)
    peak = int(round(est.peak_mib))
    if vllm is not None:
        breakdown.update({"vllm_kv_wanted": int(round(vllm.kv_wanted_mib)),
                          "vllm_kv_granted": int(round(vllm.kv_granted_mib))})
        if vllm.kv_granted_mib < vllm.kv_wanted_mib:
            peak = max(peak, gpu.memory_mib)      # vLLM's share cannot hold one step's sequences
    return MemoryEstimate(peak_mib=peak, budget_mib=gpu_budget_mib(gpu), breakdown=breakdown,
                          vllm_gpu_memory_utilization=vllm.share if vllm else None,
                          vllm={"engine": vllm.engine, "share": vllm.share, "own_mib": round(vllm.own_mib, 1),
                                "held_at_start_mib": round(vllm.held_at_start_mib, 1),
                                "kv_wanted_mib": round(vllm.kv_wanted_mib, 1), "gpu_memory_mib": gpu.memory_mib}
                          if vllm else None)


# ---------------------------------------------------------------- host entry and CLI

def catalog_models(catalog) -> list:
    """The catalog's models (kind hf-model), largest first (parameters of their config.json)."""
    from tasks.memory import ModelShape

    models = [a for a in catalog.artifacts.values() if a.kind == "hf-model"]
    return sorted(models, key=lambda a: -ModelShape.from_config(catalog_model_config(a)).params("actor"))


def with_model(workload: Workload, artifact, model_path: str | None = None) -> Workload:
    """``workload`` training another catalog model (its shape, name and, where given, its path)."""
    name = (artifact.repo or artifact.name).rsplit("/", 1)[-1].lower()
    return replace(workload, model_config=catalog_model_config(artifact), model_path=model_path or workload.model_path,
                   experiment_name=f"{name.removesuffix('-instruct')}-gsm8k",
                   model_side_bytes=side_files_bytes(artifact.get("files")))


def plan_naming_models_that_fit(plan: Callable[[Workload], TrainingPlan], workload: Workload, catalog,
                                model: str) -> TrainingPlan:
    """``plan(workload)``; where the model does not fit, the PlanError also names the catalog's
    models that do (largest first, with their rung), or says that none does."""
    try:
        return plan(workload)
    except PlanError as exc:
        if not hasattr(exc, "short_mib"):
            raise
        fits, smallest = [], None
        for a in catalog_models(catalog):
            if a.name == model:
                continue
            try:
                fits.append(f"{a.repo} (rung {plan(with_model(workload, a)).rung})")
            except PlanError as other:
                smallest = (a, other)
        if fits:
            hint = (f" Models of the catalog that fit, largest first: {'; '.join(fits)}: set workload.model to "
                    "one of them in host data.")
        elif smallest:
            hint = (f" No model of the catalog fits: the smallest, {smallest[0].repo}, is short by "
                    f"{getattr(smallest[1], 'short_mib', '?')} MiB too.")
        else:
            hint = ""
        err = PlanError(exc.reason, fix=f"{exc.fix or ''}{hint}".strip() or None, key=exc.key)
        err.short_mib = exc.short_mib
        raise err from None


def load_model_config(path: Path | str = DEFAULT_MODEL_CONFIG) -> dict:
    with open(path) as fh:
        return json.load(fh)


def model_config_path(repo: str) -> Path:
    """The model's config.json kept in the repo (files/models/<name>/), which the plan reads before
    the model is downloaded: e.g. files/models/qwen2.5-1.5b-instruct/config.json."""
    return REPO_ROOT / "files" / "models" / repo.rsplit("/", 1)[-1].lower() / "config.json"


def catalog_model_config(artifact) -> dict:
    """The shape of a catalog model (``tasks.catalog.Artifact`` of kind hf-model)."""
    path = model_config_path(artifact.repo or artifact.name)
    if not path.is_file():
        raise PlanError(f"no config.json for {artifact.repo} at {path.relative_to(REPO_ROOT)}: the plan needs the "
                        "model's shape before it is downloaded; add it there (the config.json of the pinned revision)")
    return load_model_config(path)


def workload_for(settings, flash_attn_installed: bool = False) -> Workload:
    """The GSM8K workload of a host, from its ``LabSettings`` (paths, ``workload``, step cap)."""
    w = settings.workload
    return with_model(Workload(
        algorithm=w["algorithm"], train_batch_size=w["train_batch_size"], ppo_mini_batch_size=w["ppo_mini_batch_size"],
        max_prompt_length=w["max_prompt_length"], max_response_length=w["max_response_length"],
        total_epochs=w["epochs"],
        model_path=settings.model_dir,
        train_files=f"{settings.data_dir}/train.parquet",
        # the data stage's first 64 test rows: validation at each checkpoint stays short
        val_files=f"{settings.data_dir}/val_small.parquet",
        checkpoint_dir=f"{settings.train_dir}/checkpoints",
        total_training_steps=settings.train_steps,
        flash_attn_installed=flash_attn_installed,
        save_freq=settings.checkpoints["every"],
        checkpoint_keep=settings.checkpoints["keep"],
        rollout_engine=w["rollout"],
        train_rows=((settings.catalog.artifact(settings.dataset_artifact).get("splits") or {}).get("train") or {})
        .get("rows"),
    ), settings.catalog.artifact(settings.model_artifact))


def plan_overrides_for_host(gpu: GpuTarget, settings=None, flash_attn_installed: bool = False) -> list[str]:
    """The Hydra override strings a host with ``gpu`` gets, for checks such as
    ``python -m verl.trainer.main_ppo <overrides> --cfg job`` inside a built env.

    ``settings``: the host's ``LabSettings`` (default: every setting at its default).
    """
    if settings is None:
        from tasks.settings import load_settings

        settings = load_settings("localhost", {})
    return make_plan(gpu, workload_for(settings, flash_attn_installed)).override_lines


def _table(plan: TrainingPlan) -> str:
    d = plan.to_dict()
    lines = [f"Plan for {plan.gpu.count} x {plan.gpu.name} (compute capability {plan.gpu.compute_capability}, "
             f"{plan.gpu.memory_mib} MiB), verl {plan.verl_version}",
             f"predicted peak {d['predicted_peak_mib']} MiB of a {d['budget_mib']} MiB budget", ""]
    width = max(len(r.setting) for r in plan.reasons)
    for r in plan.reasons:
        lines.append(f"  {r.setting:<{width}}  {r.value!s:<22}  {r.why}")
    lines += ["", "Overrides:"]
    for o in plan.overrides:
        lines.append(f"  {o.text():<78}  # {o.why}")
    if plan.env:
        lines += ["", "Environment:"] + [f"  {k}={v}" for k, v in plan.env.items()]
    return "\n".join(lines)


# The GPUs docs/plan.md tabulates: name as nvidia-smi prints it, compute capability, memory.total in MiB
# (the H200's from a real capture, tests/fixtures/nvidia-smi/h200.txt; the others nominal), GPU count.
DOC_GPUS: tuple[tuple[str, str, int, int], ...] = (
    ("NVIDIA GeForce GTX 1080", "6.1", 8192, 1),
    ("NVIDIA GeForce GTX 1080 Ti", "6.1", 11264, 1),
    ("Tesla P40", "6.1", 24576, 1),
    ("Tesla P40", "6.1", 24576, 4),
    ("Tesla P100-PCIE-16GB", "6.0", 16384, 1),
    ("Tesla V100-SXM2-16GB", "7.0", 16160, 1),
    ("Tesla V100-SXM2-32GB", "7.0", 32768, 1),
    ("Tesla T4", "7.5", 15360, 1),
    ("NVIDIA GeForce RTX 2080 Ti", "7.5", 11264, 1),
    ("NVIDIA GeForce RTX 3060", "8.6", 12288, 1),
    ("NVIDIA GeForce RTX 3080", "8.6", 10240, 1),
    ("NVIDIA GeForce RTX 3090", "8.6", 24576, 1),
    ("NVIDIA A10", "8.6", 23028, 1),
    ("NVIDIA GeForce RTX 4060", "8.9", 8188, 1),
    ("NVIDIA L4", "8.9", 23034, 1),
    ("NVIDIA GeForce RTX 4090", "8.9", 24564, 1),
    ("NVIDIA A100-SXM4-80GB", "8.0", 81920, 1),
    ("NVIDIA H100 80GB HBM3", "9.0", 81559, 1),
    ("NVIDIA H200", "9.0", 143771, 1),
)


# a box mixing models: planned for its weakest GPU
DOC_MIXED = GpuTarget("Tesla P40", "6.1", 24576, 2, mixed=((1, "Tesla P40", "6.1", 24576),
                                                            (1, "NVIDIA GeForce RTX 3090", "8.6", 24576)))


def doc_targets() -> list[tuple[str, GpuTarget]]:
    """docs/plan.md's GPUs: (label, target)."""
    rows = [(f"{count} x {name}" if count > 1 else name, GpuTarget(name, cc, mem, count))
            for name, cc, mem, count in DOC_GPUS]
    return rows + [(" + ".join(f"{n} x {name}" for n, name, _, _ in DOC_MIXED.mixed) + " (mixed)", DOC_MIXED)]


def gpu_table(workload: Workload) -> str:
    """docs/plan.md's table of plans, made from the code (``--doc-table``)."""
    rows = ["| GPU | CC | MiB | rung | train | rollout | checkpointing | offload | micro (actor/critic, log-prob, "
            "rollout seqs) | vLLM share | peak / budget MiB |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for gpu, target in doc_targets():
        cc, mem = target.compute_capability, target.memory_mib
        try:
            p = make_plan(target, workload)
        except PlanError as exc:
            rows.append(f"| {gpu} | {cc} | {mem} | no plan: short by {exc.short_mib} MiB | | | | | | | |")
            continue
        d = p.to_dict()
        knobs = d["offload_knobs"]
        once = [k.split("_")[0] for k, v in knobs.items() if v and k.endswith("gather_once")]
        off = ("actor + ref: FSDP2 offload_policy" + (f"; gathered once: {', '.join(once)}" if once else "")
               + ("; gradients reduced once" if knobs["accumulate_grads_unsharded"] else "")
               + ("; fused AdamW" if knobs["fused_adamw"] else "")) \
            if p.workload.actor_offload_policy else \
            (", ".join(k.replace("_offload", "") for k, v in d["offload"].items() if v) or "none")
        mb = d["micro_batches"]
        critic = mb["critic"] if p.workload.uses_critic else "-"
        engine = f" {vllm_engine(p.gpu).upper()}" if d["rollout"] == "vllm" else ""
        rows.append(f"| {gpu} | {cc} | {mem} | {p.rung} | {d['train_dtype']} | {d['rollout']}{engine} "
                    f"({d['rollout_dtype']}) | {'yes' if d['gradient_checkpointing'] else 'no'} | {off} | "
                    f"{mb['actor']}/{critic}, {mb['log_prob']}, {mb['rollout']} | {d['vllm_gpu_memory_utilization'] or '-'} | "
                    f"{d['predicted_peak_mib']} / {d['budget_mib']} |")
    return "\n".join(rows)


def model_table(workload: Workload, catalog=None) -> str:
    """docs/plan.md's table of the catalog's models on each GPU: the rung each lands on (TP where
    vLLM spans GPUs), or the shortfall (``--model-table``)."""
    if catalog is None:
        from tasks.catalog import default_catalog
        catalog = default_catalog()
    models = catalog_models(catalog)[::-1]
    rows = ["| GPU | " + " | ".join(a.repo for a in models) + " |", "|---" * (len(models) + 1) + "|"]
    for label, target in doc_targets():
        cells = []
        for a in models:
            try:
                p = make_plan(target, with_model(workload, a))
                cells.append(p.rung + (f", vLLM TP {p.memory.rollout_tp}" if p.memory.rollout_tp > 1 else ""))
            except PlanError as exc:
                cells.append(f"no: short by {getattr(exc, 'short_mib', '?')} MiB")
        rows.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def doc_workload(args=None) -> Workload:
    """The CLI's workload: a box's paths and settings by default (validation on val_small, as
    the training stage plans it: HFRollout's equal chunks must divide the validation rows)."""
    if args is None:
        args = argparse.Namespace(model_path="/opt/verl-lab/models/Qwen--Qwen2.5-0.5B-Instruct",
                                  data_dir="/opt/verl-lab/data/gsm8k", checkpoint_dir="/opt/verl-lab/train/checkpoints",
                                  steps=None, epochs=1, algorithm="auto", model_config=DEFAULT_MODEL_CONFIG,
                                  flash_attn=False, rollout="auto")
    return Workload(model_path=args.model_path or "/opt/verl-lab/models/Qwen--Qwen2.5-0.5B-Instruct",
                    train_files=f"{args.data_dir}/train.parquet",
                    val_files=f"{args.data_dir}/val_small.parquet", checkpoint_dir=args.checkpoint_dir,
                    total_training_steps=args.steps, total_epochs=args.epochs, algorithm=args.algorithm,
                    model_config=load_model_config(args.model_config),
                    flash_attn_installed=args.flash_attn, rollout_engine=args.rollout)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tasks.plan", description=__doc__.split("\n\n")[0])
    ap.add_argument("--doc-table", action="store_true",
                    help="print docs/plan.md's table of plans for its GPU list (no other option needed)")
    ap.add_argument("--model-table", action="store_true",
                    help="print docs/plan.md's table of the catalog's models on its GPU list")
    ap.add_argument("--gpu-name")
    ap.add_argument("--compute-capability", help="e.g. 8.6")
    ap.add_argument("--gpu-memory-mib", type=int)
    ap.add_argument("--gpus", type=int, default=1)
    ap.add_argument("--nodes", type=int, default=1, help="boxes of this GPU in one Ray cluster (docs/cluster.md)")
    ap.add_argument("--model", help="a model of files/catalog.toml, by artifact name or Hugging Face repo "
                                    "(e.g. Qwen/Qwen2.5-1.5B-Instruct; default: Qwen2.5-0.5B-Instruct)")
    ap.add_argument("--model-config", type=Path, default=DEFAULT_MODEL_CONFIG,
                    help="the shape of a model outside the catalog (its config.json)")
    ap.add_argument("--model-path", help="default: /opt/verl-lab/models/<owner>--<name> of the model")
    ap.add_argument("--data-dir", default="/opt/verl-lab/data/gsm8k")
    ap.add_argument("--checkpoint-dir", default="/opt/verl-lab/train/checkpoints")
    ap.add_argument("--steps", type=int, help="a step cap (default: --epochs over GSM8K's train split)")
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--algorithm", choices=ALGORITHMS, default="auto", help="auto: the fallback ladder")
    ap.add_argument("--flash-attn", action="store_true", help="flash-attn is installed in the env")
    ap.add_argument("--rollout", choices=ROLLOUT_ENGINES, default="auto",
                    help="workload.rollout: auto (vLLM where the GPU runs it), vllm, or hf (the HF rollout)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.doc_table or args.model_table:
        print(gpu_table(doc_workload()) if args.doc_table else model_table(doc_workload()))
        return 0
    missing = [f"--{k.replace('_', '-')}" for k in ("gpu_name", "compute_capability", "gpu_memory_mib")
               if getattr(args, k) is None]
    if missing:
        ap.error(f"the following arguments are required: {', '.join(missing)} (or --doc-table)")
    try:
        gpu = GpuTarget(args.gpu_name, args.compute_capability, args.gpu_memory_mib, args.gpus)
        gpu.cc
    except ValueError:
        ap.error(f"--compute-capability {args.compute_capability!r} is not like 8.6")
    from tasks.catalog import default_catalog

    catalog = default_catalog()
    artifact = catalog.model(args.model or "qwen_model")
    if artifact is None:
        ap.error(f"--model {args.model!r} is not a model of files/catalog.toml: use one of "
                 + ", ".join(a.repo for a in catalog_models(catalog)))
    model = artifact.name
    workload = doc_workload(args)
    if args.model or args.model_config == DEFAULT_MODEL_CONFIG:
        workload = with_model(workload, artifact, args.model_path or f"/opt/verl-lab/models/{artifact.repo.replace('/', '--')}")
    try:
        if args.nodes > 1:          # a uniform Ray cluster of this GPU
            plan = plan_naming_models_that_fit(
                lambda w: cluster_plan({f"node{i + 1}": gpu for i in range(args.nodes)}, w), workload, catalog, model)
        else:
            plan = plan_naming_models_that_fit(lambda w: make_plan(gpu, w), workload, catalog, model)
    except PlanError as exc:
        print(f"no plan: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(plan.to_dict(), indent=2) if args.json else _table(plan))
    return 0


if __name__ == "__main__":
    sys.exit(main())
