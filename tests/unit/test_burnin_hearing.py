"""The plan hears the box (tasks/burnin/hearing.py): a burn-in record's figures beside the plan's, the advice where
they disagree (never past the card's cap), the status lines, the card's expected step time from earlier burn-ins,
and the figure (tasks/burnin/plots.py). The records are tests/fixtures/burnin/*.json (GPU-shaped, not a GPU run:
tests/fixtures/burnin/make_records.py makes them with the product's judge)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tasks.burnin import expected_step_s, hearing, hearing_words, status_lines

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "burnin"
PLAN = {"budget_mib": 11134, "breakdown": {"actor_states": 7538, "ref_states": 942},
        "micro_batches": {"actor": 8, "log_prob": 16, "rollout": 256, "critic": 8}}


def record(name: str) -> dict:
    return json.loads((FIXTURES / f"{name}.json").read_text())


def with_memory(rows, process, gpu_mib=12288):
    base = record("passed")
    mem = {"id": "memory", "ok": True, "words": "", "process_peak_mib": process, "planned_peak_mib": 10983,
           "cap_mib": gpu_mib}
    return {**base, "memory_phases": rows, "gpu": {**base["gpu"], "memory_mib": gpu_mib},
            "checks": [c for c in base["checks"] if c["id"] != "memory"] + [mem]}


def row(phase, measured, planned, process=None):
    return {"phase": phase, "calls": 5, "measured_mib": measured, "planned_mib": planned, "process_mib": process,
            "over_plan": measured > planned}


def test_over_the_plan_under_the_budget_changes_nothing():
    h = hearing(with_memory([row("update_actor", 9300, 9064)], process=10700), PLAN)
    (advice,) = [a for a in h["advice"] if a.startswith("update_actor")]
    assert "short by 236" in advice and "no change" in advice


def test_over_the_budget_halves_that_phases_micro_batch():
    h = hearing(with_memory([row("update_actor", 10100, 9064)], process=11500), PLAN)
    (advice,) = [a for a in h["advice"] if a.startswith("update_actor")]
    assert "`train-launcher -- actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4` halves" in advice


def test_room_is_offered_only_where_the_doubled_peak_stays_under_the_budget():
    room = hearing(with_memory([row("compute_ref_log_prob", 2000, 5690)], process=3200), PLAN)
    (advice,) = [a for a in room["advice"] if a.startswith("compute_ref_log_prob")]
    assert "log_prob_micro_batch_size_per_gpu=32" in advice and "under the budget 11134 MiB" in advice
    # well under its figure, but doubling its activations (over the actor's states) would pass the budget: no advice
    tight = hearing(with_memory([row("update_actor", 6000, 9064, process=9500)], process=9500),
                    {**PLAN, "breakdown": {"actor_states": 4000}})
    assert not [a for a in tight["advice"] if a.startswith("update_actor")]


def test_without_the_boxs_plan_the_records_own_copy_serves():
    h = hearing(with_memory([row("update_actor", 24000, 21087)], process=24300, gpu_mib=24576))
    (advice,) = [a for a in h["advice"] if a.startswith("update_actor")]
    assert "over the plan's budget" in advice and "ppo_micro_batch_size_per_gpu=2` halves" in advice   # the P40's 4


def test_speed_says_the_cards_factor_and_the_runs_eta():
    h = hearing(record("passed"), PLAN)
    speed = [a for a in h["advice"] if "x the speed model" in a]
    assert speed and "ETA" in speed[0]


def test_the_plan_report_section_names_every_measured_phase():
    words = hearing_words(record("passed"), PLAN)
    assert words.startswith("Measured on ")
    for r in record("passed")["memory_phases"]:
        assert r["phase"] in words


def test_status_lines():
    assert status_lines(None)[0].startswith("burn-in: never run")
    passed = status_lines(record("passed"))
    assert passed[0].startswith("burn-in: passed") and "reward " in passed[0] and "s/step" in passed[0]
    failed = status_lines(record("failed-reward-fell"))
    assert failed[0].startswith("burn-in: failed") and any(line.startswith("  FAIL reward-fell") for line in failed)
    running = {**record("passed"), "state": "running"}
    assert "interrupted" in status_lines(running, unit_state=None)[0]
    assert status_lines(running, unit_state="running")[0].startswith("burn-in: running")


def test_the_cards_expected_step_time_is_earlier_passed_burnins_on_the_same_plan():
    rec = record("passed")
    same = {"state": "passed", "gpu": rec["gpu"], "plan": rec["plan"], "speed": {"seconds_per_step": 30.0}}
    other_plan = {**same, "plan": {"overrides_sha256": "other"}, "speed": {"seconds_per_step": 99.0}}
    failed = {**same, "state": "failed", "speed": {"seconds_per_step": 99.0}}
    history = [same, {**same, "speed": {"seconds_per_step": 40.0}}, other_plan, failed]
    assert expected_step_s(history, rec["gpu"]["name"], rec["plan"]["overrides_sha256"]) == 35.0
    assert expected_step_s(history, "another card", rec["plan"]["overrides_sha256"]) is None


def test_the_figure(tmp_path):
    pytest.importorskip("matplotlib")
    from tasks.burnin.plots import plot_burnin

    path = plot_burnin("p40", record("passed"), tmp_path)
    assert path == tmp_path / "burnin-p40.png" and path.stat().st_size > 10_000
    assert plot_burnin("p40", {"steps": []}, tmp_path) is None
