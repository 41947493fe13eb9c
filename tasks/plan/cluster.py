"""The plan of a Ray cluster of boxes (docs/cluster.md): ``make_plan`` for the weakest GPU among
its members (``weakest_gpu``: the lowest compute capability, the smallest memory, the smallest
count) at the cluster's world size, then verl's node split (``cluster_plan``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from tasks.plan.rungs import make_plan
from tasks.plan.terms import GpuTarget, Reason, TrainingPlan, Workload
from tasks.verl import Override


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
