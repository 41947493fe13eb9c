"""Read back the burn-in profiles of a GPU call (bench/gpu/run_burnin.sh; standard library only: it runs on the device
and here).

    python3 bench/gpu/burnin_results.py RUNS [PROFILE ...] [--json]

RUNS is the call's ``runs/`` (unpacked from runs.tgz). Per profile, from the burn-in's own record (``burnin.json``,
verl_lab_box/burnin.py) and the harness's ``run.json``: whether it ended as expected (passed, or the mutated run's
failed check), its wall time, the reward first -> last against the rise it needed, the process's peak against the
plan's and the card's, each phase's peak allocated against the plan's figure, the seconds a step and per phase against
the speed model's (H200 seconds) and the configured run's ETA from them.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

SPEED_OF = {"generate_sequences": "rollout", "compute_log_prob": "actor_log_prob",
            "compute_ref_log_prob": "ref_log_prob", "compute_values": "critic", "update_actor": "update"}


def jsonl(folder: Path, prefix: str) -> list[dict]:
    """Every JSON line of ``folder/<prefix>-*.jsonl`` (the burn-in's records), by time."""
    lines = []
    for path in sorted(folder.glob(f"{prefix}-*.jsonl")):
        lines += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return sorted(lines, key=lambda r: r.get("t", 0))


def per_step(folder: Path, record: dict) -> list[dict]:
    """Each step's share of class tokens with its standard error (the judge's, or for a run cut before its verdict,
    from the reward manager's lines in ``records/``, numbered in order: a cut run has no other numbering) and verl's
    ``actor/ppo_kl``, ``actor/pg_clipfrac``, ``critic/score/mean`` (what verl was handed: the share's z-score since
    the burn-in standardises it) and, with a critic, ``critic/vf_explained_var`` (from ``records/metrics-*``)."""
    metrics = {m["step"]: m.get("data") or {} for m in jsonl(folder / "records", "metrics")}
    steps = record.get("steps")
    if not steps:
        steps = []
        for i, line in enumerate(jsonl(folder / "records", "reward"), 1):
            g = line.get("group_means") or []
            m = sum(g) / len(g) if g else None
            se = (sum((x - m) ** 2 for x in g) / (len(g) - 1) / len(g)) ** 0.5 if len(g) > 1 else None
            steps.append({"step": i, "score": line.get("mean"), "se": se})
    return [{"step": s["step"], "share": s.get("score"), "se": s.get("se"),
             "ppo_kl": metrics.get(s["step"], {}).get("actor/ppo_kl"),
             "clipfrac": metrics.get(s["step"], {}).get("actor/pg_clipfrac"),
             "verl_score": metrics.get(s["step"], {}).get("critic/score/mean"),
             "vf_explained_var": metrics.get(s["step"], {}).get("critic/vf_explained_var")} for s in steps]


def read(folder: Path) -> dict:
    def load(name):
        try:
            return json.loads((folder / name).read_text())
        except (OSError, ValueError):
            return None

    record = load("burnin.json")
    return {"name": folder.name, "record": record, "run": load("run.json") or {},
            "profile": load("profile.json") or {}, "steps": per_step(folder, record or {})}


def summary(found: dict) -> dict:
    rec, run, profile = found["record"] or {}, found["run"], found["profile"]
    expect = profile.get("expect", "passed")
    state, failed = rec.get("state"), rec.get("failed") or []
    as_expected = state == "passed" if expect == "passed" else expect in failed
    mem = next((c for c in rec.get("checks") or [] if c["id"] in ("memory", "oom", "over-cap")), {})
    speed, reward = rec.get("speed") or {}, rec.get("reward") or {}
    phases = [{"phase": r["phase"], "measured_mib": r.get("measured_mib"), "planned_mib": r.get("planned_mib"),
               "ratio": round(r["measured_mib"] / r["planned_mib"], 3) if r.get("measured_mib") and r.get("planned_mib")
               else None, "seconds": (speed.get("phases_s") or {}).get(SPEED_OF.get(r["phase"], "")),
               "model_s": (speed.get("model_s") or {}).get(SPEED_OF.get(r["phase"], ""))}
              for r in rec.get("memory_phases") or []]
    return {"profile": found["name"], "expect": expect, "state": state or "no record", "failed": failed,
            "as_expected": as_expected, "wall_s": rec.get("wall_s") or run.get("seconds"), "rc": run.get("rc"),
            "timed_out": run.get("timed_out"), "reward": reward, "process_peak_mib": mem.get("process_peak_mib"),
            "planned_peak_mib": mem.get("planned_peak_mib"), "cap_mib": profile.get("cap_mib"),
            "card_mib": mem.get("cap_mib"), "seconds_per_step": speed.get("seconds_per_step"),
            "model_step_s": (speed.get("model_s") or {}).get("step"), "measured_over_model": speed.get("measured_over_model"),
            "configured_eta_s": speed.get("configured_eta_s"), "phases": phases,
            "checks": [f"{c['id']}: {'ok' if c['ok'] else 'FAIL' if c['ok'] is False else 'skip'}: {c['words']}"
                       for c in rec.get("checks") or []], "versions": rec.get("versions"), "steps": found["steps"]}


def fmt(v, spec="") -> str:
    return "-" if v is None else format(v, spec)


def words(s: dict) -> str:
    r = s["reward"]
    lines = [f"== {s['profile']}: {s['state']}{' (' + ', '.join(s['failed']) + ')' if s['failed'] else ''}, expected "
             f"{s['expect']}: {'AS EXPECTED' if s['as_expected'] else 'NOT AS EXPECTED'}; wall {fmt(s['wall_s'], '.0f')} s"
             f" (rc {s['rc']}{', timed out' if s['timed_out'] else ''})",
             f"   reward {fmt(r.get('first'), '.4f')} -> {fmt(r.get('last'), '.4f')} (rise {fmt(r.get('rise'), '+.4f')}, "
             f"needed {fmt(r.get('needed'), '.4f')}, standard error {fmt(r.get('standard_error'), '.4f')})",
             f"   peak {fmt(s['process_peak_mib'], '.0f')} MiB (plan {fmt(s['planned_peak_mib'])}, cap {fmt(s['cap_mib'])}, "
             f"card {fmt(s['card_mib'])}); {fmt(s['seconds_per_step'], '.1f')} s a step (speed model "
             f"{fmt(s['model_step_s'], '.1f')}, x{fmt(s['measured_over_model'], '.2f')}); configured run's ETA "
             f"{fmt(s['configured_eta_s'] and s['configured_eta_s'] / 3600, '.1f')} h"]
    if s["steps"]:
        lines.append("   share by step: " + ", ".join(
            f"{t['step']}: {fmt(t['share'], '.4f')} +- {fmt(t['se'], '.4f')}"
            + (f" (ppo_kl {t['ppo_kl']:.3f})" if isinstance(t["ppo_kl"], (int, float)) else "") for t in s["steps"]))
        told = [t for t in s["steps"] if isinstance(t["verl_score"], (int, float))]
        if told:
            lines.append("   verl's critic/score/mean by step: " + ", ".join(
                f"{t['step']}: {t['verl_score']:.3f}" + (f" (vf_explained_var {t['vf_explained_var']:.1f})"
                                                        if isinstance(t["vf_explained_var"], (int, float)) else "")
                for t in told))
    for p in s["phases"]:
        lines.append(f"   {p['phase']:<22} {fmt(p['measured_mib'], '.0f'):>7} / {fmt(p['planned_mib']):>6} MiB "
                     f"({fmt(p['ratio'], '.2f')})   {fmt(p['seconds'])} s (model {fmt(p['model_s'])})")
    lines += [f"   {c}" for c in s["checks"]]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", type=Path)
    ap.add_argument("profiles", nargs="*")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    names = args.profiles or sorted(p.parent.name for p in args.runs.glob("*/profile.json")
                                    if json.loads(p.read_text()).get("kind") == "burnin")
    found = [summary(read(args.runs / n)) for n in names]
    if args.json:
        print(json.dumps(found, indent=1))
    else:
        print("\n".join(words(s) for s in found))
        print(f"burn-ins as expected: {sum(s['as_expected'] for s in found)} of {len(found)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
