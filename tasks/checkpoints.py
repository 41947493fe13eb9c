"""Checkpoints: the bytes of one verl 0.5.0 save for a plan's rung, how many saves are kept and
how often, and the disk that needs (pure).

What a save writes, read in verl 0.5.0 (``verl/trainer/ppo/ray_trainer.py`` ``_save_checkpoint``,
``verl/utils/checkpoint/fsdp_checkpoint_manager.py`` ``save_checkpoint``): per role (the actor;
the critic on PPO; the reference model is never saved), every rank writes
``model_world_size_W_rank_r.pt`` (``model.state_dict()`` under FSDP's SHARDED_STATE_DICT),
``optim_world_size_W_rank_r.pt`` (``optimizer.state_dict()``: AdamW's ``exp_avg`` and
``exp_avg_sq`` in the params' dtype and a ``step`` per param) and ``extra_state_...`` (LR scheduler
and RNG states); rank 0 writes ``huggingface/`` (config, generation config, tokenizer files) and
``fsdp_config.json``; the trainer adds ``data.pt`` (the dataloader's state).

The layouts differ, as torch's code and a CPU run of verl's own manager show
(tests/unit/test_checkpoints.py):

* FSDP1 (``strategy=fsdp``): each parameter name becomes its own chunk of the full tensor
  (torch ``_state_dict_utils._sharded_post_state_dict_hook``: ``tensor.chunk(world_size)[rank]
  .clone()``), shared ones included (``FlatParamHandle.param_module_names`` chains
  ``_shared_param_infos``): a model with tied embeddings (Qwen2.5's ``lm_head`` is
  ``embed_tokens``) stores the embedding twice. The optimizer holds one state per flat
  parameter (one per wrapped module), the shared embedding once.
* FSDP2 (``strategy=fsdp2``, the CPU-offload rung): a DTensor per parameter, sharded on dim 0;
  tied weights are one parameter and are stored once; one optimizer state per parameter.

The export (verl's ``model_merger``, ``verl/model_merger/fsdp_model_merger.py``) casts every
tensor to bf16 and saves with ``save_pretrained``; its ``lm_head`` is a separate tensor there,
so a tied model's export carries the embedding twice too (measured on CPU).

The export's host RAM (``export_host_ram``), the higher of its two processes (run one after the
other): verl 0.5.0's merger (``FSDPModelMerger.merge_and_save``) loads rank 0's model file, keeps
it to the end, and loads every rank's file again (``_load_and_merge_state_dicts``), then casts
each tensor to bf16 while popping the fp32 one; ``save_hf_model_and_tokenizer`` makes the model
with ``to_empty`` (its parameters in bf16, a tied one once) and saves it with the merged bf16 state
dict, ``save_pretrained`` serializing (counted as one more bf16 copy). Its peak: rank 0's file +
the larger of (every rank's file) and (merged bf16 + the empty model + the copy). The proof
(verl_lab_box/export.py ``prove``) holds one fp32 copy of the weights rebuilt from the shards,
an fp32 model (on the GPU when training has released it, else in host RAM) and the tensors
compared at once (the largest three times: the stored one, its cast, the difference). Each
process adds ``PROCESS_BASE_BYTES`` (Python, torch, transformers).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from tasks.memory import ModelShape
from verl_lab_box.checkpoints import gib

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
# Measured on CPU with verl 0.5.0's FSDPCheckpointManager (torch's pickled metadata per entry:
# 490-790 B per model key, about 1.2 KiB per optimizer state), rounded up.
MODEL_ENTRY_BYTES = 1024
OPTIM_ENTRY_BYTES = 1536
EXTRA_STATE_BYTES = 16 * 1024       # LR scheduler and RNG states: 14.9 KB on CPU, + the CUDA RNG state
DATA_STATE_BYTES = 8 * 1024         # data.pt: the dataloader's state
SAFETENSORS_ENTRY_BYTES = 160       # a safetensors header entry (name, dtype, shape, offsets)
FSDP_CONFIG_BYTES = 64              # fsdp_config.json
DEFAULT_KEEP, DEFAULT_EVERY = 1, 10
# A process with torch and transformers imported, before any tensor: 324 MiB measured with the CPU
# torch here (tests' env); CUDA's libraries and context add to it on a GPU box, so 1 GiB is allowed.
PROCESS_BASE_BYTES = 2 ** 30
MiB = 2 ** 20


@dataclass(frozen=True)
class RoleSave:
    """One role's files in one save: each rank's model, optimizer and extra state files, and what
    rank 0 adds (``huggingface/`` and ``fsdp_config.json``)."""

    role: str                     # "actor" | "critic"
    layout: str                   # "fsdp" | "fsdp2"
    model_bytes: tuple[int, ...]  # per rank
    optim_bytes: tuple[int, ...]  # per rank
    extra_bytes: int              # per rank
    rank0_bytes: int              # huggingface/ and fsdp_config.json

    def rank_bytes(self, rank: int) -> int:
        return self.model_bytes[rank] + self.optim_bytes[rank] + self.extra_bytes + (self.rank0_bytes if rank == 0 else 0)

    @property
    def total_bytes(self) -> int:
        return sum(self.rank_bytes(r) for r in range(len(self.model_bytes)))


@dataclass(frozen=True)
class SavePrediction:
    """The bytes of one save (``global_step_N/``) for every rank of a run."""

    world_size: int
    roles: tuple[RoleSave, ...]
    data_bytes: int = DATA_STATE_BYTES

    @property
    def total_bytes(self) -> int:
        return sum(r.total_bytes for r in self.roles) + self.data_bytes

    @property
    def rank_bytes(self) -> int:
        """The largest rank's files (rank 0's shards, without what only rank 0 writes)."""
        return max(sum(r.model_bytes[i] + r.optim_bytes[i] + r.extra_bytes for r in self.roles)
                   for i in range(self.world_size))

    def box_bytes(self, gpus: int) -> int:
        """What one box of ``gpus`` ranks writes (each node saves its own ranks' shards on its own
        disk): its ranks' files, and what rank 0 writes (counted on every box)."""
        return self.rank_bytes * min(gpus, self.world_size) + sum(r.rank0_bytes for r in self.roles) + self.data_bytes

    def to_dict(self) -> dict[str, Any]:
        return {"world_size": self.world_size, "total_bytes": self.total_bytes, "rank_bytes": self.rank_bytes,
                "data_bytes": self.data_bytes,
                "roles": {r.role: {"layout": r.layout, "model_bytes_rank0": r.model_bytes[0],
                                   "optim_bytes_rank0": r.optim_bytes[0], "extra_bytes_per_rank": r.extra_bytes,
                                   "huggingface_bytes": r.rank0_bytes, "bytes": r.total_bytes} for r in self.roles}}


