"""docs/plan.md's tables, made from the code (tests/unit/test_plan_docs.py fails when the doc
differs): the plan of each GPU of ``DOC_GPUS`` and of a mixed box (``gpu_table``, the CLI's
``--doc-table``), the rung of each catalog model on each (``model_table``, ``--model-table``), and
the CLI's workload (``doc_workload``)."""

from __future__ import annotations

import argparse

from tasks.plan.precision import vllm_engine
from tasks.plan.rungs import make_plan
from tasks.plan.terms import GpuTarget, PlanError, Workload
from tasks.plan.workload import DEFAULT_MODEL_CONFIG, catalog_models, load_model_config, with_model

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
                                  flash_attn=False, rollout="auto", finetune="auto")
    return Workload(model_path=args.model_path or "/opt/verl-lab/models/Qwen--Qwen2.5-0.5B-Instruct",
                    train_files=f"{args.data_dir}/train.parquet",
                    val_files=f"{args.data_dir}/val_small.parquet", checkpoint_dir=args.checkpoint_dir,
                    total_training_steps=args.steps, total_epochs=args.epochs, algorithm=args.algorithm,
                    model_config=load_model_config(args.model_config),
                    flash_attn_installed=args.flash_attn, rollout_engine=args.rollout,
                    finetune=getattr(args, "finetune", "auto"))
