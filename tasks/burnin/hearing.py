"""The plan hears the box (pure): a burn-in record (verl_lab_box/burnin.py's ``burnin.json``) beside the prediction
it ran against, and what the box should change where they disagree (docs/burnin.md, "The plan hears the box").

The rules, per phase of the plan's memory model (the probe's peak allocated against plan.json's ``phase_*``):

* over the plan: the estimate is short there. Under the plan's budget the run still fits (no change; the margin is
  gone); over it, halve that phase's micro-batch (the override to pass) — a smaller micro-batch only lowers a peak;
* well under the plan (below ``ROOM``) with room: doubling the phase's micro-batch is offered only where the peak it
  would make (the measured activations doubled) stays under the plan's budget, which is under the card's memory:
  advice never goes past the cap;
* speed: the measured seconds against the speed model's H200 seconds give the card's factor and the configured
  run's ETA; slower than ``SLOWER`` x earlier burn-ins of this card (``expected_step_s``) is "too slow".

Nothing here changes a plan: it says what to pass (``train-launcher -- KEY=VALUE`` for a run by hand) and which
setting makes the plan choose it, and status shows the measured ETA beside the H200 one.
"""

from __future__ import annotations

import statistics

ROOM = 0.7
# plan.json breakdown phase -> (the verl override of its micro-batch, plan.json micro_batches key)
MICRO_BATCH = {"phase_rollout": ("+actor_rollout_ref.rollout.micro_batch_size", "rollout"),
               "phase_actor_logprob": ("actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu", "log_prob"),
               "phase_ref_logprob": ("actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu", "log_prob"),
               "phase_critic_values": ("critic.forward_micro_batch_size_per_gpu", "critic"),
               "phase_critic_update": ("critic.ppo_micro_batch_size_per_gpu", "critic"),
               "phase_actor_update": ("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", "actor")}
PROBE_TO_PLAN = {"generate_sequences": "phase_rollout", "compute_log_prob": "phase_actor_logprob",
                 "compute_ref_log_prob": "phase_ref_logprob", "compute_values": "phase_critic_values",
                 "update_critic": "phase_critic_update", "update_actor": "phase_actor_update"}
STATIC = {"phase_rollout": "actor_states", "phase_actor_logprob": "actor_states", "phase_ref_logprob": "ref_states",
          "phase_critic_values": "critic_states", "phase_critic_update": "critic_states",
          "phase_actor_update": "actor_states"}


MEMORY_CHECKS = ("memory", "oom", "over-cap")


def _memory_check(record: dict) -> dict:
    return next((c for c in record.get("checks") or [] if c["id"] in MEMORY_CHECKS), {})


def _plan_value(key: str, plan: dict | None, record: dict):
    """A plan figure: the plan given (the box's plan.json now) first, else the record's copy of the one it ran."""
    return (plan or {}).get(key) or (record.get("plan") or {}).get(key)


def _advice_for(row: dict, record: dict, plan: dict | None) -> str | None:
    key = PROBE_TO_PLAN.get(row["phase"])
    measured, planned = row.get("measured_mib"), row.get("planned_mib")
    if key is None or measured is None or not planned:
        return None
    budget = _plan_value("budget_mib", plan, record)
    m = (_plan_value("micro_batches", plan, record) or {}).get(MICRO_BATCH[key][1])
    override = MICRO_BATCH[key][0]
    process = row.get("process_mib")
    if process is None:
        process = _memory_check(record).get("process_peak_mib")
    context = max(0.0, process - measured) if process is not None else 0.0
    if measured > planned:
        words = f"{row['phase']}: measured {measured:.0f} MiB, the plan {planned:.0f} MiB (short by {measured - planned:.0f})"
        if budget and process is not None and process <= budget:
            return words + f"; the process peaked at {process:.0f} MiB, under the plan's budget {budget} MiB: no change"
        fix = f"`train-launcher -- {override}={max(1, m // 2)}` halves its micro-batch" if m else \
            "a smaller workload.train_batch_size lowers it"
        return words + f"; over the plan's budget {budget} MiB: {fix}"
    static = (_plan_value("breakdown", plan, record) or {}).get(STATIC[key]) or 0
    if measured < ROOM * planned and m and budget:
        doubled = measured + max(0.0, measured - static) + context
        if doubled <= budget:
            return (f"{row['phase']}: measured {measured:.0f} MiB of the plan's {planned:.0f}: a micro-batch of {2 * m} "
                    f"(`{override}={2 * m}`) would peak near {doubled:.0f} MiB, under the budget {budget} MiB (the card: "
                    f"{(record.get('gpu') or {}).get('memory_mib')} MiB)")
    return None


