"""How a training run is doing, read from verl 0.5.0's console output (as the training unit's
journal or a saved log holds it). Runs on the controller; standard library only.

    python -m tasks.status [--json] LOGFILE

verl's trainer prints one line per PPO step, ``step:N - key:value - key:value ...``, through Ray
(``(TaskRunner pid=...)`` prefixes, ANSI colour codes) and with numpy values written as
``np.float64(...)``; the journal adds its own ``Mon DD HH:MM:SS host unit[pid]:`` prefix. The
progress bar line (``Training Progress: 40%|... | 2/5``) gives the run's total steps.

``--json`` prints ``{"steps": [{"step": N, "metrics": {"<verl metric name>": value}}], "total_steps",
"summary", "problems"}`` with verl's own metric names (``timing_s/step``, ``critic/score/mean``).
A cut or garbled log gives a clear message and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
STEP = re.compile(r"(?:^|\s)step:(\d+) - (.*)$")
PROGRESS = re.compile(r"Training Progress:.*?\|\s*(\d+)/(\d+)\s*\[")
NUMPY_VALUE = re.compile(r"^np\.\w+\((.*)\)$")
SCORE = "critic/score/mean"
STEP_SECONDS = "timing_s/step"
TESTING_SECONDS = "timing_s/testing"
RESPONSE_LENGTH = "response_length/mean"
VALIDATION_PREFIX = "val-core/"
PEAK_GB = "perf/max_memory_allocated_gb"


@dataclass
class RunLog:
    steps: list[dict] = field(default_factory=list)          # [{"step": N, "metrics": {...}}], by step
    total_steps: int | None = None
    problems: list[str] = field(default_factory=list)

    def latest(self, key: str) -> tuple[int, float] | None:
        for s in reversed(self.steps):
            if key in s["metrics"]:
                return s["step"], s["metrics"][key]
        return None

    def validation(self) -> tuple[int, dict[str, float]] | None:
        for s in reversed(self.steps):
            val = {k: v for k, v in s["metrics"].items() if k.startswith(VALIDATION_PREFIX)}
            if val:
                return s["step"], val
        return None

    def seconds_per_step(self) -> float | None:
        """Mean training seconds of the steps after the first (it warms up), less validation."""
        timed = [s["metrics"][STEP_SECONDS] - s["metrics"].get(TESTING_SECONDS, 0.0)
                 for s in self.steps if STEP_SECONDS in s["metrics"]]
        later = timed[1:] or timed
        return sum(later) / len(later) if later else None

    def summary(self) -> dict:
        done = self.steps[-1]["step"] if self.steps else 0
        sps = self.seconds_per_step()
        score, val, peak = self.latest(SCORE), self.validation(), self.latest(PEAK_GB)
        left = (self.total_steps - done) if self.total_steps else None
        return {
            "step": done, "total_steps": self.total_steps,
            "score": score[1] if score else None,
            "validation": val[1] if val else None, "validation_step": val[0] if val else None,
            "seconds_per_step": round(sps, 2) if sps is not None else None,
            "eta_s": round(left * sps) if left is not None and sps is not None else None,
            "response_length": (self.latest(RESPONSE_LENGTH) or (None, None))[1],
            "peak_allocated_gb": peak[1] if peak else None,
        }


def _value(text: str) -> float | None:
    text = NUMPY_VALUE.sub(r"\1", text.strip())
    try:
        return float(text)
    except ValueError:
        return None


def _json_safe(value):
    """JSON has no NaN or infinity (verl may log them, e.g. a grad norm): those become null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_safe(v) for v in value]
    return value


def parse_step_metrics(body: str) -> tuple[dict[str, float], bool]:
    """The ``key:value`` pairs of one step line; (metrics, whether the line looks cut)."""
    metrics: dict[str, float] = {}
    parts = body.split(" - ")
    cut = False
    for i, part in enumerate(parts):
        key, sep, value = part.partition(":")
        v = _value(value) if sep else None
        if v is None or not key.strip():
            cut = cut or i == len(parts) - 1           # only the last pair may be half written
            continue
        metrics[key.strip()] = v
    return metrics, cut


