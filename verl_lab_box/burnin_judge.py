"""Whether a burn-in passed: its records read against its plan (pure; standard library only).

Placed beside the launcher as ``verl_lab_burnin_judge.py``; the launcher's burn-in (verl_lab_box/burnin.py) hands
it what the run left (the probe's and the reward's JSON lines, verl's exit statuses, the save, the resume, the
export's proof, the weights check) and writes what it returns into the burn-in record. Each check is
``{"id", "ok", "words"}``: ``ok`` is True, False (the burn-in fails, and ``id`` is the doctor's reason:
files/doctor/burnin.toml), or None (not judged, and why). docs/burnin.md states every test and its numbers.

The test of "rises" (``reward_test``): the mean score of the last ``last`` steps minus the first step's must be at
least ``z`` standard errors and at least ``floor``; the standard error of a step's mean is that of its prompts'
group means (a prompt's samples are not independent of each other). With the policy fixed, the steps' means are
draws around one value, so the difference passes by chance with probability below the normal tail beyond ``z``
(3.2e-5 at z = 4); a fall as large is the reward falling (``reward-fell``), anything between is ``reward-flat``.
"""

from __future__ import annotations

import math

# verl's phase timings (timing_s/<key>) -> the speed model's phase (tasks/speed.py)
SPEED_PHASES = {"gen": "rollout", "old_log_prob": "actor_log_prob", "ref": "ref_log_prob", "values": "critic",
                "update_critic": "critic", "update_actor": "update"}
# the probe's worker calls -> the plan's phase peaks (plan.json breakdown)
MEMORY_PHASES = {"generate_sequences": "phase_rollout", "compute_log_prob": "phase_actor_logprob",
                 "compute_ref_log_prob": "phase_ref_logprob", "compute_values": "phase_critic_values",
                 "update_critic": "phase_critic_update", "update_actor": "phase_actor_update"}
WATCHED = ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/pg_clipfrac", "actor/ppo_kl", "critic/vf_loss",
           "critic/grad_norm", "critic/score/mean", "critic/advantages/mean", "critic/returns/mean")
SLOWER = 2.0          # "too slow": a step takes more than twice what earlier burn-ins of this card took
OOM = ("OutOfMemoryError", "CUDA out of memory", "CUDA error: out of memory")


def check(ident: str, ok, words: str) -> dict:
    return {"id": ident, "ok": ok, "words": words}


def mean(values):
    values = list(values)
    return sum(values) / len(values) if values else None


def standard_error(groups: list[float]) -> float | None:
    """The standard error of the mean of ``groups`` (sample standard deviation / sqrt(n)); None under two."""
    if len(groups) < 2:
        return None
    m = mean(groups)
    return math.sqrt(sum((g - m) ** 2 for g in groups) / (len(groups) - 1) / len(groups))


def reward_steps(metrics: dict[int, dict], rewards: list[list[dict]], first_steps: list[int]) -> list[dict]:
    """Per step: the reward manager's mean share and its group means. verl's ``critic/score/mean`` is not the share
    (it is the share standardised, verl_lab_box/burnin_reward.py): a step whose manager left no line has no score.
    ``rewards`` holds each verl run's reward lines in order, ``first_steps`` the first step each run trained (1, then
    the step after the save)."""
    by_step = {}
    for lines, first in zip(rewards, first_steps):   # a record without first_steps: its first run's
        for i, line in enumerate(lines):
            by_step[first + i] = line
    out = []
    for step in sorted(set(metrics) | set(by_step)):
        line = by_step.get(step, {})
        score = line.get("mean")
        groups = line.get("group_means") or []
        out.append({"step": step, "score": score if isinstance(score, (int, float)) else None,
                    "se": standard_error(groups), "groups": len(groups), "sequences": line.get("sequences")})
    return out


