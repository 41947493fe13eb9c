"""``python -m tasks.plan``: the plan of a GPU, or of a uniform Ray cluster of N boxes of it
(``--nodes``), as a table or as JSON (``--json``), for the default model or a catalog one
(``--model``), fully fine-tuned or with LoRA (``--finetune``); ``--doc-table`` and ``--model-table`` print
docs/plan.md's tables."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from tasks.plan.cluster import cluster_plan
from tasks.plan.doc_tables import doc_workload, gpu_table, model_table
from tasks.plan.lora import FINETUNES
from tasks.plan.precision import ROLLOUT_ENGINES
from tasks.plan.rungs import ALGORITHMS, make_plan
from tasks.plan.terms import GpuTarget, PlanError, TrainingPlan
from tasks.plan.workload import DEFAULT_MODEL_CONFIG, catalog_models, plan_naming_models_that_fit, with_model

DESCRIPTION = "The training plan: which verl 0.5.0 settings a box's GPU gets, and why."


def _table(plan: TrainingPlan) -> str:
    d = plan.to_dict()
    lines = [f"Plan for {plan.gpu.count} x {plan.gpu.name} (compute capability {plan.gpu.compute_capability}, "
             f"{plan.gpu.memory_mib} MiB), verl {plan.verl_version}",
             f"rung {plan.rung}: predicted peak {d['predicted_peak_mib']} MiB of a {d['budget_mib']} MiB budget"
             + (f", {d['predicted_host_ram_mib']} MiB of host RAM" if d["predicted_host_ram_mib"] else ""), ""]
    width = max(len(r.setting) for r in plan.reasons)
    for r in plan.reasons:
        lines.append(f"  {r.setting:<{width}}  {r.value!s:<22}  {r.why}")
    lines += ["", "Overrides:"]
    for o in plan.overrides:
        lines.append(f"  {o.text():<78}  # {o.why}")
    if plan.env:
        lines += ["", "Environment:"] + [f"  {k}={v}" for k, v in plan.env.items()]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tasks.plan", description=DESCRIPTION)
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
    ap.add_argument("--finetune", choices=FINETUNES, default="auto",
                    help="workload.finetune: auto (LoRA where full fine-tuning would need the CPU-offload rung), full "
                         "(every weight) or lora (adapters only): run it with full and with lora to see a card's two "
                         "plans side by side")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--burnin", type=Path, metavar="BURNIN_JSON",
                    help="a box's burn-in record (<train_dir>/burnin/burnin.json, or the controller cache's burnin/<host>"
                         ".json): its measured figures beside the plan's, and what to change (docs/burnin.md)")
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
        _ = gpu.cc                       # its compute capability parsed: ValueError where it is not like 8.6
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
        workload = with_model(workload, artifact, args.model_path or f"/opt/verl-lab/models/{(artifact.repo or model).replace('/', '--')}")
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
    if args.burnin:
        from tasks.burnin.hearing import hearing_words

        try:
            record = json.loads(args.burnin.read_text())
        except (OSError, ValueError) as exc:
            print(f"--burnin {args.burnin}: cannot read a burn-in record ({exc})", file=sys.stderr)
            return 2
        print("\n" + hearing_words(record, plan.to_dict()))
    return 0