def parse_log(text: str) -> RunLog:
    run = RunLog()
    by_step: dict[int, dict[str, float]] = {}
    lines = text.splitlines()
    unfinished = bool(text) and not text.endswith("\n")       # the writer stopped inside the last line
    for n, raw in enumerate(lines, 1):
        line = ANSI.sub("", raw)
        m = STEP.search(line)
        if m:
            body = m.group(2)
            if unfinished and n == len(lines):
                body = body.rsplit(" - ", 1)[0] + " - <cut>"      # its last value may be half a number
            metrics, cut = parse_step_metrics(body)
            if cut:
                run.problems.append(f"line {n}: step {m.group(1)}'s metrics end mid-value (a cut log?); "
                                    f"kept the {len(metrics)} complete ones")
            if not metrics:
                run.problems.append(f"line {n}: step {m.group(1)} has no readable metric")
                continue
            by_step.setdefault(int(m.group(1)), {}).update(metrics)
            continue
        for _done, total in PROGRESS.findall(line):
            run.total_steps = int(total)
    run.steps = [{"step": k, "metrics": by_step[k]} for k in sorted(by_step)]
    return run


def read_log(path: Path) -> RunLog:
    """The log's text as the journal or a file holds it; bytes that are not UTF-8 are replaced
    (and counted as a problem), never fatal."""
    data = path.read_bytes()
    text = data.decode("utf-8", errors="replace")
    run = parse_log(text)
    bad = text.count("\ufffd") - data.decode("utf-8", errors="ignore").count("\ufffd")
    if bad:
        run.problems.insert(0, f"{bad} bytes that are not UTF-8 (a garbled log?)")
    return run


# ------------------------------------------------------------------ a box's status (deploy/status.py)

UNIT_PROPERTIES = ("LoadState", "ActiveState", "SubState", "Result", "NRestarts", "ExecMainStartTimestampMonotonic")
STAGES = ("cuda", "env", "data", "train")


def last_run(history: str) -> tuple[str, str] | None:
    """How the unit's last run this boot ended, from systemd's own journal lines about it
    (``TrainingRun``'s history): None where it was never started this boot; else (outcome, the
    line that says so): "failed" (``Failed with result``), "stopped" (``Stopping``: a stop by
    hand or a deploy), "finished" (``Deactivated successfully``), "running" (nothing after its start)."""
    lines = [line.strip() for line in (history or "").splitlines() if line.strip()]
    starts = [i for i, line in enumerate(lines) if line.startswith("Started ")]
    if not starts:
        return None
    after = lines[starts[-1] + 1:]
    for words, outcome in (("Failed with result", "failed"), ("Stopping ", "stopped"),
                           ("Deactivated successfully", "finished")):
        found = next((line for line in after if words in line), None)
        if found:
            return outcome, found
    return "running", lines[starts[-1]]


def unit_summary(show: dict[str, str], history: str = "") -> tuple[str, str]:
    """(state, words) of the training unit from ``systemctl show -p`` UNIT_PROPERTIES and systemd's
    journal lines about it this boot (``history``: systemd forgets the run of an unloaded or reset
    unit, the journal does not): not-installed, never-ran (installed, never started), running,
    crash-looping (``activating (auto-restart)``), failed, finished or stopped."""
    load, active, sub = show.get("LoadState", ""), show.get("ActiveState", ""), show.get("SubState", "")
    restarts = int(show.get("NRestarts") or 0) if (show.get("NRestarts") or "0").isdigit() else 0
    started = show.get("ExecMainStartTimestampMonotonic", "0") not in ("", "0") or restarts > 0
    words = f"{active} ({sub})" + (f", {restarts} restarts" if restarts else "")
    if load in ("", "not-found"):
        return "not-installed", "no training unit"
    if active == "activating" and sub == "auto-restart":
        return "crash-looping", words
    if active == "failed":
        return "failed", words + f", result {show.get('Result', '?')}"
    if active in ("active", "activating", "reloading"):
        return "running", words
    journal = last_run(history)
    if not started and journal is None:
        return "never-ran", "installed, never started"
    if journal is not None and journal[0] in ("failed", "stopped", "finished"):
        # systemd's record may be gone or reset (Result=success after reset-failed): the journal's is the run's
        return journal[0], f"{words}; its last run this boot: {journal[1]}"
    return ("finished" if show.get("Result") == "success" else "stopped"), words + f", result {show.get('Result', '?')}"


