"""The line per host a deploy of deploy/full.py ends with, without -v: what each stage proved or
changed, the training plan in one line and the unit's state.

pyinfra's own results table counts operations; a re-run of a proven lab queues none, so it says
nothing of what was proven. deploy/full.py records, per host and stage, the operations the stage
queued (``stage``: a slice of pyinfra's ``host.op_hash_order``); after the run, each operation's
metadata says whether it changed anything (``OperationMeta.did_change``). The lines are printed on
stderr when the process ends (``atexit``: pyinfra has no end-of-run hook), only where operations
were executed (not with ``--dry``, not when the run's checks refused it).
"""

from __future__ import annotations

import atexit
import sys
from contextlib import contextmanager

_RECORD: dict[str, dict] = {}     # host name -> {"stages": [(stage, [op_hash])], "plan": str, "unit": str, "gpu": str}
_REGISTERED = {"atexit": False}
QUIET_STAGES = ("undo",)         # named only where they queued something (tasks/undo.py: "undo changed 3")


MODEL_PATH = "actor_rollout_ref.model.path="


def model_of(plan: dict) -> str | None:
    """The model a plan trains, by its Hugging Face repo: from the actor's model path, the catalog model's
    folder ``<lab_root>/models/<owner>--<name>`` (tasks/settings/load.py ``model_dir``; a repo never holds "--")."""
    path = next((o[len(MODEL_PATH):] for o in plan.get("overrides") or [] if o.startswith(MODEL_PATH)), None)
    return path.rstrip("/").rsplit("/", 1)[-1].replace("--", "/", 1) if path else None


def finetune_words(plan: dict) -> str:
    """LoRA (its rank) or full fine-tuning, as the plan trains."""
    lora = plan.get("lora")
    return f"LoRA rank {lora.get('rank')}" if lora else "full fine-tuning"


def plan_line(plan: dict) -> str:
    """A training plan (plan.json's ``plan``) in one line: the model, the rung, LoRA or full, then how."""
    off = [k.removesuffix("_offload").replace("_", " ") for k, on in (plan.get("offload") or {}).items() if on]
    rollout = f"{plan.get('rollout')} {plan.get('rollout_dtype')}"
    if plan.get("rollout") == "vllm":
        rollout += f" (share {plan.get('vllm_gpu_memory_utilization')})"
    return (f"{model_of(plan) or '?'}, {plan.get('rung')}, {finetune_words(plan)}, train {plan.get('train_dtype')}, "
            f"rollout {rollout}, offload {', '.join(off) or 'none'}, peak {plan.get('predicted_peak_mib')} of "
            f"{plan.get('budget_mib')} MiB")


def stage_words(stage: str, ops: list[tuple[bool | None, bool | None]]) -> str:
    """One stage's word: ``ops`` is (changed, ok) per operation it queued (None: not run)."""
    if not ops:
        return f"{stage} proven"
    if any(ok is False for _, ok in ops):
        return f"{stage} FAILED"
    if any(ok is None for _, ok in ops):
        return f"{stage} not run"
    changed = sum(1 for c, _ in ops if c)
    return f"{stage} changed {changed}" if changed else f"{stage} checked"


def visible_words(stages: list[tuple[str, list]]) -> list[str]:
    """Each stage's word (``stage_words``), in order; a QUIET_STAGES one only where it queued something."""
    return [stage_words(name, ops) for name, ops in stages if ops or name not in QUIET_STAGES]


def host_line(name: str, gpu: str, stages: list[str], changed: int, plan: str | None, unit: str,
              failed: bool) -> str:
    what = "FAILED (see above)" if failed else (f"changed {changed} operation{'s' if changed != 1 else ''}"
                                                if changed else "changed nothing")
    return (f"verl-lab: {name} ({gpu}): {', '.join(stages)}; {what}; plan {plan or 'none'}; "
            f"unit {unit}")


