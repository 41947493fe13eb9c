"""The burn-in's GPU harness, run here (plumbing: the device runs what these render): bench/gpu/burnin_profiles.py renders
each burn-in as the train and burn-in stages place it, bench/gpu/run_profile.py lays it out and runs the launcher's
``--burnin --no-preflight``, bench/gpu/burnin_results.py reads the records back (on the GPU-shaped records of
tests/fixtures/burnin/, which the GPU call's replace)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench" / "gpu"))

import burnin_profiles  # noqa: E402
import burnin_results  # noqa: E402
import payload  # noqa: E402
import run_profile  # noqa: E402


@pytest.fixture(scope="module")
def rendered(tmp_path_factory):
    out = tmp_path_factory.mktemp("profiles")
    burnin_profiles.render(list(burnin_profiles.BURNINS), out, lab_base=str(out / "vl"))
    return out


@pytest.mark.parametrize("name", list(burnin_profiles.BURNINS))
def test_each_burnin_renders_as_the_stages_place_it(rendered, name):
    profile = json.loads((rendered / name / "profile.json").read_text())
    train = rendered / name / "train"
    assert profile["kind"] == "burnin" and profile["cap_mib"] == profile["memory_mib"] - 1311
    assert {"plan.json", "train-launcher", "burnin-plan.json", "verl_lab_burnin.py", "verl_lab_burnin_driver.py",
            "verl_lab_burnin_judge.py", "verl_lab_burnin_weights.py"} <= {p.name for p in train.iterdir()}
    assert sorted(p.name for p in (train / "burnin-probe").iterdir()) == ["sitecustomize.py",
                                                                           "verl_lab_burnin_reward.py"]
    bp = json.loads((train / "burnin-plan.json").read_text())
    plan = json.loads((train / "plan.json").read_text())
    assert bp["prompts"] == (64 if plan["workload"]["rollout_n"] == 1 else 16)
    assert bp["folder"] == f"{profile['lab_root']}/train/burnin"
    mutation = burnin_profiles.BURNINS[name].mutation
    assert profile["verl_tree"] == (f"current-{mutation}" if mutation else "current")


def test_the_four_cards_and_the_mutated_run(rendered):
    rungs = {n: json.loads((rendered / n / "profile.json").read_text())["plan"]["rung"] for n in burnin_profiles.BURNINS}
    assert rungs == {"p40-burnin": "ppo", "gtx1080-burnin": "grpo-cpu-offload", "rtx3060-burnin": "grpo-cpu-offload",
                     "gtx1080-lora-burnin": "grpo-lora", "rtx3060-burnin-sign-flipped": "grpo-cpu-offload"}
    for mutation in payload.BURNIN_MUTATIONS:       # the payload builds a tree for each: its patch is there
        assert (payload.MUTATIONS / f"{mutation}.diff").is_file()


def test_the_device_lays_it_out_and_runs_the_launchers_burnin(rendered, tmp_path):
    src = rendered / "gtx1080-lora-burnin"
    profile = json.loads((src / "profile.json").read_text())
    root = run_profile.lay_out(profile, src, tmp_path / "model", tmp_path)
    assert (root / "train" / "burnin-probe" / "sitecustomize.py").is_file()
    cmd = run_profile.command(profile, root, {})
    assert cmd[1:] == [str(root / "train" / "train-launcher"), "--burnin", "--no-preflight"]


def _runs(tmp_path, rendered, pairs) -> Path:
    runs = tmp_path / "runs"
    for name, record in pairs:
        (runs / name).mkdir(parents=True)
        shutil.copy(rendered / name / "profile.json", runs / name)
        shutil.copy(REPO / "tests" / "fixtures" / "burnin" / f"{record}.json", runs / name / "burnin.json")
        (runs / name / "run.json").write_text(json.dumps({"rc": 0, "timed_out": False, "seconds": 300.0}))
    return runs


def test_the_read_back_says_what_each_burnin_showed(rendered, tmp_path):
    runs = _runs(tmp_path, rendered, [("p40-burnin", "passed"), ("rtx3060-burnin-sign-flipped", "failed-reward-fell"),
                                      ("rtx3060-burnin", "failed-reward-fell")])
    out = subprocess.run([sys.executable, str(REPO / "bench" / "gpu" / "burnin_results.py"), str(runs)],
                         capture_output=True, text=True, check=True).stdout
    assert "== p40-burnin: passed, expected passed: AS EXPECTED" in out
    assert "== rtx3060-burnin-sign-flipped: failed (reward-fell), expected reward-fell: AS EXPECTED" in out
    assert "== rtx3060-burnin: failed (reward-fell), expected passed: NOT AS EXPECTED" in out
    assert "reward 0.5022 -> 0.5257" in out and "peak 22187 MiB (plan 22455" in out and "s a step (speed model" in out
    assert "burn-ins as expected: 2 of 3" in out
    found = burnin_results.summary(burnin_results.read(runs / "p40-burnin"))
    assert found["phases"] and all(p["ratio"] for p in found["phases"])


def test_the_read_back_of_a_run_cut_before_its_verdict_prints_its_shares():
    """GPU call 17's P40 burn-in (a real record, killed at its limit after step 3): no verdict, but each step's
    share from the reward manager's lines and verl's ppo_kl from its metrics."""
    runs = REPO / "bench" / "gpu" / "results" / "burnin-20261205" / "call17" / "runs"
    found = burnin_results.summary(burnin_results.read(runs / "p40-burnin"))
    assert found["state"] == "running" and found["as_expected"] is False
    assert [(s["step"], round(s["share"], 4)) for s in found["steps"]] == [(1, 0.507), (2, 0.4943), (3, 0.4925),
                                                                          (4, 0.4936)]
    assert round(found["steps"][0]["ppo_kl"], 3) == 0.221 and found["steps"][3]["ppo_kl"] is None
    told = burnin_results.words(found)
    assert "share by step: 1: 0.5070 +- 0.0031 (ppo_kl 0.221)" in told
    # what verl was handed then (the share itself) and how far its critic was from it
    assert "critic/score/mean by step: 1: 0.507 (vf_explained_var -251.5)" in told


CALLS_20261206 = REPO / "bench" / "gpu" / "results" / "burnin-20261206"


@pytest.mark.parametrize("call, name, state, failed, first, last, needed", [
    ("callA", "p40-burnin", "passed", [], 0.5055, 0.5461, 0.0185),
    ("callA", "gtx1080-lora-burnin", "passed", [], 0.5118, 0.5280, 0.0160),
    ("callB", "rtx3060-burnin", "passed", [], 0.5014, 0.5342, 0.0152),
    ("callB", "gtx1080-burnin", "passed", [], 0.4985, 0.5376, 0.0172),
    ("callB", "rtx3060-burnin-sign-flipped", "failed", ["reward-fell"], 0.5059, 0.4678, 0.0155),
])
def test_the_gpu_calls_of_2026_12_06_read_back_as_docs_burnin_says(call, name, state, failed, first, last, needed):
    """GPU calls A and B of 2026-12-06 (real records, an H100, each capped as its card): every burn-in reached its
    verdict and ended as expected; the figures are docs/burnin.md's "On the GPU" table."""
    found = burnin_results.summary(burnin_results.read(CALLS_20261206 / call / "runs" / name))
    assert (found["state"], found["failed"], found["as_expected"]) == (state, failed, True)
    reward = found["reward"]
    assert (round(reward["first"], 4), round(reward["last"], 4), round(reward["needed"], 4)) == (first, last, needed)
    # each phase that ran at the plan's shape holds within 6% of the plan's figure (the rollout runs the burn-in's
    # smaller batch: under it)
    assert found["phases"] and all(p["ratio"] <= 1.06 for p in found["phases"])
