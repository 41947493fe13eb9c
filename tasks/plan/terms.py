"""What a plan is made of: the GPU it is for (``GpuTarget``; a box of mixed models is planned for
its weakest), the workload it trains (``Workload``), the choices it makes (``Precision``,
``MemoryChoice``), what the memory estimate says of a choice (``MemoryEstimate``), a reason per
setting (``Reason``), the plan (``TrainingPlan``: its ``to_dict`` is plan.json's plan) and
``PlanError``. Also the names of the offload settings (``OFFLOAD_LADDER``, ``OFFLOAD_KEYS``,
``OFFLOAD_KNOBS``), which the memory fit, the overrides and the doctor share."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from tasks.checkpoints import DEFAULT_EVERY, DEFAULT_KEEP, CheckpointPlan
from tasks.verl import VERL_VERSION, Override, override_lines
from verl_lab_box.gsm8k import VAL_ROWS

# The offload ladder, in the order the plan escalates (names shared with tasks/doctor/diagnosis.py).
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


class PlanError(ValueError):
    """No plan exists for this GPU and workload. ``reason`` says why (and by how much), ``fix`` what
    to change, ``key`` which setting it is about ("workload", "workload.<key>", "gpu"); ``str()`` is
    the reason, then "Change: " and the fix."""

    short_mib: int      # set only where memory is what is short (tasks/plan/memory_fit.py); hasattr tells

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
    def from_inventory(cls, inventory) -> GpuTarget:
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
    # LoRA (settings workload.finetune, lora_rank, lora_alpha, target_modules; tasks/plan/lora.py)
    finetune: str = "auto"               # "auto": LoRA where full fine-tuning needs CPU offload or does not fit
    lora_rank: int = 32
    lora_alpha: int = 32
    target_modules: str | tuple[str, ...] = "all-linear"
    lora: bool = False                   # this rung trains LoRA adapters on the actor (the ladder sets it)
    val_rows: int = VAL_ROWS             # rows of val_small.parquet (HF chunks must divide them)
    train_rows: int | None = None        # prompts of the train split (verl's dataloader needs a whole batch)
    actor_offload_policy: bool = False   # the actor (and ref) on FSDP2 with CPUOffloadPolicy (RUNGS)
    trackers: tuple[str, ...] = ("console",)   # trainer.logger (settings tracking: tasks/tracking/setting.py)
    project_name: str = "verl-lab"             # trainer.project_name
    run_name: str | None = None                # the trackers' run: <run_name>-<ppo|grpo>; None: experiment_name

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
    workload: Workload                   # the rung's workload (algorithm, batch, lengths)
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
                         "total_epochs", "actor_offload_policy", "finetune", "lora")} if self.workload else None,
            "lora": {"rank": self.workload.lora_rank, "alpha": self.workload.lora_alpha,
                     "target_modules": self.workload.target_modules if isinstance(self.workload.target_modules, str)
                     else list(self.workload.target_modules)} if self.workload and self.workload.lora else None,
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
            # per box: the memory model counts per GPU (each rank's offloaded shard, vLLM's weights asleep, patch
            # 0013's saved shard of the adapted base); a box holds its GPUs' (a Ray node: its own, plan.gpu)
            "predicted_host_ram_mib": int(self.estimate.breakdown.get("host_ram", 0)) * self.gpu.count,
            "predicted_lora_merge_host_mib": int(self.estimate.breakdown.get("lora_merge_host", 0)) * self.gpu.count,
            "budget_mib": self.estimate.budget_mib,
            "breakdown": dict(self.estimate.breakdown),
            "overrides": self.override_lines,
            "override_reasons": [{"override": o.text(), "why": o.why} for o in self.overrides],
            "env": dict(self.env),
            "reasons": [asdict(r) for r in self.reasons],
            **({"checkpoints": self.checkpoints.to_dict(self.gpu.count)} if self.checkpoints else {}),
        }
