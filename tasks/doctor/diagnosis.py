"""The doctor: match failed runs' logs against the rules of files/doctor/*.toml and say what to do.

Pure: text in, findings out. ``deploy/doctor.py`` collects the logs from each box; this module
also runs alone on saved logs:

    python -m tasks.doctor [--json] [--plan plan.json] LOGFILE...

An out-of-memory finding is read against the box's plan (plan.json beside the launcher): the
phase that failed (rollout, reference, critic, actor) is found from the traceback, and the
report names that component's estimate and what the plan would change next. A full disk is read
by tasks/doctor/disk.py: the path that filled and the sizes its message gives.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tasks.catalog import REPO_ROOT, tomllib
from tasks.doctor.disk import analyse_checkpoint_disk, analyse_disk

RULES_DIR = REPO_ROOT / "files" / "doctor"
RULES_PATH = RULES_DIR / "rules.toml"     # the general rules; each other *.toml there holds one area's
TAIL_LINES = 15
NEAR_LINES = 80          # how far back a rule's `near` patterns are looked for (a traceback's frames)


@dataclass(frozen=True)
class Rule:
    id: str
    match: tuple[re.Pattern, ...]
    unless: tuple[re.Pattern, ...]
    cause: str
    fix: str
    setting: str = ""
    near: tuple[re.Pattern, ...] = ()     # each must match one of the NEAR_LINES lines before (a traceback's frames)
    yields_to: tuple[str, ...] = ()       # rule ids: this rule's finding is dropped when one of them is found

    def hit(self, line: str, before: Sequence[str] = ()) -> bool:
        return (any(p.search(line) for p in self.match) and not any(p.search(line) for p in self.unless)
                and all(any(p.search(b) for b in before) for p in self.near))


@dataclass
class Finding:
    rule: str
    cause: str
    fix: str
    setting: str
    evidence: list[str]
    source: str
    details: dict[str, Any] = field(default_factory=dict)


@dataclass
class Diagnosis:
    host: str
    findings: list[Finding]
    unknown_tail: list[str]  # the last relevant lines when no rule matched a failure
    failed: bool
    verdict: str = ""        # the headline (``verdict``); "" until it is judged: render() then says failed or not

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


# The headlines. "no failure found" only where a run ended well; every other word says what is known.
FAILED = "failed"
NEVER_RAN = "never ran"
NEVER_RAN_PREFLIGHT_FAILS = "never ran: preflight fails"
NEVER_RAN_PREFLIGHT_PASSES = "never ran: preflight passes"
RUNNING = "running"
NO_LOG = "no log"
NO_RUN = "no training run in the log"
NOT_ENDED = "no failure so far: the run has not ended in this log (running, or the log is cut short)"
STOPPED = "stopped before its end, no failure in its log"
NO_UNIT = "no training unit"
FINE = "no failure found"
# verl 0.5.0's RayPPOTrainer.fit prints this at its last step, just before it returns (ray_trainer.py)
RUN_END = "Final validation metrics:"
PREFLIGHT_FAIL = re.compile(r"^\s*FAIL\s|preflight FAILED", re.M)


def verdict(diag: Diagnosis, unit: str | None = None, preflight: str = "",
            text: str | None = None) -> str:
    """The headline for ``diag``: from the training unit's state (``tasks.status.unit_summary``:
    a box), or, without one (a saved log, ``text``), from what the log shows."""
    if unit is not None:
        if unit == "never-ran":
            if PREFLIGHT_FAIL.search(preflight or ""):
                return NEVER_RAN_PREFLIGHT_FAILS
            return NEVER_RAN_PREFLIGHT_PASSES if "preflight passed" in (preflight or "") else NEVER_RAN
        if unit in ("failed", "crash-looping") or diag.failed:
            return FAILED
        return {"running": RUNNING, "not-installed": NO_UNIT, "stopped": STOPPED}.get(unit, FINE)
    if not (text or "").strip():
        return NO_LOG
    if diag.failed:
        return FAILED
    from tasks.status import parse_log

    run = parse_log(text)
    if RUN_END in text or (run.steps and run.total_steps and run.steps[-1]["step"] >= run.total_steps):
        return FINE
    return NOT_ENDED if run.steps or "preflight passed" in text else NO_RUN


def rule_files(folder: Path = RULES_DIR) -> list[Path]:
    """The rule files, in the order their rules are tried: rules.toml, then the others by name."""
    return sorted(folder.glob("*.toml"), key=lambda p: (p.name != RULES_PATH.name, p.name))


def load_rules(path: Path | None = None, folder: Path = RULES_DIR) -> list[Rule]:
    """The rules of one file (``path``), or of every rule file in ``folder``; ids are unique."""
    raws: list[tuple[Path, dict]] = []
    for each in [path] if path is not None else rule_files(folder):
        with open(each, "rb") as fh:
            raws += [(each, raw) for raw in tomllib.load(fh).get("rule", [])]
    rules = []
    seen = set()
    for path, raw in raws:
        missing = [k for k in ("id", "match", "cause", "fix") if not raw.get(k)]
        if missing:
            raise ValueError(f"{path}: a rule lacks {', '.join(missing)}: {raw.get('id', raw)}")
        if raw["id"] in seen:
            raise ValueError(f"{path}: rule id {raw['id']!r} is used twice")
        seen.add(raw["id"])
        rules.append(Rule(
            id=raw["id"],
            match=tuple(re.compile(p) for p in raw["match"]),
            unless=tuple(re.compile(p) for p in raw.get("unless", [])),
            cause=raw["cause"], fix=raw["fix"], setting=raw.get("setting", ""),
            near=tuple(re.compile(p) for p in raw.get("near", [])), yields_to=tuple(raw.get("yields_to", [])),
        ))
    unknown = [f"{r.id} -> {y}" for r in rules for y in r.yields_to if y not in seen]
    if unknown:
        raise ValueError(f"a rule's yields_to names no rule: {', '.join(unknown)}")
    return rules


# Lines that mark a failure even when no rule knows it (shown as the unknown tail).
FAILURE_MARKERS = re.compile(
    r"Traceback \(most recent call last\)|\w*(Error|Exception)\b:|\bERROR\b|FAILED|Failed with result"
    r"|exit(ed)?[ -](code|status)[ =]?[1-9]|\bKilled\b"
)

_SIZE = r"([\d.]+) (GiB|MiB|KiB|B)"
OOM_ALLOC = re.compile(r"Tried to allocate " + _SIZE)
OOM_TOTAL = re.compile(r"total capacity of " + _SIZE + r" of which " + _SIZE + r" is free")
OOM_PROCESS = re.compile(r"this process has " + _SIZE + r" memory in use")
_UNIT_MIB = {"GiB": 1024.0, "MiB": 1.0, "KiB": 1 / 1024, "B": 1 / (1024 * 1024)}

# Which verl phase a traceback line belongs to -> the plan breakdown keys it draws on.
PHASES = (
    ("rollout", re.compile(r"generate_sequences|vllm|hf_rollout|_generate_minibatch"), ("rollout", "actor_states")),
    ("reference", re.compile(r"compute_ref_log_prob"), ("ref_states", "actor_activations")),
    ("critic", re.compile(r"compute_values|update_critic|dp_critic"), ("critic_states", "critic_activations")),
    ("actor", re.compile(r"update_actor|compute_log_prob|dp_actor"), ("actor_states", "actor_activations")),
)
# What the plan escalates to next, in order (fewer offloads = faster; see tasks/plan/memory_fit.py).
OFFLOAD_LADDER = (
    ("actor_optimizer_offload", "offload the actor's optimizer states"),
    ("critic_optimizer_offload", "offload the critic's optimizer states"),
    ("actor_param_offload", "offload the actor's parameters"),
    ("critic_param_offload", "offload the critic's parameters"),
)


def _mib(value: str, unit: str) -> float:
    return float(value) * _UNIT_MIB[unit]


def analyse_oom(lines: Sequence[str], plan: Mapping[str, Any] | None) -> dict[str, Any]:
    """Numbers from torch's OOM message, the failing phase, and what the plan says about it."""
    out: dict[str, Any] = {}
    text = "\n".join(lines)
    if m := OOM_ALLOC.search(text):
        out["tried_to_allocate_mib"] = round(_mib(*m.groups()), 1)
    if m := OOM_TOTAL.search(text):
        out["gpu_total_mib"] = round(_mib(m.group(1), m.group(2)), 1)
        out["gpu_free_mib"] = round(_mib(m.group(3), m.group(4)), 1)
    if m := OOM_PROCESS.search(text):
        out["process_in_use_mib"] = round(_mib(*m.groups()), 1)
    phase, keys = None, ()
    for line in reversed(lines):  # the innermost frame names the phase best
        for name, pattern, comp in PHASES:
            if pattern.search(line):
                phase, keys = name, comp
                break
        if phase:
            break
    out["phase"] = phase or "unknown"
    if not plan:
        out["advice"] = "no plan.json found for this box: re-run deploy/train.py to get a plan for its GPU."
        return out
    predicted = plan.get("predicted_peak_mib")
    breakdown = plan.get("breakdown") or {}
    out["predicted_peak_mib"] = predicted
    if keys:
        out["component_estimates_mib"] = {k: breakdown[k] for k in keys if k in breakdown}
    used = out.get("process_in_use_mib")
    if predicted and used is not None and "tried_to_allocate_mib" in out:
        need = used + out["tried_to_allocate_mib"]
        out["exceeded_estimate_by_mib"] = round(need - float(predicted), 1)
    offload = plan.get("offload") or {}
    workload = plan.get("workload") or {}
    critic = workload.get("algorithm", "ppo") != "grpo"
    nxt = next(((k, what) for k, what in OFFLOAD_LADDER if not offload.get(k) and (critic or "critic" not in k)), None)
    where = f"in the {phase} phase" if phase else "in an unknown phase"
    if workload.get("actor_offload_policy"):
        # FSDP2 CPUOffloadPolicy: the actor's and the ref's states are on the CPU already; no FSDP1 step is left
        out["advice"] = (f"the run ran out of memory {where} on the CPU-offload rung ({plan.get('rung', 'grpo-cpu-offload')}"
                         ": the actor's and the ref's states already live on the CPU): lower the update micro-batch "
                         "or the HF generation chunk, shorten responses (workload.max_response_length), train a "
                         "smaller model (workload.model), or use a GPU with more memory.")
    elif nxt:
        out["plan_would_change"] = nxt[0]
        out["advice"] = (f"the run ran out of memory {where}; the next step of the plan's memory ladder is to "
                         f"{nxt[1]} ({nxt[0]}); lower micro-batches or the rollout memory share also help.")
    else:
        out["advice"] = (f"the run ran out of memory {where} with every offload already on: lower "
                         "micro-batches / sequence lengths, or use a GPU with more memory.")
    return out