def tensors(shape: ModelShape, role: str) -> list[tuple[str, tuple[int, ...]]]:
    """The parameters of a Qwen2/Llama-style model by name and shape, as its state dict names them:
    the causal LM (``lm_head`` listed even where it is tied) or the token-classification critic."""
    h, q, kv, f = shape.hidden, shape.q_dim, shape.kv_dim, shape.ffn
    out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (shape.vocab, h))]
    for i in range(shape.layers):
        p = f"model.layers.{i}."
        out += [(p + "self_attn.q_proj.weight", (q, h)), (p + "self_attn.k_proj.weight", (kv, h)),
                (p + "self_attn.v_proj.weight", (kv, h)), (p + "self_attn.o_proj.weight", (h, q))]
        if shape.qkv_bias:
            out += [(p + "self_attn.q_proj.bias", (q,)), (p + "self_attn.k_proj.bias", (kv,)),
                    (p + "self_attn.v_proj.bias", (kv,))]
        out += [(p + "mlp.gate_proj.weight", (f, h)), (p + "mlp.up_proj.weight", (f, h)),
                (p + "mlp.down_proj.weight", (h, f)), (p + "input_layernorm.weight", (h,)),
                (p + "post_attention_layernorm.weight", (h,))]
    out.append(("model.norm.weight", (h,)))
    if role == "critic":
        return out + [("score.weight", (1, h)), ("score.bias", (1,))]
    return out + [("lm_head.weight", (shape.vocab, h))]


def numel(dims: Iterable[int]) -> int:
    n = 1
    for d in dims:
        n *= d
    return n