def gsm8k_summary(exports: dict | None) -> dict:
    """The base model's GSM8K score and the newest proven export's (tasks.facts.export.RunExports):
    ``{"base", "trained", "step", "final", "rows", "engine"}``, None where there is none."""
    exports = exports or {}
    scored = [e for e in exports.get("exports") or [] if e.get("score") and (e.get("proof") or {}).get("ok")]
    last = scored[-1] if scored else None
    base, score = exports.get("base") or {}, (last or {}).get("score") or {}
    return {"base": base.get("accuracy"), "trained": score.get("accuracy"), "step": last["step"] if last else None,
            "final": bool(score.get("final")) if last else None, "rows": score.get("rows") or base.get("rows"),
            "engine": score.get("engine") or base.get("engine")}


def not_installed_reason(proven: list[str], last: dict | None) -> str | None:
    """Why stages are not installed on a box (None: every stage is): the controller's record of the
    box's last deploy/full.py (tasks/run_summary.py: the stage that failed and its message)."""
    missing = [st for st in STAGES if st not in proven]
    if not missing:
        return None
    what = f"{', '.join(missing)} not installed"
    if last is None:
        return (f"{what}: no deploy/full.py of this box is recorded on this controller; run "
                "pyinfra -y <inventory> deploy/full.py")
    if not last.get("ok") and last.get("stage") == "checks":
        # the refusal's own words were true of that run ("nothing on this box was changed", "above"); later
        # deploys (deploy/tracking.py, a stage alone) may have changed the box since: say it of that run only
        message = re.sub(r"[;:]? *nothing (on this box|on any host|) ?was changed", "", last.get("message") or "")
        message = message.replace("verl-lab checks: ", "").replace(" (above)", "").replace(" above", "").strip(" ;:")
        return (f"{what}: the last deploy/full.py ({last.get('when')}) was refused by its checks and changed nothing "
                f"on this box then: {message or 'see its output'}")
    if not last.get("ok"):
        return f"{what}: the last deploy ({last.get('when')}) failed at {last.get('stage') or '?'}: " \
               f"{last.get('message') or 'see its output'}"
    return (f"{what}, although the last deploy ({last.get('when')}) passed: the box changed since (a marker "
            "removed?); run deploy/full.py again")


def box_status(host: str, markers: dict[str, dict | None], unit: dict[str, str], journal: str,
               plan: dict | None, verdict: str | None = None, history: str = "", exports: dict | None = None,
               last: dict | None | bool = False) -> dict:
    """One row of the lab's status: stages proven, env generation, unit, progress (from the journal
    of the unit's current run), peak GPU memory against the plan's prediction, the GSM8K scores of
    the base model and the run's export (``exports``: tasks.facts.export.RunExports), the doctor's verdict."""
    run = parse_log(journal)
    s = run.summary()
    state, words = unit_summary(unit, history)
    peak_gb = s.pop("peak_allocated_gb")
    proven = [st for st in STAGES if (markers or {}).get(st)]
    # ``last``: the controller's record of the box's last deploy/full.py (None: none); False: not asked
    return {"host": host, "stages": proven, "reason": None if last is False else not_installed_reason(proven, last),
            "env_generation": ((markers or {}).get("env") or {}).get("generation"),
            "unit": state, "unit_detail": words, **s,
            "peak_mib": round(peak_gb * 1024) if peak_gb is not None else None,
            "predicted_peak_mib": (plan or {}).get("predicted_peak_mib"),
            "gsm8k": gsm8k_summary(exports),
            "verdict": verdict, "problems": run.problems}


def gsm8k_words(g: dict | None) -> str:
    """``base -> trained`` of a row's GSM8K scores, with the export's step ("-" for none)."""
    if not g or (g.get("base") is None and g.get("trained") is None):
        return "-"
    fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
    step = "" if g.get("step") is None else f" @{g['step']}" + ("" if g.get("final") else "?")
    return f"{fmt(g.get('base'))}->{fmt(g.get('trained'))}{step}"


