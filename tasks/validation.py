"""Everything a user can get wrong about a host, checked before any operation changes a box.

Two moments share this module (docs/architecture.md, "On the controller, at prepare time"):

* **the inventory pass** (``tasks.hostdata.check_inventory``, hooked into pyinfra's State.init by
  config.py: before pyinfra connects to anything): every host's settings (``tasks.settings``), the
  clusters across hosts (``tasks.settings.check_clusters``), the data stage's plan (``data_plan``:
  the catalog's model and dataset), and, for every host whose GPU is known from host data
  (``gpu_override``; a cluster whose every member has one), the training plan: which GPUs the
  stack runs (``tasks.gpu_support``), the fit, the engine, verl 0.5.0's own rules
  (``tasks.verl.rules``). Every problem of every host at once; nothing runs when there is one.
* **the first fact-gathering pass** (``tasks.base.base_layout``): for a box whose GPU is known
  only from its nvidia-smi, the same plan from the GPU fact, before the base stage queues any
  operation. A box whose plan cannot exist gets only its failure queued (``HostTarget.refused``):
  no user, folder, download or env build; the other boxes go on.

``training_plan`` is the plan the training stage places, made the same way here, so what was
checked is what gets deployed.
"""

from __future__ import annotations

from collections.abc import Mapping

from tasks.data import data_plan
from tasks.plan import (
    GpuTarget,
    PlanError,
    TrainingPlan,
    cluster_plan,
    make_plan,
    plan_naming_models_that_fit,
    workload_for,
)
from tasks.settings import LabSettings, SettingsError

GPU_KEYS = {"gpu_override": "gpu_override", "nvidia-smi": "GPU (nvidia-smi)", "none": "GPU (nvidia-smi)"}


def training_plan(settings: LabSettings, target: GpuTarget,
                  cluster_targets: Mapping[str, GpuTarget] | None = None,
                  flash_attn_installed: bool = False) -> TrainingPlan:
    """The host's training plan (alone, or by the weakest GPU of its cluster); PlanError where none
    exists, naming the catalog's models that would fit where the model is what does not."""
    workload = workload_for(settings, flash_attn_installed)
    if cluster_targets:
        plan_of = lambda w: cluster_plan(cluster_targets, w)  # noqa: E731
    else:
        plan_of = lambda w: make_plan(target, w)  # noqa: E731
    return plan_naming_models_that_fit(plan_of, workload, settings.catalog, settings.model_artifact)


def plan_problem(settings: LabSettings, target: GpuTarget | None, source: str, problem: str | None = None,
                 cluster_targets: Mapping[str, GpuTarget | None] | None = None) -> SettingsError | None:
    """Why ``settings.host`` cannot train on ``target`` (from ``source``: gpu_override or
    nvidia-smi), as a SettingsError (host, key, reason, fix); None where its plan exists."""
    gpu_key = GPU_KEYS.get(source, source)
    if target is None:
        return SettingsError(settings.host, gpu_key, problem or "no GPU to plan for",
                             'set host data gpu_override = {"name": ..., "compute_capability": ..., '
                             '"memory_mib": ..., "count": 1} to plan for a GPU the box does not have')
    missing = sorted(name for name, t in (cluster_targets or {}).items() if t is None)
    if missing:
        return SettingsError(settings.host, "cluster", f"no GPU target on {', '.join(missing)}, a member of its "
                             "cluster: the cluster's plan needs every member's GPU",
                             f"fix {', '.join(missing)} first (its own problem says how)")
    try:
        training_plan(settings, target, cluster_targets)
    except PlanError as exc:
        key = gpu_key if exc.key == "gpu" else exc.key
        return SettingsError(settings.host, key, f"{_gpu_words(target, source, cluster_targets)}: "
                             f"{exc.reason.rstrip('.')}", (exc.fix or "see docs/plan.md").rstrip("."))
    return None


def _gpu_words(target: GpuTarget, source: str, cluster_targets: Mapping[str, GpuTarget] | None = None) -> str:
    def one(t: GpuTarget) -> str:
        return f"{t.count} x {t.name} (compute capability {t.compute_capability}, {t.memory_mib} MiB"
    if cluster_targets:
        return "its cluster's GPUs (" + "; ".join(f"{h}: {one(t)})" for h, t in sorted(cluster_targets.items())) \
            + f", from {source})"
    return f"{one(target)}, from {source})"


def override_target(settings: LabSettings) -> GpuTarget | None:
    """The GPU target host data gives (``gpu_override``), or None: only the box knows."""
    o = settings.gpu_override
    return GpuTarget(o["name"], o["compute_capability"], o["memory_mib"], o.get("count", 1)) if o else None


def inventory_problems(settings: Mapping[str, LabSettings], clusters: Mapping[str, object]) -> list[SettingsError]:
    """The inventory pass beyond each host's settings: the data stage's plan of every host, and the
    training plan of every host whose GPU host data gives (a cluster member only where every member's
    does: the cluster plans by its weakest GPU)."""
    problems: list[SettingsError] = []
    in_cluster = {member: c for c in clusters.values() for member in c.members}
    for host, s in sorted(settings.items()):
        try:
            data_plan(s)
        except SettingsError as exc:
            problems += exc.problems
        target = override_target(s)
        if target is None:
            continue                # its GPU is known on the box only: decided at its first fact pass
        cluster = in_cluster.get(host)
        members = None
        if cluster is not None:
            members = {m: override_target(settings[m]) if m in settings else None for m in cluster.members}
            if any(t is None for t in members.values()):
                continue            # the others' GPUs come from their boxes: decided at the fact pass
        found = plan_problem(s, target, "gpu_override", cluster_targets=members)
        if found:
            problems.append(found)
    return problems
