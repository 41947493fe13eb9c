"""The doctor: match failed runs' logs against the rules of files/doctor/*.toml and say what to do.

Pure: text in, findings out. ``deploy/doctor.py`` collects the logs from each box; this module
also runs alone on saved logs:

    python -m tasks.doctor [--json] [--plan plan.json] LOGFILE...

An out-of-memory finding is read against the box's plan (plan.json beside the launcher): the
phase that failed (rollout, reference, critic, actor) is found from the traceback, and the
report names that component's estimate and what the plan would change next.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from tasks.catalog import REPO_ROOT, tomllib

RULES_DIR = REPO_ROOT / "files" / "doctor"
RULES_PATH = RULES_DIR / "rules.toml"     # the general rules; each other *.toml there holds one area's
TAIL_LINES = 15


@dataclass(frozen=True)
class Rule:
    id: str
    match: tuple[re.Pattern, ...]
    unless: tuple[re.Pattern, ...]
    cause: str
    fix: str
    setting: str = ""

    def hit(self, line: str) -> bool:
        return any(p.search(line) for p in self.match) and not any(p.search(line) for p in self.unless)


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

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


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
        ))
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
# What the plan escalates to next, in order (fewer offloads = faster; see tasks/plan.py).
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


def analyse_checkpoint_disk(lines: Sequence[str], plan: Mapping[str, Any] | None) -> dict[str, Any]:
    """The plan's checkpoint numbers for a disk that filled: one save on this box, how many are on
    disk at once, the export, and what one kept save fewer would free."""
    cp = (plan or {}).get("checkpoints")
    if not cp:
        return {"advice": "no plan.json with checkpoint sizes for this box: re-run deploy/train.py."}
    from verl_lab_box.checkpoints import gib

    save, keep, export = cp["save_bytes_this_box"], cp["keep"], cp["export_bytes"]
    out = {"save_bytes_this_box": save, "saves_on_disk_at_once": cp["max_ckpt_to_keep"], "export_bytes": export,
           "disk_bytes_this_box": cp["disk_bytes_this_box"]}
    out["advice"] = (f"one save here is {gib(save)}; checkpoints keep = {keep} holds {cp['max_ckpt_to_keep']} on disk "
                     f"at once ({keep} whole + 1 being written), with the export {gib(export)}: "
                     f"{gib(cp['disk_bytes_this_box'])} before margin. "
                     + (f"keep = {keep - 1} needs {gib(save)} less." if keep > 1 else
                        "keep = 1 is the fewest: free space or use a larger disk."))
    return out


DETAIL_READERS = {"cuda-oom": analyse_oom, "checkpoint-disk-full": analyse_checkpoint_disk,
                  "checkpoint-disk-short": analyse_checkpoint_disk}


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
                if rule.hit(line):
                    f = findings.get(rule.id)
                    if f is None:
                        f = findings[rule.id] = Finding(rule.id, rule.cause, rule.fix, rule.setting, [], source)
                        if rule.id in DETAIL_READERS:
                            f.details = DETAIL_READERS[rule.id](lines[max(0, i - 60): i + 5], plan)
                    if len(f.evidence) < 3:
                        f.evidence.append(line.strip())
    is_failed = bool(findings) or bool(relevant) if failed is None else failed
    tail = [] if findings else relevant[-TAIL_LINES:]
    if is_failed and not findings and not tail:
        tail = [f"{s}: {line}" for s, t in sources.items() for line in t.splitlines()[-5:]]
    return Diagnosis(host=host, findings=list(findings.values()), unknown_tail=tail, failed=is_failed)


def render(diag: Diagnosis) -> str:
    out = [f"== {diag.host}: " + ("FAILED" if diag.failed else "no failure found")]
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
    if not preflight.strip():
        return diag, f"{lead} (train_unit_state is installed or enabled: --data train_unit_state=started starts it)"
    body = render(diag).splitlines()[1:] or [f"    {line}" for line in preflight.strip().splitlines()[-5:]]
    return diag, f"{lead}; the launcher's preflight says:\n" + "\n".join(body)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tasks.doctor", description=__doc__.splitlines()[0])
    ap.add_argument("logs", nargs="+", type=Path, help="log files to read")
    ap.add_argument("--plan", type=Path, help="the box's plan.json, for out-of-memory analysis")
    ap.add_argument("--host", default="local")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    plan = json.loads(args.plan.read_text()) if args.plan else None
    sources = {str(p): p.read_text(errors="replace") for p in args.logs}
    diag = diagnose(args.host, sources, plan)
    print(json.dumps(diag.to_json(), indent=2) if args.json else render(diag))
    return 1 if diag.failed else 0


if __name__ == "__main__":
    sys.exit(main())
