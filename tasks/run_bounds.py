"""Whether a box can carry its plan's run to the end: the host RAM the plan puts there against the box's
memory, and the run's length by the speed model against the stated bound (``max_run_days``); where not, the
faster plan that can (LoRA, a smaller model of the catalog). The run's checks report both (tasks/base.py).

Pure: a ``TrainingPlan`` (tasks/plan/), the box's ``MemTotal``/``MemAvailable`` (tasks/facts/memory.py) and a
function making another plan in, the problem's words out.

* **Host RAM.** What the plan puts in the box's RAM, each against ``MemTotal`` (the most it can ever have:
  more refuses the box) and ``MemAvailable`` now (less than the need warns: other processes hold the rest):
  training's host memory (``predicted_host_ram_mib``, per box: the CPU-offload rung's params, gradients, AdamW
  states and ref, vLLM's weights asleep, and LoRA's host copy of the adapted weights, ``LORA_HOST_COPY``, all
  held at once), then the export after the run (``checkpoints.export_host_ram``: verl's merger and the proof,
  the GPU free).
* **Time.** The speed model's seconds of a step (tasks/speed.py: seconds on the device's H200 box, a ranking
  and not a forecast; a card slower than an H200 takes longer) times the run's steps (``train_steps``, else
  the epochs over the train split): a run longer than ``max_run_days`` is refused. The plan's rollout in vLLM
  is not counted (the speed model leaves it out), so the estimate errs short.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from tasks.plan import PlanError, TrainingPlan

# the key of plan.json's plan under which LoRA's host copy of the adapted weights (patch 0013's merge during
# generation, per box) is stated in MiB (tasks/plan/terms.py); it is also inside ``predicted_host_ram_mib``
LORA_HOST_COPY = "predicted_lora_merge_host_mib"
DAY_S = 86400.0
GIB = 1024


@dataclass(frozen=True)
class RunFit:
    """What the checks say of one plan on one box: refusals (``problems``) and ``warnings``, each (key, words)."""

    problems: tuple[tuple[str, str], ...] = ()
    warnings: tuple[tuple[str, str], ...] = ()


def host_ram_needs(plan: dict) -> list[tuple[str, int]]:
    """(what, MiB) of each thing the plan (plan.json's ``plan``) holds in the box's RAM."""
    needs = []
    training = int(plan.get("predicted_host_ram_mib") or 0)        # held together while training: one need
    copy = int(plan.get(LORA_HOST_COPY) or 0)                       # ... of which LoRA's host copy
    if training:
        parts = [f"model states offloaded to the CPU or asleep, {training - copy} MiB"] if training > copy else []
        parts += [f"LoRA's host copy of the adapted weights (patch 0013), {copy} MiB"] if copy else []
        needs.append((f"training's host memory ({'; '.join(parts)})", training))
    export = ((plan.get("checkpoints") or {}).get("export_host_ram") or {}).get("gpu_free_mib")
    if export:
        needs.append(("the export after the run (verl's model merger, then the proof)", int(export)))
    return needs


def gib(mib: int) -> str:
    return f"{mib / GIB:.1f} GiB"


def step_seconds(plan: TrainingPlan) -> float | None:
    """The speed model's seconds of one step of ``plan`` (on the device's H200 box), or None."""
    from tasks.plan.lora import gpu_seconds
    from tasks.plan.memory_fit import offload_seconds
    w = plan.workload
    if w is None:
        return None
    seconds = offload_seconds if w.actor_offload_policy else gpu_seconds
    try:
        return float(seconds(plan.gpu, w, plan.precision, plan.memory)["step"])
    except (KeyError, ValueError, ZeroDivisionError, PlanError):
        return None


def run_steps(plan: TrainingPlan) -> int | None:
    """The steps of the run: the step cap, else the epochs over the train split (verl drops a last partial batch)."""
    w = plan.workload
    if w is None:
        return None
    if w.total_training_steps:
        return int(w.total_training_steps)
    return w.total_epochs * (w.train_rows // w.train_batch_size) if w.train_rows else None


def run_days(plan: TrainingPlan) -> tuple[float, float, int] | None:
    """(days, seconds a step, steps) of the run by the speed model, or None where either is unknown."""
    seconds, steps = step_seconds(plan), run_steps(plan)
    if seconds is None or steps is None:
        return None
    return seconds * steps / DAY_S, seconds, steps


def plan_words(plan: TrainingPlan) -> str:
    """A plan in a few words: its rung, LoRA or full, its speed and host RAM."""
    d = plan.to_dict()
    kind = f"LoRA rank {d['lora']['rank']}" if d.get("lora") else "full fine-tuning"
    need = max((mib for _, mib in host_ram_needs(d)), default=0)
    days = run_days(plan)
    speed = f", ~{days[1]:.0f} s a step, {days[0]:.1f} days for the run" if days else ""
    return f"{plan.rung}, {kind}{speed}, {gib(need)} of host RAM at most"


def check_run_fit(plan: TrainingPlan, memory: dict | None, max_days: float,
                  other: Callable[[dict], TrainingPlan] | None = None,
                  models: tuple[tuple[str, str], ...] = ()) -> RunFit:
    """The box's RAM (``memory``: HostMemory's answer) and the run's length against ``plan``; each refusal
    names the faster plan that passes (``other(workload changes)`` makes one: LoRA first, then ``models``,
    (artifact name, repo) of the catalog, largest first)."""
    d = plan.to_dict()
    problems, warnings = [], []
    total = (memory or {}).get("total_mib")
    available = (memory or {}).get("available_mib")
    for what, need in host_ram_needs(d):
        if total and need > total:
            problems.append(("host RAM", f"{what} needs {gib(need)}, the box has {gib(total)} in all (MemTotal)"))
        elif available and need > available:
            warnings.append(("host RAM", f"{what} needs {gib(need)}, the box has {gib(available)} available now "
                             f"(MemAvailable; {gib(total)} in all): other processes hold the rest"))
    days = run_days(plan)
    if days and days[0] > max_days:
        problems.append(("run length", f"the speed model puts a step at {days[1]:.0f} s (seconds on an H200: a "
                         f"slower card takes longer), {days[2]} steps: {days[0]:.1f} days, over max_run_days = "
                         f"{max_days:g}"))
    if not problems:
        return RunFit(warnings=tuple(warnings))
    fix = faster_fix(plan, total, max_days, other, models)
    extra = []
    if any(k == "host RAM" for k, _ in problems):
        extra.append(f"a box with {gib(max(n for _, n in host_ram_needs(d)))} of RAM or more")
    if any(k == "run length" for k, _ in problems):
        extra.append("a shorter run (train_steps, workload.epochs) or a longer bound (max_run_days)")
    words = "; ".join(text for _, text in problems)
    return RunFit(problems=(("run", f"{words}. Fix: {fix}{'; or ' if fix else ''}{', or '.join(extra)}"),),
                  warnings=tuple(warnings))


def _fits(plan: TrainingPlan, total: int | None, max_days: float) -> bool:
    need = max((mib for _, mib in host_ram_needs(plan.to_dict())), default=0)
    days = run_days(plan)
    return (not total or need <= total) and (days is None or days[0] <= max_days)


def faster_fix(plan: TrainingPlan, total: int | None, max_days: float,
               other: Callable[[dict], TrainingPlan] | None, models: tuple[tuple[str, str], ...]) -> str:
    """The first plan that passes: LoRA adapters on this model, else the largest smaller model of the catalog
    (with the ladder's choice of LoRA or full); '' where none does or none can be made."""
    if other is None:
        return ""
    tried = []
    if not (plan.workload and plan.workload.lora):
        tried.append(({"finetune": "lora"}, "LoRA adapters on this model: workload.finetune = 'lora'"))
    tried += [({"model": repo, "finetune": "auto"}, f"a smaller model: workload.model = {repo!r}")
              for _, repo in models]
    said = []
    for change, words in tried:
        try:
            candidate = other(change)
        except PlanError as exc:
            if change.get("finetune") == "lora":
                said.append(f"LoRA on this model does not fit the GPU ({_short(exc)})")
            continue
        if _fits(candidate, total, max_days):
            return "; ".join(said + [f"{words} ({plan_words(candidate)})"])
    return "; ".join(said)


def _short(exc: PlanError) -> str:
    short = getattr(exc, "short_mib", None)
    return f"short by {short} MiB" if short else str(exc.reason).rstrip(".")


def smaller_models(catalog, model_artifact: str) -> tuple[tuple[str, str], ...]:
    """(artifact name, repo) of the catalog's models smaller than ``model_artifact``, largest first."""
    from tasks.plan import catalog_models
    names = [a.name for a in catalog_models(catalog)]
    later = names[names.index(model_artifact) + 1:] if model_artifact in names else []
    return tuple((n, catalog.artifact(n).repo) for n in later)


def fit_problems(settings, target, members, memory: dict | None) -> list[tuple[str, str, bool]]:
    """The run's checks for one host (``settings``: its LabSettings; ``target``/``members``: the GPU and its
    cluster's, as its plan is made; ``memory``: HostMemory's answer): (key, words, a warning only) each; none
    where the host has no plan (the plan's own problem is reported instead)."""
    from dataclasses import replace

    from tasks.validation import training_plan
    try:
        plan = training_plan(settings, target, members)
    except PlanError:
        return []

    def other(change: dict) -> TrainingPlan:
        workload = {**settings.workload, **change}
        model = settings.catalog.model(workload["model"]).name if workload.get("model") else settings.model_artifact
        return training_plan(replace(settings, workload=workload, model_artifact=model), target, members)

    fit = check_run_fit(plan, memory, settings.max_run_days, other,
                        smaller_models(settings.catalog, settings.model_artifact))
    return [(k, text, False) for k, text in fit.problems] + [(k, text, True) for k, text in fit.warnings]