@contextmanager
def stage(name: str):
    """Record the operations the current host's stage ``name`` queues."""
    from pyinfra import host
    before = len(host.op_hash_order)
    yield
    stages = _RECORD.setdefault(host.name, {"stages": []})["stages"]
    done = next((hashes for stage_name, hashes in stages if stage_name == name), None)
    if done is None:        # a stage entered twice (deploy/full.py's undo, before and after the train stage): one word
        stages.append((name, list(host.op_hash_order[before:])))
    else:
        done.extend(host.op_hash_order[before:])
    if not _REGISTERED["atexit"]:
        _REGISTERED["atexit"] = True
        atexit.register(print_summary)


def note(**values) -> None:
    """The current host's plan line, unit state, GPU words."""
    from pyinfra import host
    note_for(host.name, **values)


def note_for(host_name: str, **values) -> None:
    """``note`` for a host named, e.g. at execute time from a ``python.call`` (the train stage's wait records the
    unit's state it found: a started unit that crash-loops is not "started")."""
    _RECORD.setdefault(host_name, {"stages": []}).update(values)


def note_target(gpu, **values) -> None:
    """The host's GPU words (its target, tasks/target.py HostTarget) and ``values``."""
    target = gpu.target
    note(gpu=f"{target.count} x {target.name}, from {gpu.source}" if target else "no GPU", **values)


def note_plan(settings, target, targets=None) -> None:
    """The host's plan in one line, where it can be made (else the train stage already failed the box, saying why)."""
    try:
        from tasks.validation import training_plan
        note(plan=plan_line(training_plan(settings, target, targets).to_dict()))
    except Exception:              # noqa: BLE001 - the train stage already failed this box with why
        pass


def lines(state) -> list[str]:
    from pyinfra.api.state import StateStage
    if state.current_stage < StateStage.Execute:
        return []
    out = []
    hosts = {h.name: h for h in state.inventory}
    for name, rec in sorted(_RECORD.items()):
        h = hosts.get(name)
        words, total, failed_stage, message = [], 0, None, None
        for stage_name, hashes in rec["stages"]:
            ops = []
            for op_hash in hashes:
                meta = state.get_op_data_for_host(h, op_hash).operation_meta
                ops.append((meta.did_change(), meta.did_succeed()) if meta.is_complete() else (None, None))
                if meta.is_complete() and not meta.did_succeed() and failed_stage is None:
                    failed_stage = stage_name
                    message = " ".join(line.strip() for line in meta.stderr_lines[-3:] if line.strip())
            total += sum(1 for c, _ in ops if c)
            words.append((stage_name, ops))
        words = visible_words(words)
        line = host_line(name, rec.get("gpu", "?"), words, total, rec.get("plan"), rec.get("unit", "?"),
                         h in state.failed_hosts)
        out.append(line)
        if rec.get("cache"):
            record_run(rec["cache"], name, ok=h not in state.failed_hosts, stage=failed_stage, message=message,
                       line=line)
    return out


def record_run(cache: str, host_name: str, ok: bool, stage: str | None, message: str | None, line: str) -> None:
    """The controller's record of this host's last deploy/full.py (<controller_cache>/runs/<host>.json):
    deploy/status.py tells from it why a stage is not installed."""
    import json
    import time
    from pathlib import Path
    path = Path(cache) / "runs" / f"{host_name}.json"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"when": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "ok": ok,
                                    "stage": stage, "message": message, "line": line}, indent=1))
    except OSError:
        pass


def last_run(cache, host_name: str) -> dict | None:
    import json
    from pathlib import Path
    try:
        return json.loads((Path(cache) / "runs" / f"{host_name}.json").read_text())
    except (OSError, ValueError):
        return None


def print_summary() -> None:
    from pyinfra.context import ctx_state
    try:
        found = lines(ctx_state.get()) if ctx_state.isset() else []
    except Exception as exc:      # noqa: BLE001 - a summary must never hide pyinfra's own exit
        found = [f"verl-lab: no summary ({type(exc).__name__}: {exc})"]
    if found:
        print("\n".join(found), file=sys.stderr, flush=True)