def render_rows(rows: list[dict]) -> str:
    """The lab as a table, a row per box (verdicts and notes under their box). GSM8K: the base
    model's score -> the newest proven export's, ``@N`` its step, ``?`` where the run had not finished
    at that step (an export on demand)."""
    def fmt(v, spec=""):
        return "-" if v is None else format(v, spec)

    head = f"{'host':<14} {'stages':<19} {'env':<9} {'unit':<14} {'step':>9} {'score':>7} {'val':>7} " \
           f"{'s/step':>7} {'ETA':>8} {'peak/plan MiB':>14} {'GSM8K base->trained':>20}"
    out = [head]
    for r in rows:
        step = f"{r['step']}/{r['total_steps'] or '?'}" if r["step"] else "-"
        val = next(iter((r["validation"] or {}).values()), None)
        eta = f"{r['eta_s'] // 60}m" if r["eta_s"] is not None else "-"
        peak = f"{fmt(r['peak_mib'])}/{fmt(r['predicted_peak_mib'])}"
        out.append(f"{r['host']:<14} {','.join(r['stages']) or '-':<19} {fmt(r['env_generation']):<9} "
                   f"{r['unit']:<14} {step:>9} {fmt(r['score'], '.3f'):>7} {fmt(val, '.3f'):>7} "
                   f"{fmt(r['seconds_per_step'], '.1f'):>7} {eta:>8} {peak:>14} {gsm8k_words(r.get('gsm8k')):>20}")
        if r.get("reason"):
            out.append(f"    why: {r['reason']}")
        out += [f"    {line}" for line in (r["verdict"] or "").splitlines()]
        out += [f"    {line}" for line in r.get("driver_notes") or ()]
        out += [f"    {line}" for line in r.get("burnin_notes") or ()]
    return "\n".join(out)


def boxes(n: int) -> str:
    return f"{n} box" if n == 1 else f"{n} boxes"


def nothing_to_report(rows: list[dict]) -> str | None:
    """The line status ends with when no box has a training run to report, and why (None: one has)."""
    if any(r.get("step") or r.get("unit") in ("running", "crash-looping", "failed", "finished") for r in rows):
        return None
    states: dict[str, list[str]] = {}
    for r in rows:
        states.setdefault(r.get("unit") or "?", []).append(r["host"])
    words = "; ".join(f"{state}: {', '.join(hosts)}" for state, hosts in sorted(states.items()))
    # only the lines the table printed: a `why:` line where a stage is not installed, the doctor's verdict
    said = [w for w, printed in (("the `why:` lines", any(r.get("reason") for r in rows)),
                                 ("the preflight", any(r.get("verdict") for r in rows))) if printed]
    return (f"status: no training run to report on {boxes(len(rows))} ({words}). Start one with "
            "--data train_unit_state=started on a box with a GPU"
            + (f"; {' and '.join(said)} above say{'s' if said == ['the preflight'] else ''} what stops a box"
               if said else ""))


def render(run: RunLog, name: str) -> str:
    s = run.summary()
    total = f"/{s['total_steps']}" if s["total_steps"] else ""

    def fmt(v, unit=""):
        return "-" if v is None else (f"{v:.4g}{unit}" if isinstance(v, float) else f"{v}{unit}")

    val = ", ".join(f"{k[len(VALIDATION_PREFIX):]} {fmt(v)}" for k, v in (s["validation"] or {}).items())
    lines = [f"{name}: step {s['step']}{total}",
             f"  score ({SCORE}): {fmt(s['score'])}",
             f"  validation{' at step ' + str(s['validation_step']) if s['validation_step'] else ''}: {val or '-'}",
             f"  seconds/step: {fmt(s['seconds_per_step'])}   ETA: {fmt(s['eta_s'], ' s')}",
             f"  response length: {fmt(s['response_length'])}   peak allocated: {fmt(s['peak_allocated_gb'], ' GB')}"]
    lines += [f"  note: {p}" for p in run.problems]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tasks.status", description=__doc__.splitlines()[0])
    ap.add_argument("logfile", type=Path, help="verl's console output (journalctl -u verl-lab-train.service > LOG)")
    ap.add_argument("--json", action="store_true", help="the steps with verl's metric names, as JSON")
    args = ap.parse_args(argv)
    try:
        run = read_log(args.logfile)
    except OSError as exc:
        print(f"cannot read {args.logfile}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    if not run.steps:
        print(f"{args.logfile}: no verl step lines ('step:N - key:value ...'): the run has not finished a "
              "step yet, or this is not verl 0.5.0's console output"
              + (f" ({'; '.join(run.problems)})" if run.problems else ""), file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(_json_safe({"steps": run.steps, "total_steps": run.total_steps,
                                     "summary": run.summary(), "problems": run.problems}), allow_nan=False))
    else:
        print(render(run, str(args.logfile)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
