"""The burn-in's judge (verl_lab_box/burnin_judge.py, pure): the test of "rises" and why chance does not pass it, NaN
or inf, memory against the plan and the card, seconds against the speed model and earlier burn-ins, and which
reason a failed burn-in gives the doctor."""

from __future__ import annotations

import random

import pytest

from tasks.burnin.plan import RISES
from verl_lab_box import burnin_judge as judge


def steps_of(means: list[float], spread: float = 0.01, groups: int = 16, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for i, m in enumerate(means, 1):
        g = [m + rng.gauss(0, spread) for _ in range(groups)]
        out.append({"step": i, "score": sum(g) / len(g), "se": judge.standard_error(g), "groups": groups})
    return out


def test_standard_error_is_the_group_means_sample_sd_over_root_n():
    assert judge.standard_error([0.4, 0.6]) == pytest.approx(0.1)
    assert judge.standard_error([0.5]) is None


def test_a_rise_of_many_standard_errors_passes_and_says_its_numbers():
    found = judge.reward_test(steps_of([0.50, 0.52, 0.55, 0.58, 0.60]), RISES)
    assert found["id"] == "reward" and found["ok"] is True
    assert found["rise"] == pytest.approx(found["last"] - found["first"], abs=1e-5)
    assert found["needed"] >= RISES["floor"] and "4 standard errors" in found["words"]


@pytest.mark.parametrize("means, reason", [([0.5, 0.5, 0.5, 0.5, 0.5], "reward-flat"),
                                           ([0.5, 0.49, 0.46, 0.43, 0.40], "reward-fell"),
                                           ([0.5, 0.5, 0.5, 0.51, 0.51], "reward-flat")])
def test_flat_or_falling_fails_with_the_doctors_reason(means, reason):
    found = judge.reward_test(steps_of(means), RISES)
    assert (found["id"], found["ok"]) == (reason, False), found


def test_the_floor_holds_where_the_standard_error_is_tiny():
    found = judge.reward_test(steps_of([0.5, 0.5, 0.5, 0.505, 0.505], spread=1e-5), RISES)
    assert found["ok"] is False and found["needed"] == RISES["floor"]


def test_without_a_standard_error_it_does_not_pass():
    steps = [{"step": i, "score": 0.5 + 0.1 * i, "se": None, "groups": 1} for i in range(1, 6)]
    found = judge.reward_test(steps, RISES)
    assert found["ok"] is False and "no standard error" in found["words"]


def test_chance_does_not_pass_it():
    """A fixed policy: every step's prompts drawn around one score (16 prompts a step, as the CPU test has; a GPU
    burn-in has 64-256, so fewer). 20000 burn-ins: the rule's false passes stay under 2 in 1000 (Student's t with
    16 prompts a step: about 5e-4 beyond 4 standard errors; the normal tail 3.2e-5)."""
    passes = sum(judge.reward_test(steps_of([0.5] * 5, spread=0.02, seed=s), RISES)["ok"] is True for s in range(20000))
    assert passes < 40, passes


def test_reward_steps_number_each_runs_lines_from_its_first_step():
    lines = [[{"mean": 0.5, "group_means": [0.5, 0.5], "sequences": 4}] * 2,
             [{"mean": 0.6, "group_means": [0.6, 0.6], "sequences": 4}] * 3]
    steps = judge.reward_steps({3: {"critic/score/mean": 3.2}}, lines, [1, 3])
    assert [s["step"] for s in steps] == [1, 2, 3, 4, 5]
    assert [s["score"] for s in steps] == [0.5, 0.5, 0.6, 0.6, 0.6]


def test_a_step_is_scored_by_the_managers_share_never_by_verls_score():
    """verl's critic/score/mean is the share standardised (the manager hands verl a z-score): a step without the
    manager's line has no score rather than a z-score read as a share."""
    lines = [[{"mean": 0.5, "group_means": [0.5, 0.52], "sequences": 4}]]
    steps = judge.reward_steps({1: {"critic/score/mean": 0.4}, 2: {"critic/score/mean": 3.2}}, lines, [1])
    assert [(s["step"], s["score"]) for s in steps] == [(1, 0.5), (2, None)]


def test_nan_or_inf_in_a_loss_or_gradient_norm_fails():
    ok = judge.non_finite({1: {"actor/pg_loss": 0.1, "timing_s/step": 3.0}})
    assert ok["ok"] is True
    bad = judge.non_finite({1: {"actor/pg_loss": 0.1}, 2: {"actor/grad_norm": "inf", "perf/x": "nan"}})
    assert (bad["id"], bad["ok"]) == ("nan-inf", False) and "step 2: actor/grad_norm=inf" in bad["words"]
    assert "perf/x" not in bad["words"]


PREDICTED = {"phases_mib": {"phase_rollout": 5000, "phase_actor_update": 9000}, "peak_mib": 10400, "cap_mib": 12288,
             "context_mib": 1300}


def phase(name, mib, process=None, error=None):
    return {"phase": name, "seconds": 1.0, "peak_allocated_mib": mib, "peak_reserved_mib": mib,
            "process_mib": process, **({"error": error} if error else {})}


def test_memory_rows_against_the_plan_and_the_card():
    check, rows = judge.memory([phase("generate_sequences", 5200, 6500), phase("update_actor", 8000, 9900)], PREDICTED)
    assert check["ok"] is True and check["process_peak_mib"] == 9900
    assert {r["phase"]: r["over_plan"] for r in rows} == {"generate_sequences": True, "update_actor": False}
    assert "over the plan's phase figure: generate_sequences" in check["words"]


def test_over_the_card_or_out_of_memory_fails():
    over, _ = judge.memory([phase("update_actor", 11000, 12500)], PREDICTED)
    assert (over["id"], over["ok"]) == ("over-cap", False)
    oom, _ = judge.memory([phase("update_actor", 11000, None, "OutOfMemoryError: CUDA out of memory. Tried ...")],
                          PREDICTED)
    assert (oom["id"], oom["ok"]) == ("oom", False)
    # without NVML the reserved peak plus the plan's CUDA context stands for the process
    est, _ = judge.memory([phase("update_actor", 9000, None)], PREDICTED)
    assert est["process_peak_mib"] == 10300


METRICS = {s: {"timing_s/step": t, "timing_s/gen": t / 2, "timing_s/update_actor": t / 4} for s, t in
           {1: 30.0, 2: 20.0, 3: 28.0, 4: 22.0, 5: 22.0}.items()}
MODEL = {"burnin": {"step": 10.0, "rollout": 5.0}, "configured": {"step": 40.0}, "configured_steps": 100}


def test_speed_against_the_model_and_the_configured_runs_eta():
    found = judge.speed(METRICS, [1, 3], MODEL, None)
    assert found["seconds_per_step"] == pytest.approx(64 / 3, abs=0.01)       # steps 2, 4, 5
    assert found["measured_over_model"] == pytest.approx(2.133, abs=0.001)
    assert found["configured_eta_s"] == round(40.0 * (64 / 3) / 10.0 * 100)
    assert found["ok"] is None and "no earlier burn-in" in found["words"]
    assert found["phases_s"]["rollout"] == pytest.approx(32 / 3, abs=0.01)


def test_too_slow_is_more_than_twice_the_cards_earlier_burnins():
    assert judge.speed(METRICS, [1, 3], MODEL, 15.0)["ok"] is True
    slow = judge.speed(METRICS, [1, 3], MODEL, 10.0)
    assert (slow["id"], slow["ok"]) == ("too-slow", False)


PLAN = {"rises": RISES, "runs": [{"name": "first"}, {"name": "resumed"}], "predicted": PREDICTED,
        "speed_model": MODEL}


def test_a_failed_verl_run_is_the_finding_when_nothing_names_a_cause():
    result = {"runs": [{"name": "first", "rc": 1}], "metrics": {}, "rewards": [[]], "first_steps": [1]}
    verdict = judge.judge(result, PLAN)
    assert verdict["failed"] == ["verl-failed"]
    assert next(c for c in verdict["checks"] if c["id"].startswith("reward"))["ok"] is None


def test_a_passing_burnin():
    rewards = [[{"mean": m, "group_means": [m - 0.01, m, m + 0.01, m]} for m in ms]
               for ms in ([0.5, 0.52], [0.56, 0.58, 0.6])]
    result = {"runs": [{"name": "first", "rc": 0}, {"name": "resumed", "rc": 0}], "metrics": METRICS,
              "rewards": rewards, "first_steps": [1, 3], "phases": [phase("update_actor", 8000, 9900)],
              "save": {"id": "save", "ok": True, "words": ""}}
    verdict = judge.judge(result, PLAN)
    assert verdict["passed"] and verdict["failed"] == [], verdict["checks"]
    assert verdict["reward"]["first"] == 0.5 and verdict["speed"]["configured_eta_s"]