VLLM_V1_KV = re.compile(r"max seq len \((\d+)\), \(([\d.]+) GiB KV cache is needed, which is larger than the "
                        r"available KV cache memory \((-?[\d.]+) GiB\)")
VLLM_V0_KV = re.compile(r"The model's max seq len \((\d+)\) is larger than the maximum number of tokens that can be "
                        r"stored in KV cache \((\d+)\)")


def analyse_vllm_kv(lines: Sequence[str], plan: Mapping[str, Any] | None) -> dict[str, Any]:
    """vLLM's KV-cache numbers from its message, the plan's engine and share, and (V1) the share that
    would have held the plan's sequences with the memory vLLM found available."""
    text = "\n".join(lines)
    out: dict[str, Any] = {}
    if m := VLLM_V1_KV.search(text):
        out.update(max_model_len=int(m[1]), kv_needed_gib=float(m[2]), kv_available_gib=float(m[3]))
    elif m := VLLM_V0_KV.search(text):
        out.update(max_model_len=int(m[1]), kv_cache_tokens=int(m[2]))
    if not plan:
        out["advice"] = "no plan.json found for this box: re-run deploy/train.py to get a plan (and a share) for its GPU."
        return out
    share = plan.get("vllm_gpu_memory_utilization")
    out["plan_engine"] = {"1": "V1", "0": "V0"}.get(str((plan.get("env") or {}).get("VLLM_USE_V1")), "unknown")
    out["plan_share"] = share
    wanted = (plan.get("breakdown") or {}).get("vllm_kv_wanted")
    total = (plan.get("gpu") or {}).get("memory_mib")
    if "kv_available_gib" in out and share and wanted and total:
        out["plan_kv_cache_mib"] = wanted
        more = (wanted - out["kv_available_gib"] * 1024) / total
        out["share_that_holds_the_plans_kv_cache"] = -(-round((share + more) * 10000) // 100) / 100
    return out


# rule id -> what else a finding reads from the lines before it (and the box's plan)
ANALYSES = {"cuda-oom": analyse_oom, "vllm-v1-kv-cache-short": analyse_vllm_kv,
            "vllm-v0-kv-cache-short": analyse_vllm_kv, "checkpoint-disk-full": analyse_checkpoint_disk,
            "checkpoint-files-disk-full": analyse_checkpoint_disk, "checkpoint-disk-short": analyse_checkpoint_disk,
            "export-disk-full": analyse_checkpoint_disk,
            **dict.fromkeys(("ray-temp-disk-full", "ray-object-store-full", "hf-download-disk-full", "env-disk-full",
                             "pip-disk-full", "conda-disk-full", "stage-disk-short", "disk-full"), analyse_disk)}


def diagnose(host: str, sources: Mapping[str, str], plan: Mapping[str, Any] | None = None,
             rules: Iterable[Rule] | None = None, failed: bool | None = None) -> Diagnosis:
    """Match every source's text (name -> log text) against the rules."""
    rules = list(rules if rules is not None else load_rules())
    findings: dict[str, Finding] = {}
    relevant: list[str] = []
    for source, text in sources.items():
        lines = text.splitlines()
        for i, line in enumerate(lines):
            if FAILURE_MARKERS.search(line):
                relevant.append(f"{source}: {line}")
            for rule in rules:
                if rule.hit(line, lines[max(0, i - NEAR_LINES): i] if rule.near else ()):
                    f = findings.get(rule.id)
                    if f is None:
                        f = findings[rule.id] = Finding(rule.id, rule.cause, rule.fix, rule.setting, [], source)
                        if rule.id in ANALYSES:
                            end = len(lines) if ANALYSES[rule.id] is analyse_disk else i + 5   # sizes come later
                            f.details = ANALYSES[rule.id](lines[max(0, i - 60): end], plan)
                    if len(f.evidence) < 3:
                        f.evidence.append(line.strip())
    yields = {r.id: r.yields_to for r in rules}
    findings = {k: f for k, f in findings.items() if not set(yields[k]) & findings.keys()}
    is_failed = bool(findings) or bool(relevant) if failed is None else failed
    tail = [] if findings else relevant[-TAIL_LINES:]
    if is_failed and not findings and not tail:
        tail = [f"{s}: {line}" for s, t in sources.items() for line in t.splitlines()[-5:]]
    return Diagnosis(host=host, findings=list(findings.values()), unknown_tail=tail, failed=is_failed)


def render(diag: Diagnosis) -> str:
    out = [f"== {diag.host}: " + (diag.verdict or (FAILED if diag.failed else "no failure found in what was read"))]
    for f in diag.findings:
        out.append(f"  [{f.rule}] {f.cause}")
        out.append(f"    fix: {f.fix}")
        if f.setting:
            out.append(f"    setting: {f.setting}")
        for ev in f.evidence:
            out.append(f"    seen ({f.source}): {ev[:200]}")
        for key, value in f.details.items():
            out.append(f"    {key}: {value}")
    if diag.unknown_tail:
        out.append("  no rule matched; the last relevant lines:")
        out.extend(f"    {line[:240]}" for line in diag.unknown_tail)
    return "\n".join(out)


def never_ran(host: str, preflight: str, plan: Mapping[str, Any] | None = None,
              lead: str = "the unit never ran") -> tuple[Diagnosis, str]:
    """What stops a training unit that never ran: the launcher's ``--check`` output (run as the
    train user) read by the rules, and the words for it, beginning with ``lead``."""
    diag = diagnose(host, {"preflight": preflight}, plan)
    diag.verdict = verdict(diag, "never-ran", preflight)
    if not preflight.strip():
        return diag, f"{lead} (train_unit_state is installed or enabled: --data train_unit_state=started starts it)"
    body = render(diag).splitlines()[1:] or [f"    {line}" for line in preflight.strip().splitlines()[-5:]]
    return diag, f"{lead}; the launcher's preflight says:\n" + "\n".join(body)


EXIT_FAILED, EXIT_UNREADABLE = 1, 2


def _read(path: Path, what: str) -> str:
    """A file's text (bytes that are not UTF-8 replaced); ValueError saying why it cannot be read."""
    try:
        return path.read_bytes().decode("utf-8", errors="replace")
    except IsADirectoryError:
        raise ValueError(f"{what} {path} is a directory, not a file") from None
    except OSError as exc:
        raise ValueError(f"cannot read {what} {path}: {exc.strerror or exc}") from None


PLAN_KEYS = ("rung", "gpu", "predicted_peak_mib")     # what every plan.json has (TrainingPlan.to_dict)


def read_plan(path: Path) -> dict:
    """A plan.json for the doctor (ValueError saying what is wrong with it)."""
    try:
        plan = json.loads(_read(path, "--plan"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"--plan {path} is not JSON ({exc.msg}, line {exc.lineno}): give the box's "
                         "plan.json (<lab_root>/train/plan.json)") from None
    if not isinstance(plan, dict):
        raise ValueError(f"--plan {path} is JSON but not a plan (an object with predicted_peak_mib, breakdown ...)")
    missing = [key for key in PLAN_KEYS if key not in plan]
    if missing:
        raise ValueError(f"--plan {path} is a JSON object but not a plan.json: it has no {', '.join(missing)}; give "
                         "the box's plan.json (<lab_root>/train/plan.json)")
    return plan


def main(argv: Sequence[str] | None = None) -> int:
    """Exit status: 0 when no failure was found, 1 when one was, 2 when an input cannot be read or
    holds no log to judge (a missing file, a directory, an empty file, one with no training run,
    a --plan that is not a plan.json)."""
    ap = argparse.ArgumentParser(prog="python -m tasks.doctor", description=__doc__.splitlines()[0])
    ap.add_argument("logs", nargs="+", type=Path, help="log files to read")
    ap.add_argument("--plan", type=Path, help="the box's plan.json, for out-of-memory analysis")
    ap.add_argument("--host", default="local")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    try:
        plan = read_plan(args.plan) if args.plan else None
        sources = {str(p): _read(p, "log") for p in args.logs}
    except ValueError as exc:
        print(f"python -m tasks.doctor: {exc}", file=sys.stderr)
        return EXIT_UNREADABLE
    diag = diagnose(args.host, sources, plan)
    text = "\n".join(sources.values())
    diag.verdict = verdict(diag, text=text)
    print(json.dumps(diag.to_json(), indent=2) if args.json else render(diag))
    if diag.verdict in (NO_LOG, NO_RUN):
        empty = [name for name, t in sources.items() if not t.strip()]
        print(f"python -m tasks.doctor: {diag.verdict}" + (f" ({', '.join(empty)} empty)" if empty else
              ": no verl step, preflight or failure line in it; give the training unit's journal "
              "(journalctl -u verl-lab-train.service > run.log)"), file=sys.stderr)
        return EXIT_UNREADABLE
    return EXIT_FAILED if diag.failed else 0


if __name__ == "__main__":
    sys.exit(main())