def chunk_rows(rows: int, world_size: int, rank: int) -> int:
    """Rows of dim 0 that ``torch.chunk(world_size)`` gives ``rank`` (FSDP1's and DTensor's split)."""
    size = -(-rows // world_size)
    return max(0, min(size, rows - rank * size))


def shard_numel(dims: tuple[int, ...], world_size: int, rank: int) -> int:
    return chunk_rows(dims[0], world_size, rank) * numel(dims[1:])


LORA_CONFIG_BYTES = 1024           # lora_adapter/adapter_config.json (PEFT's LoraConfig as JSON): under 1 KiB


def lora_tensors(shape: ModelShape, rank: int, targets: Iterable[str]) -> list[tuple[str, tuple[int, ...]]]:
    """PEFT's adapter tensors (lora_A: rank x in, lora_B: out x rank) of every targeted layer."""
    from tasks.memory.lora import module_dims

    dims = module_dims(shape)
    return [(f"model.layers.{i}.{m}.lora_{ab}", (rank, dims[m][0]) if ab == "A" else (dims[m][1], rank))
            for i in range(shape.layers) for m in targets for ab in "AB"]


def role_save(shape: ModelShape, role: str, layout: str, world_size: int, param_bytes: int,
              side_files_bytes: int, adapter: list[tuple[str, tuple[int, ...]]] | None = None) -> RoleSave:
    """One role's files per rank, for the FSDP1 (``fsdp``) or FSDP2 (``fsdp2``) layout; ``adapter``: the
    actor's LoRA tensors (fp32; the base, in ``param_bytes``, then has no optimizer state)."""
    if adapter:
        base = role_save(shape, role, layout, world_size, param_bytes, side_files_bytes)
        model = tuple(m + sum(shard_numel(d, world_size, r) for _, d in adapter) * DTYPE_BYTES["fp32"]
                      + len(adapter) * MODEL_ENTRY_BYTES for r, m in enumerate(base.model_bytes))
        optim = tuple(sum(-(-numel(d) // world_size) for _, d in adapter) * 2 * DTYPE_BYTES["fp32"]
                      + len(adapter) * OPTIM_ENTRY_BYTES for _ in range(world_size))
        folder = sum(numel(d) for _, d in adapter) * DTYPE_BYTES["fp32"] + len(adapter) * SAFETENSORS_ENTRY_BYTES \
            + LORA_CONFIG_BYTES
        return RoleSave(role=role, layout=layout, model_bytes=model, optim_bytes=optim, extra_bytes=base.extra_bytes,
                        rank0_bytes=base.rank0_bytes + folder)
    named = tensors(shape, role)
    tied = role == "actor" and shape.tied_embeddings
    unique = [(n, d) for n, d in named if not (tied and n == "lm_head.weight")]
    # model: FSDP1 chunks every name (the tied lm_head too); FSDP2 stores a tied weight once
    stored = named if layout == "fsdp" else unique
    model = tuple(sum(shard_numel(d, world_size, r) for _, d in stored) * param_bytes
                  + len(named) * MODEL_ENTRY_BYTES for r in range(world_size))
    if layout == "fsdp":
        # one flat parameter per wrapped decoder layer and one for the root (embedding, final
        # norm, the head where untied), each padded to a multiple of the world size
        layer = numel_of(unique, ".layers.0.")
        units = [layer] * shape.layers + [sum(numel(d) for n, d in unique if ".layers." not in n)]
        optim = tuple(sum(-(-u // world_size) for u in units) * 2 * param_bytes
                      + len(units) * OPTIM_ENTRY_BYTES for _ in range(world_size))
    else:
        optim = tuple(sum(shard_numel(d, world_size, r) for _, d in unique) * 2 * param_bytes
                      + len(unique) * OPTIM_ENTRY_BYTES for r in range(world_size))
    return RoleSave(role=role, layout=layout, model_bytes=model, optim_bytes=optim, extra_bytes=EXTRA_STATE_BYTES,
                    rank0_bytes=side_files_bytes + FSDP_CONFIG_BYTES)


def numel_of(named: list[tuple[str, tuple[int, ...]]], part: str) -> int:
    return sum(numel(d) for n, d in named if part in n)


def predict_save(shape: ModelShape, *, critic: bool, actor_layout: str, world_size: int, param_bytes: int,
                 side_files_bytes: int, adapter: list[tuple[str, tuple[int, ...]]] | None = None,
                 actor_param_bytes: int | None = None) -> SavePrediction:
    """The bytes of one save: the actor in ``actor_layout`` (with LoRA: its base in ``actor_param_bytes`` and
    ``adapter``), the critic (PPO) on FSDP1."""
    roles = [role_save(shape, "actor", actor_layout, world_size, actor_param_bytes or param_bytes, side_files_bytes,
                       adapter)]
    if critic:
        roles.append(role_save(shape, "critic", "fsdp", world_size, param_bytes, side_files_bytes))
    return SavePrediction(world_size=world_size, roles=tuple(roles))


def predict_export(shape: ModelShape, side_files_bytes: int) -> int:
    """The exported Hugging Face folder: every tensor in bf16 (the tied ``lm_head`` as its own),
    safetensors' header, and the config and tokenizer files."""
    named = tensors(shape, "actor")
    return sum(numel(d) for _, d in named) * DTYPE_BYTES["bf16"] + len(named) * SAFETENSORS_ENTRY_BYTES + side_files_bytes


@dataclass(frozen=True)
class ExportRam:
    """The host RAM of the export's two processes (bytes), and the need: the higher peak."""

    merge_bytes: int              # verl's model merger
    proof_model_on_gpu_bytes: int  # the proof, its fp32 model on the GPU (training has released it)
    proof_model_on_cpu_bytes: int  # the proof, its fp32 model in host RAM (the GPU busy, or none)

    def need_bytes(self, gpu_free: bool) -> int:
        return max(self.merge_bytes, self.proof_model_on_gpu_bytes if gpu_free else self.proof_model_on_cpu_bytes)

    def launch(self) -> dict[str, int]:
        """plan.json's ``launch.checkpoints.export_host_ram`` (MiB, rounded up)."""
        up = lambda b: -(-b // MiB)  # noqa: E731
        return {"merge_mib": up(self.merge_bytes), "proof_model_on_gpu_mib": up(self.proof_model_on_gpu_bytes),
                "proof_model_on_cpu_mib": up(self.proof_model_on_cpu_bytes),
                "gpu_free_mib": up(self.need_bytes(True)), "gpu_busy_mib": up(self.need_bytes(False))}


def export_host_ram(shape: ModelShape, actor: RoleSave, param_bytes: int) -> ExportRam:
    """The host RAM the export of ``actor``'s save needs (the module's docstring: what each holds)."""
    named = tensors(shape, "actor")
    every = sum(numel(d) for _, d in named)            # the tied head as its own name
    largest = max(numel(d) for _, d in named)
    shards, rank0 = sum(actor.model_bytes), actor.model_bytes[0]
    bf16 = every * DTYPE_BYTES["bf16"]
    empty_model = shape.params("actor") * DTYPE_BYTES["bf16"]
    merge = rank0 + max(shards, bf16 + empty_model + bf16) + PROCESS_BASE_BYTES
    proof = every * param_bytes + 3 * largest * 4 + PROCESS_BASE_BYTES
    return ExportRam(merge_bytes=merge, proof_model_on_gpu_bytes=proof,
                     proof_model_on_cpu_bytes=proof + shape.params("actor") * 4)


def saves_in_run(every: int, total_steps: int | None) -> int | None:
    """How many saves a run of ``total_steps`` makes (verl saves every ``every`` steps and at the
    last); None where the run's length is not known before the data is read (epochs)."""
    if total_steps is None:
        return None
    return total_steps // every + (1 if total_steps % every else 0)


@dataclass(frozen=True)
class CheckpointPlan:
    """How a run's saves are sized, kept and made, and the disk that needs."""

    save: SavePrediction
    keep: int                     # whole saves kept at any time, also while the next is written
    every: int                    # trainer.save_freq
    export_bytes: int
    total_steps: int | None = None
    critic: bool = True
    reasons: tuple[tuple[str, Any, str], ...] = field(default=(), compare=False)
    export_ram: ExportRam | None = None

    @property
    def max_to_keep(self) -> int:
        """verl's max_*_ckpt_to_keep: it removes the oldest before it writes, so the save being
        written is one of them."""
        return self.keep + 1

    @property
    def saves_in_run(self) -> int | None:
        return saves_in_run(self.every, self.total_steps)

    def gather_bytes(self, gpus: int) -> int:
        """On a Ray cluster's head (``gpus`` ranks a node, fewer than the world): the other nodes' actor model
        shards of the last save, copied beside its own for the export (verl_lab_box/cluster_gather.py). Every
        member gets the one cluster plan, so every member's disk is asked for it. 0 on a box alone."""
        return max(self.save.roles[0].model_bytes) * max(0, self.save.world_size - gpus)

    def disk_bytes(self, gpus: int) -> int:
        """Saves and export on a box of ``gpus`` GPUs when no earlier save is there (before margin)."""
        n = min(self.max_to_keep, self.saves_in_run or self.max_to_keep)
        return n * self.save.box_bytes(gpus) + self.export_bytes + self.gather_bytes(gpus)

    def launch(self, checkpoint_dir: str, gpus: int) -> dict[str, Any]:
        """plan.json's launch section entry: what the launcher's disk check reads (``export_bytes``: what the
        export needs on this disk, a cluster's gathered shards included)."""
        return {"dir": checkpoint_dir, "save_bytes": self.save.box_bytes(gpus), "max_saves": self.max_to_keep,
                "keep": self.keep, "every": self.every, "export_bytes": self.export_bytes + self.gather_bytes(gpus),
                "gather_bytes": self.gather_bytes(gpus),
                "saves_in_run": self.saves_in_run, "last_step": self.total_steps,
                "export_host_ram": self.export_ram.launch() if self.export_ram else None}

    def to_dict(self, gpus: int) -> dict[str, Any]:
        return {"save": self.save.to_dict(), "save_bytes_this_box": self.save.box_bytes(gpus), "keep": self.keep,
                "max_ckpt_to_keep": self.max_to_keep, "save_freq": self.every, "saves_in_run": self.saves_in_run,
                "export_bytes": self.export_bytes, "gather_bytes_this_box": self.gather_bytes(gpus),
                "disk_bytes_this_box": self.disk_bytes(gpus),
                "export_host_ram": self.export_ram.launch() if self.export_ram else None}


def plan_checkpoints(shape: ModelShape, *, critic: bool, actor_layout: str, world_size: int, param_dtype: str,
                     side_files_bytes: int, keep: int = DEFAULT_KEEP, every: int = DEFAULT_EVERY,
                     total_steps: int | None = None) -> CheckpointPlan:
    """The plan's checkpoints: the predicted save, what is kept, how often, and why."""
    if keep < 1 or every < 1:
        raise ValueError(f"checkpoints keep and every must be >= 1, not {keep} and {every}")
    every = min(every, total_steps) if total_steps else every
    save = predict_save(shape, critic=critic, actor_layout=actor_layout, world_size=world_size,
                        param_bytes=DTYPE_BYTES[param_dtype], side_files_bytes=side_files_bytes)
    export = predict_export(shape, side_files_bytes)
    ram = export_host_ram(shape, save.roles[0], DTYPE_BYTES[param_dtype])
    roles = " and the critic (FSDP1)" if critic else " (GRPO: no critic; the reference model is never saved)"
    reasons = (
        ("checkpoint_bytes", f"{gib(save.total_bytes)} ({save.total_bytes} B)",
         f"one save: the actor ({'FSDP2: tied weights once' if actor_layout == 'fsdp2' else 'FSDP1: each name its own chunk, a tied embedding twice'})"
         f"{roles}, each with {param_dtype} params and AdamW's two {param_dtype} states over {world_size} rank(s), "
         "LR scheduler and RNG states, rank 0's config and tokenizer files"),
        ("checkpoint_keep", keep,
         f"whole saves kept at any time (setting checkpoints.keep): verl 0.5.0 removes the oldest before it writes "
         f"the next, so max_actor_ckpt_to_keep = keep + 1 = {keep + 1} leaves {keep} whole while one is written "
         "(with 1, verl deletes the only save before writing the next: a run that dies then restarts from the "
         "tracker's step, finds its folder emptied, fails to load and restarts again, in a loop)"),
        ("save_freq", every, "a save every this many steps and at the last (setting checkpoints.every; the step "
                             "cap bounds it); validation runs at each save"),
        ("export_bytes", f"{gib(export)} ({export} B)", "the exported model: every tensor in bf16 (the tied head as its own), config and "
                                 "tokenizer files; an export whose save verl removed is pruned with it"),
        ("export_host_ram", f"{gib(ram.need_bytes(True))} ({gib(ram.need_bytes(False))} beside training)",
         f"the export's peak host RAM, checked against MemAvailable before it starts: verl's merger "
         f"{gib(ram.merge_bytes)} (rank 0's shard kept, every shard, the bf16 model saved), the proof "
         f"{gib(ram.proof_model_on_gpu_bytes)} (the weights in {param_dtype}, the tensors compared; + "
         f"{gib(ram.proof_model_on_cpu_bytes - ram.proof_model_on_gpu_bytes)} for its fp32 model where training holds "
         "the GPU)"),
    )
    return CheckpointPlan(save=save, keep=keep, every=every, export_bytes=export, total_steps=total_steps,
                          critic=critic, reasons=reasons, export_ram=ram)


def retention_overrides(cp: CheckpointPlan) -> list[tuple[str, Any, str]]:
    """verl's own keys for saving and keeping: (key, value, why)."""
    out = [("trainer.save_freq", cp.every, "checkpoint often enough that a restart loses little "
                                           "(setting checkpoints.every)"),
           ("trainer.test_freq", cp.every, "validate at each checkpoint"),
           ("trainer.max_actor_ckpt_to_keep", cp.max_to_keep,
            f"{cp.keep} whole save(s) kept + the one being written (verl removes the oldest before it writes; "
            "setting checkpoints.keep)")]
    if cp.critic:
        out.append(("trainer.max_critic_ckpt_to_keep", cp.max_to_keep, "as the actor's: a save is resumed as a whole"))
    return out


def side_files_bytes(files: Mapping[str, Mapping[str, Any]] | None) -> int:
    """The catalog's sizes of a model's files other than its weights (config, generation config,
    tokenizer): what verl's save writes into ``huggingface/`` and the export beside the weights."""
    weights = (".safetensors", ".bin", ".pt", ".safetensors.index.json", ".bin.index.json")
    return sum(int(f.get("size") or 0) for name, f in (files or {}).items() if not name.endswith(weights))


def predicted_save_bytes(plan: Mapping[str, Any]) -> int:
    """The predicted bytes of one save (every rank, every role) of a run's plan.json, for the GPU
    harness to compare with the size of a ``global_step_N`` folder."""
    return int(plan["checkpoints"]["save"]["total_bytes"])


def plan_lora_checkpoints(shape: ModelShape, *, lora_rank: int, lora_targets: Iterable[str], base_dtype: str,
                          critic: bool, actor_layout: str, world_size: int, param_dtype: str, side_files_bytes: int,
                          **kw: Any) -> CheckpointPlan:
    """``plan_checkpoints`` for an actor training LoRA adapters on ``lora_targets`` over a frozen base in
    ``base_dtype``. What such a save holds, read in verl 0.5.0 (``fsdp_workers.py`` ``save_checkpoint``,
    ``utils/fsdp_utils.py`` ``get_fsdp_wrap_policy(is_lora=True)``) and peft 0.16.0: the actor's model file is the
    PEFT model's state dict, the frozen base in its ``model_dtype`` and every adapter tensor in fp32 (peft keeps
    adapters in fp32); its optimizer file holds AdamW's states of the adapters alone (the frozen flat parameters get
    no gradient, so no state; FSDP1 wraps every LoRA layer as its own unit); rank 0 also writes ``lora_adapter/``
    (``adapter_model.safetensors`` in fp32 and ``adapter_config.json``). The export adds the adapter alone, in
    PEFT's format (fp32), to the merged model."""
    from dataclasses import replace

    cp = plan_checkpoints(shape, critic=critic, actor_layout=actor_layout, world_size=world_size,
                          param_dtype=param_dtype, side_files_bytes=side_files_bytes, **kw)
    adapter = lora_tensors(shape, lora_rank, lora_targets)
    save = predict_save(shape, critic=critic, actor_layout=actor_layout, world_size=world_size,
                        param_bytes=DTYPE_BYTES[param_dtype], side_files_bytes=side_files_bytes, adapter=adapter,
                        actor_param_bytes=DTYPE_BYTES[base_dtype])
    alone = sum(numel(d) for _, d in adapter) * DTYPE_BYTES["fp32"] + len(adapter) * SAFETENSORS_ENTRY_BYTES \
        + LORA_CONFIG_BYTES
    export = cp.export_bytes + alone
    why = {
        "checkpoint_bytes": (f"{gib(save.total_bytes)} ({save.total_bytes} B)",
                             f"one save: the actor (FSDP1: each name its own chunk, a tied embedding twice) with LoRA: "
                             f"its frozen base in {base_dtype}, its rank-{lora_rank} adapters in fp32 with AdamW's "
                             "states of the adapters alone, and lora_adapter/ (the adapters again, fp32)"
                             + (f"; the critic with {param_dtype} params and AdamW's two {param_dtype} states"
                                if critic else " (GRPO: no critic; the reference model is never saved)")
                             + f", over {world_size} rank(s), LR scheduler and RNG states, rank 0's config and "
                             "tokenizer files"),
        "export_bytes": (f"{gib(export)} ({export} B)", "the exported model: every tensor in bf16 (the adapter merged "
                         "into it; the tied head as its own), config and tokenizer files, and the adapter alone in "
                         "PEFT's format (fp32)"),
    }
    reasons = tuple((name, *why[name]) if name in why else (name, value, text) for name, value, text in cp.reasons)
    return replace(cp, save=save, export_bytes=export, reasons=reasons)