def hearing(record: dict, plan: dict | None = None) -> dict:
    """The record's figures beside the prediction, and the advice (``plan``: the box's plan.json, for its budget,
    micro-batches and breakdown; the record's own copy of the plan it ran where it is absent)."""
    checks = {c["id"]: c for c in record.get("checks") or []}
    rows = record.get("memory_phases") or []
    advice = [a for a in (_advice_for(r, record, plan) for r in rows) if a]
    speed = record.get("speed") or {}
    ratio = speed.get("measured_over_model")
    if ratio:
        eta = speed.get("configured_eta_s")
        advice.append(f"this box runs the plan at {ratio:.2f} x the speed model's H200 seconds"
                      + (f": the configured run's ETA is {eta / 3600:.1f} h ({speed.get('configured_step_s')} s a "
                         "step)" if eta else ""))
    if "too-slow" in checks:
        advice.append("slower than earlier burn-ins of this card: look at its clocks and throttling (nvidia-smi -q -d "
                      "PERFORMANCE), its PCIe link (nvidia-smi -q -d PCIE) and what else runs on the host's CPUs")
    for reason, words in (("reward-flat", "the update did not move the reward: the doctor names why"),
                          ("reward-fell", "the update moved the reward the wrong way: the doctor names why")):
        if reason in checks:
            advice.append(words)
    return {"host": record.get("host"), "state": record.get("state"), "memory": rows,
            "process_peak_mib": _memory_check(record).get("process_peak_mib"),
            "planned_peak_mib": (record.get("plan") or {}).get("predicted_peak_mib"),
            "cap_mib": (record.get("gpu") or {}).get("memory_mib"), "speed": speed,
            "reward": record.get("reward") or {}, "advice": advice}


def _mib(v) -> str:
    return "-" if v is None else f"{v:.0f}"


def hearing_words(record: dict, plan: dict | None = None) -> str:
    """The plan report's section: measured on the box beside predicted, then the advice."""
    h = hearing(record, plan)
    lines = [f"Measured on {h['host']} by its burn-in ({record.get('started', '?')}, {h['state']}):",
             f"  {'phase':<22} {'plan MiB':>9} {'measured':>9}   {'model s':>8} {'measured s':>10}"]
    model = (h["speed"].get("model_s") or {})
    measured_s = h["speed"].get("phases_s") or {}
    speed_of = {"generate_sequences": "rollout", "compute_log_prob": "actor_log_prob",
                "compute_ref_log_prob": "ref_log_prob", "update_actor": "update", "compute_values": "critic"}
    for r in h["memory"]:
        s = speed_of.get(r["phase"])
        lines.append(f"  {r['phase']:<22} {_mib(r.get('planned_mib')):>9} {_mib(r.get('measured_mib')):>9}   "
                     f"{model.get(s, '-') if s else '':>8} {measured_s.get(s, '-') if s else '':>10}")
    lines.append(f"  process peak {_mib(h['process_peak_mib'])} MiB (plan {_mib(h['planned_peak_mib'])}, card "
                 f"{_mib(h['cap_mib'])}); {h['speed'].get('seconds_per_step', '-')} s a step (model "
                 f"{model.get('step', '-')})")
    rw = h["reward"]
    if rw.get("first") is not None:
        lines.append(f"  reward {rw['first']:.4f} -> {rw['last'] if rw.get('last') is None else format(rw['last'], '.4f')}"
                     f" (needed a rise of {rw.get('needed')})")
    lines += [f"  - {a}" for a in h["advice"]] or ["  - the box agrees with its plan: nothing to change"]
    return "\n".join(lines)


def _when(record: dict) -> str:
    return (record.get("ended") or record.get("started") or "?").replace("T", " ")[:16]


def status_lines(record: dict | None, unit_state: str | None = None) -> list[str]:
    """The burn-in's lines under a box's row in the lab's status (``record``: burnin.json, None: never run)."""
    if not record:
        return ["burn-in: never run (pyinfra -y inventory/lab.py deploy/burnin.py)"]
    state = record.get("state")
    if state == "running" and unit_state != "running":
        state = "interrupted"
    head = f"burn-in: {state} {_when(record)}"
    if state in ("running", "interrupted"):
        return [head + (" (the burn-in unit is not running: it was stopped or killed)" if state == "interrupted" else "")]
    rw, sp = record.get("reward") or {}, record.get("speed") or {}
    mem = _memory_check(record)
    bits = []
    if rw.get("first") is not None and rw.get("last") is not None:
        bits.append(f"reward {rw['first']:.3f}->{rw['last']:.3f}")
    if mem.get("process_peak_mib") is not None:
        bits.append(f"peak {mem['process_peak_mib']:.0f}/{mem.get('planned_peak_mib')} MiB")
    if sp.get("seconds_per_step") is not None:
        model = (sp.get("model_s") or {}).get("step")
        bits.append(f"{sp['seconds_per_step']:.1f} s/step" + (f" (model {model:.1f})" if model else ""))
    if sp.get("configured_eta_s"):
        bits.append(f"run ETA {sp['configured_eta_s'] / 3600:.1f} h")
    lines = [head + (f" in {record.get('wall_s', 0):.0f} s" if record.get("wall_s") else "")
             + (": " + ", ".join(bits) if bits else "")]
    lines += [f"  FAIL {c['id']}: {c['words']}" for c in record.get("checks") or [] if c.get("ok") is False]
    return lines


def expected_step_s(history: list[dict], gpu_name: str, overrides_sha256: str | None) -> float | None:
    """What earlier passed burn-ins of this card on the same plan measured a step (their median), None without
    one: "too slow" is judged against it (docs/burnin.md)."""
    seen = [r["speed"]["seconds_per_step"] for r in history
            if r.get("state") == "passed" and (r.get("gpu") or {}).get("name") == gpu_name
            and (r.get("plan") or {}).get("overrides_sha256") == overrides_sha256
            and (r.get("speed") or {}).get("seconds_per_step")]
    return round(statistics.median(seen), 2) if seen else None