def reward_test(steps: list[dict], rule: dict) -> dict:
    """``rule``: ``{"z", "floor", "last"}``. Returns the check with the figures it used."""
    scored = [s for s in steps if s["score"] is not None]
    last_n = int(rule.get("last", 2))
    if len(scored) < last_n + 1:
        return {**check("reward-flat", False, f"{len(scored)} scored steps: the test needs {last_n + 1}"),
                "first": scored[0]["score"] if scored else None, "last": None}
    first, last = scored[0], scored[-last_n:]
    rise = mean(s["score"] for s in last) - first["score"]
    errors = [s["se"] for s in [first, *last]]
    if any(e is None for e in errors):
        se = None
    else:
        se = math.sqrt(first["se"] ** 2 + sum(e ** 2 for e in errors[1:]) / last_n ** 2)
    z, floor = float(rule["z"]), float(rule["floor"])
    need = max(floor, z * se) if se is not None else None
    figures = {"first": round(first["score"], 5), "last": round(mean(s["score"] for s in last), 5),
               "rise": round(rise, 5), "standard_error": None if se is None else round(se, 6),
               "needed": None if need is None else round(need, 5), "steps": [s["step"] for s in scored]}
    words = (f"score {figures['first']:.4f} at step {first['step']} -> {figures['last']:.4f} over steps "
             f"{', '.join(str(s['step']) for s in last)} ({rise:+.4f}; ")
    if need is None:
        return {**check("reward-flat", False, words + "no standard error: fewer than two prompts a step)"), **figures}
    words += f"needed {need:.4f}: {z:g} standard errors of {se:.4f}, at least {floor:g})"
    if rise >= need:
        return {**check("reward", True, "rises: " + words), **figures}
    if rise <= -need:
        return {**check("reward-fell", False, "falls: " + words), **figures}
    return {**check("reward-flat", False, "does not rise: " + words), **figures}


def non_finite(metrics: dict[int, dict]) -> dict:
    """The first step whose losses, gradient norms or scores are NaN or infinite."""
    for step in sorted(metrics):
        bad = sorted(k for k, v in metrics[step].items() if isinstance(v, str) and (k in WATCHED or "loss" in k
                                                                                   or "grad_norm" in k))
        if bad:
            return check("nan-inf", False, f"step {step}: {', '.join(f'{k}={metrics[step][k]}' for k in bad)}")
    return check("nan-inf", True, f"no NaN or inf in {len(metrics)} steps' losses, gradient norms and scores")


def memory(phases: list[dict], predicted: dict) -> tuple[dict, list[dict]]:
    """Peak allocated memory per phase against the plan's, the process's GPU memory against the plan's peak and
    the card. ``predicted``: ``{"phases_mib": {plan key: MiB}, "peak_mib", "cap_mib", "context_mib"}``. The check
    fails on an out-of-memory error or a process over the card's memory; a phase over its prediction under the
    card is told as a row (the plan hears it: tasks/burnin/hearing.py), not failed."""
    rows, held, errors = [], [], []
    for phase, key in MEMORY_PHASES.items():
        calls = [p for p in phases if p.get("phase") == phase]
        errors += [p["error"] for p in calls if any(o in (p.get("error") or "") for o in OOM)]
        peaks = [p["peak_allocated_mib"] for p in calls if p.get("peak_allocated_mib") is not None]
        held += [p["process_mib"] for p in calls if p.get("process_mib") is not None]
        if calls:
            planned = (predicted.get("phases_mib") or {}).get(key)
            mine = [p["process_mib"] for p in calls if p.get("process_mib") is not None]
            rows.append({"phase": phase, "calls": len(calls), "measured_mib": max(peaks) if peaks else None,
                         "process_mib": max(mine) if mine else None, "planned_mib": planned,
                         "over_plan": bool(peaks and planned and max(peaks) > planned)})
    cap, peak = predicted.get("cap_mib"), predicted.get("peak_mib")
    top = max(held) if held else None
    if top is None:
        reserved = [p["peak_reserved_mib"] for p in phases if p.get("peak_reserved_mib") is not None]
        top = round(max(reserved) + (predicted.get("context_mib") or 0), 1) if reserved else None
    summary = {"process_peak_mib": top, "planned_peak_mib": peak, "cap_mib": cap}
    if errors:
        return {**check("oom", False, f"out of memory: {errors[0][:300]}"), **summary}, rows
    if top is None:
        return {**check("memory", None, "no GPU memory was measured (no GPU, or no phase ran)"), **summary}, rows
    if cap and top > cap:
        return {**check("over-cap", False, f"the process held {top:.0f} MiB, more than the card's {cap} MiB"),
                **summary}, rows
    over = [r["phase"] for r in rows if r["over_plan"]]
    words = f"the process held at most {top:.0f} MiB (plan {peak} MiB, card {cap} MiB)"
    return {**check("memory", True, words + (f"; over the plan's phase figure: {', '.join(over)}" if over else "")),
            **summary}, rows


