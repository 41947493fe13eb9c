"""Each LoRA run against its full plan's run of the same call (``compare_with``; issue 42's pairs,
bench/gpu/run_lora.sh):
prompts/s of both and the ratio as measured; the plan's step rebuilt from the measured phases where the runs trained
fewer prompts than the plan (``data.train_batch_size``: every phase but generation scales with the prompts,
generation with the HF chunks, each chunk about as long whatever its size: GPU calls 9-10); the seconds of each
phase (the workers' probe, verl's own ``timing_s``); LoRA's generation against the full plan's, beside GPU call 15's
(there: the adapter unmerged, eight runs side by side). From the consoles and probe records alone (it runs on the
device machine too):

    python3 bench/gpu/lora_pairs.py RUNS_DIR PROFILE...
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ppo_results import read_probe, read_run, step_phases, step_speed  # noqa: E402

# GPU call 15 (bench/gpu/results/ppo-20261205/call15/NOTE.md): step 1's generation seconds, LoRA (unmerged) / full
CALL15_GENERATION = {"gtx1080": (112.4, 64.3), "rtx2080ti": (84.7, 54.0), "rtx3060": (93.6, 50.4)}
PHASES = ("generate_sequences", "compute_log_prob", "compute_ref_log_prob", "update_actor")


def ran_batch(profile: dict) -> int | None:
    """Prompts a step as the run trained them: the harness's override (after the plan's), else the plan's."""
    for o in profile.get("overrides") or []:
        if o.startswith("data.train_batch_size="):
            return int(o.split("=", 1)[1])
    return (profile.get("plan") or {}).get("train_batch_size")


def plan_step_seconds(profile: dict, s_step: float, gen_s: float) -> float | None:
    """The plan's step (its prompts, its HF chunks) from a run of fewer prompts: generation x the plan's chunks / the
    run's, the rest x the plan's prompts / the run's. None where the run trained the plan's batch."""
    plan = profile.get("plan") or {}
    ran, planned = ran_batch(profile), plan.get("train_batch_size")
    if not ran or not planned or ran == planned:
        return None
    n = 4 if plan.get("rung", "").startswith("grpo") else 1
    chunk = (plan.get("micro_batches") or {}).get("rollout") or planned * n
    chunks = lambda prompts: math.ceil(prompts * n / min(chunk, prompts * n))  # noqa: E731
    return gen_s * chunks(planned) / chunks(ran) + (s_step - gen_s) * planned / ran


def pair(runs: Path, name: str) -> dict | None:
    profile, steps = read_run(runs / name)
    base = profile.get("compare_with")
    if not base or not (runs / base).is_dir():
        return None
    out = {"lora_run": name, "full_run": base}
    for role, run in (("lora", name), ("full", base)):
        prof, st = read_run(runs / run)
        speed, probe = step_speed(prof, st), read_probe(runs / run / "probe")
        batch = ran_batch(prof)
        s_step, gen = speed["s_per_step"], speed["gen_s_per_step"]
        rebuilt = plan_step_seconds(prof, s_step, gen) if s_step and gen else None
        planned = (prof.get("plan") or {}).get("train_batch_size")
        out[role] = {"s_per_step": s_step, "gen_s": gen, "prompts": batch,
                     "prompts_per_s": round(batch / s_step, 3) if s_step and batch else None,
                     "plan_prompts_per_s": round(planned / rebuilt, 3) if rebuilt else None,
                     "phases": {k: v["seconds"] for k, v in step_phases(probe).items() if k in PHASES},
                     "peak_allocated_mib": max((r.get("peak_allocated_mib") or 0 for r in probe
                                                if r.get("event") == "phase"), default=None)}
    lo, fu = out["lora"], out["full"]
    out["ratio"] = round(lo["prompts_per_s"] / fu["prompts_per_s"], 2) if lo["prompts_per_s"] and fu["prompts_per_s"] \
        else None
    out["plan_ratio"] = round(lo["plan_prompts_per_s"] / fu["plan_prompts_per_s"], 2) \
        if lo["plan_prompts_per_s"] and fu["plan_prompts_per_s"] else None
    out["generation_ratio"] = round(lo["gen_s"] / fu["gen_s"], 2) if lo["gen_s"] and fu["gen_s"] else None
    card = name.split("-", 1)[0]
    if card in CALL15_GENERATION:
        lora15, full15 = CALL15_GENERATION[card]
        out["call15_generation_ratio"] = round(lora15 / full15, 2)
    return out


def lines(runs: Path, names: list[str]) -> str:
    rows = [p for p in (pair(runs, n) for n in names) if p]
    text = []
    for p in rows:
        lo, fu = p["lora"], p["full"]
        text.append(f"{p['lora_run']} / {p['full_run']}: prompts/s {lo['prompts_per_s']} / {fu['prompts_per_s']} = "
                    f"{p['ratio']} at {lo['prompts']} prompts a step"
                    + (f"; the plan's step rebuilt: {lo['plan_prompts_per_s']} / {fu['plan_prompts_per_s']} = "
                       f"{p['plan_ratio']}" if p["plan_ratio"] else ""))
        text.append(f"  generation s {lo['gen_s']} / {fu['gen_s']} = {p['generation_ratio']} (call 15, unmerged, "
                    f"side by side: {p.get('call15_generation_ratio', '-')})")
        for run, role in ((p["lora_run"], lo), (p["full_run"], fu)):
            phases = ", ".join(f"{k} {v}" for k, v in role["phases"].items())
            text.append(f"  {run}: s/step {role['s_per_step']}; phase s: {phases}; peak allocated "
                        f"{role['peak_allocated_mib']} MiB")
    return "\n".join(text) or "no LoRA run with its compare_with run here"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) < 2 or argv[0] in ("-h", "--help"):
        print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
        return 2
    runs = Path(argv[0])
    if "--json" in argv:
        print(json.dumps([p for p in (pair(runs, n) for n in argv[1:] if n != "--json") if p], indent=2))
    else:
        print(lines(runs, argv[1:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