def speed(metrics: dict[int, dict], first_steps: list[int], model: dict, expected_step_s: float | None) -> dict:
    """Seconds per step and per phase over the steps that are not a run's first (it warms up), against the speed
    model's; the configured run's ETA from them (``model``: ``{"burnin": {phase: s}, "configured": {phase: s},
    "configured_steps": N}``); too slow where a step takes more than SLOWER x ``expected_step_s``."""
    warm = [s for s in sorted(metrics) if s not in first_steps and "timing_s/step" in metrics[s]] or \
           [s for s in sorted(metrics) if "timing_s/step" in metrics[s]]
    if not warm:
        return check("speed", None, "no timed step")
    per_step = mean(metrics[s]["timing_s/step"] - (metrics[s].get("timing_s/save_checkpoint") or 0) for s in warm)
    phases: dict[str, float] = {}
    for key, phase in SPEED_PHASES.items():
        values = [metrics[s].get(f"timing_s/{key}") for s in warm]
        if any(isinstance(v, (int, float)) for v in values):
            phases[phase] = phases.get(phase, 0.0) + mean(v for v in values if isinstance(v, (int, float)))
    burnin_model = (model or {}).get("burnin") or {}
    configured = (model or {}).get("configured") or {}
    ratio = per_step / burnin_model["step"] if burnin_model.get("step") else None
    steps = (model or {}).get("configured_steps")
    eta = round(configured["step"] * ratio * steps) if ratio and configured.get("step") and steps else None
    out = {"seconds_per_step": round(per_step, 2), "steps_timed": warm,
           "step_seconds": {str(s): metrics[s]["timing_s/step"] for s in sorted(metrics) if "timing_s/step" in metrics[s]},
           "phases_s": {k: round(v, 2) for k, v in phases.items()},
           "model_s": burnin_model, "measured_over_model": None if ratio is None else round(ratio, 3),
           "configured_step_s": None if ratio is None or not configured.get("step") else round(configured["step"] * ratio, 1),
           "configured_eta_s": eta, "expected_step_s": expected_step_s}
    if expected_step_s:
        slow = per_step > SLOWER * expected_step_s
        words = (f"{per_step:.1f} s a step, {'more than' if slow else 'within'} {SLOWER:g} x the {expected_step_s:.1f} s "
                 "earlier burn-ins of this card took")
        return {**check("too-slow" if slow else "speed", not slow, words), **out}
    model_words = f" (the speed model, H200 seconds: {burnin_model['step']:.1f})" if burnin_model.get("step") else ""
    return {**check("speed", None, f"{per_step:.1f} s a step{model_words}; no earlier burn-in of this card to judge "
                                   "it against: this one becomes the expectation"), **out}


def judge(result: dict, plan: dict) -> dict:
    """Every check of a finished burn-in (``result``: what verl_lab_box/burnin.py gathered) and whether it passed."""
    runs = result.get("runs") or []
    broken = next((r for r in runs if r.get("rc") != 0), None)
    if len(runs) < len(plan.get("runs") or runs) and broken is None:
        broken = {"name": plan["runs"][len(runs)]["name"], "rc": "not started"}
    metrics = result.get("metrics") or {}
    steps = reward_steps(metrics, result.get("rewards") or [], result.get("first_steps") or [1])
    reward = reward_test(steps, plan["rises"])
    fast = speed(metrics, result.get("first_steps") or [1], plan.get("speed_model") or {}, plan.get("expected_step_s"))
    mem, rows = memory(result.get("phases") or [], plan.get("predicted") or {})
    if broken:       # the steps it has are too few to judge learning or speed by: the cause is the finding
        why = f"not judged: verl's {broken['name']} run exited {broken['rc']}"
        reward, fast = {**reward, **check(reward["id"], None, why)}, {**fast, **check("speed", None, why)}
    checks = [reward, non_finite(metrics), mem, fast]
    checks += [result[k] for k in ("save", "resume", "weights", "export") if result.get(k)]
    if broken and not any(c["ok"] is False for c in checks):
        checks.insert(0, check("verl-failed", False, f"verl's {broken['name']} run exited {broken['rc']} (its error is "
                                                     "above in the burn-in's log)"))
    failed = [c["id"] for c in checks if c["ok"] is False]
    return {"passed": not failed, "failed": failed, "checks": checks, "steps": steps, "memory_phases": rows,
            "reward": {k: reward.get(k) for k in ("first", "last", "rise", "standard_error", "needed")},
            "speed": {k: v for k, v in fast.items() if k not in ("id", "ok", "words")}}
