"""The GPU harness's probe (bench/gpu/probe/sitecustomize.py), its code paths run on CPU.

* The correctness figure: the probe records the HF rollout's own log-probs of the tokens it samples, and they agree
  with the actor's log-probs once patch 0004 is in, and not before. This is what makes the log-prob gap reported in
  docs/training-runs.md mean what it says.
* Where the time goes: verl's own ActorRolloutRefWorker (the GTX 1080 plan's offload rung, shrunk:
  tests/unit/test_fsdp2_gather.py) runs under the probe with ``VERL_LAB_PROFILE``: the chosen calls' profile tables
  (torch.profiler on CPU) and every call's wall-clock splits and the process's threads come out, and they count
  what the worker did. The GPU's own rows (H2D/D2H copies, kernels) exist only on a GPU: not shown here.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tasks.verl import source as verl_source
from tests.unit.test_fsdp2_gather import (
    LOG_PROB_MICRO,
    MICRO_PER_MINI,
    MINI_BATCHES,
    _result,
    plan_overrides,
    tiny_model,
)
from tests.unit.test_hf_rollout import PATCH, _tree

REPO = Path(__file__).resolve().parents[2]
CHECK = REPO / "tests" / "fixtures" / "gpu_probe_check.py"
PROBE = REPO / "bench" / "gpu" / "probe"


@pytest.mark.parametrize("tree", ["before", "patched"])
def test_probe_measures_the_rollout_actor_gap(served, tmp_path, tree):
    patches = verl_source.patch_files()
    chosen = [p for p in patches if p.name < PATCH] if tree == "before" else patches
    root = _tree(tmp_path / "tree", chosen)
    probe_dir = tmp_path / "probe"
    env = {**os.environ, "PYTHONPATH": f"{PROBE}{os.pathsep}{root}", "VERL_LAB_PROBE_DIR": str(probe_dir)}
    res = subprocess.run([served.python(env), str(CHECK)], cwd=root, env=env, capture_output=True, text=True,
                         timeout=600)
    lines = [line for line in res.stdout.splitlines() if line.startswith("RESULT ")]
    assert res.returncode == 0 and lines, res.stdout[-3000:] + res.stderr[-3000:]
    found = json.loads(lines[-1][len("RESULT "):])
    records = [json.loads(line) for f in probe_dir.glob("*.jsonl") for line in f.read_text().splitlines()]
    assert any(r["event"] == "generate" and r["sampled"] for r in records)
    if tree == "patched":
        assert found["gap"] < 1e-4, found
    else:
        assert found["gap"] > 0.1, found


PROFILED = "generate_sequences@3,update_actor@2,compute_ref_log_prob,compute_log_prob:2,compute_values,bad:x,x@y"


@pytest.fixture(scope="module")
def profiled_run(served, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("probe-profile")
    root = _tree(tmp / "tree", [p for p in verl_source.patch_files()])
    spec = tmp / "spec.json"
    spec.write_text(json.dumps({"overrides": plan_overrides(tiny_model(tmp / "model"))}))
    probe_dir = tmp / "probe"
    env = {**os.environ, "PYTHONPATH": f"{PROBE}{os.pathsep}{root}", "VERL_LAB_PROBE_DIR": str(probe_dir),
           "VERL_LAB_PROFILE": PROFILED}
    result = _result(served.python(env), root, "run", spec, tmp / "out.pt", env=env)
    records = [json.loads(line) for f in probe_dir.glob("probe-*.jsonl") for line in f.read_text().splitlines()]
    profiles = {p.name.split("-", 1)[1].rsplit("-", 1)[0]: (json.loads(p.read_text()), p.stat().st_size)
                for p in probe_dir.glob("profile-*.json")}
    return result, records, profiles, probe_dir


def test_probe_profiles_the_chosen_calls_only(profiled_run):
    _, _, profiles, _ = profiled_run
    # phase:N picks the N-th call; a phase the worker never runs and a malformed item profile nothing
    assert sorted(profiles) == ["compute_log_prob-2", "compute_ref_log_prob-1", "generate_sequences-1", "update_actor-1"]
    for name, (table, size) in profiles.items():
        assert size < 64 * 1024, name                      # small enough to come back in runs.tgz
        assert table["wall_s"] > 0 and table["top_self_cpu"], name
    # @K: a window of K forwards of the call's model after the first two; else the whole call
    assert profiles["generate_sequences-1"][0]["forwards"] == 3 and profiles["update_actor-1"][0]["forwards"] == 2
    assert profiles["compute_log_prob-2"][0]["forwards"] is None


def test_probe_profile_counts_what_the_update_did(profiled_run):
    result, _, profiles, _ = profiled_run
    whole = profiles["compute_ref_log_prob-1"][0]["categories"]
    assert whole["fsdp pre_forward"]["count"] == result["units"] * LOG_PROB_MICRO     # every forward of every unit
    # the update's window: micro-batches 3 and 4 (forward, backward and their gradient reductions), the last two
    # of the first mini-batch, so its optimizer step too
    window = profiles["update_actor-1"][0]["categories"]
    assert window["fsdp post_backward_reduce"]["count"] == 2 * result["units"] == 2 * result["moves"]["update_actor"][
        "reductions"] // (MINI_BATCHES * MICRO_PER_MINI)
    assert MICRO_PER_MINI == 4 and window["optimizer_step"]["count"] == 1
    assert window["cpu_only_aten_ops"]["ms"] > 0            # the offloaded gradient sums run on the CPU


def test_probe_splits_and_threads(profiled_run):
    _, records, _, _ = profiled_run
    threads = [r for r in records if r["event"] == "threads"]
    assert len(threads) == 1 and threads[0]["torch_threads"] >= 1 and threads[0]["cpu_count"] >= 1
    phases = {(r["phase"], r["call"]): r for r in records if r["event"] == "phase"}
    update = phases[("update_actor", 1)]
    splits = update["splits"]
    assert splits["forward_calls"] == splits["backward_calls"] == MINI_BATCHES * MICRO_PER_MINI
    assert splits["optimizer_step_calls"] == splits["adamw_step_calls"] == MINI_BATCHES
    assert 0 < splits["adamw_step_s"] < splits["optimizer_step_s"]
    assert 0 < splits["forward_s"] + splits["backward_s"] + splits["optimizer_step_s"] < update["seconds"]
    assert update["profiled"] is True and "profiled" not in phases[("compute_log_prob", 1)]
    assert phases[("compute_log_prob", 1)]["splits"] == {**phases[("compute_log_prob", 1)]["splits"],
                                                         "forward_calls": LOG_PROB_MICRO}


def test_results_summarise_the_probe_records(profiled_run):
    """bench/gpu/ppo_results.py reads what the probe wrote: the phases' calls after the first with their splits,
    the profile tables, the threads (what --speed prints)."""
    import importlib.util

    _, records, profiles, probe_dir = profiled_run
    spec = importlib.util.spec_from_file_location("ppo_results", REPO / "bench/gpu/ppo_results.py")
    results = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(results)
    phases = results.step_phases(records)
    second = next(r for r in records if r["event"] == "phase" and r["phase"] == "compute_log_prob" and r["call"] == 2)
    assert phases["compute_log_prob"]["calls"] == 1 and phases["compute_log_prob"]["seconds"] == round(second["seconds"], 2)
    assert phases["update_actor"]["optimizer_step_calls"] == MINI_BATCHES      # one call: its own splits
    tables = results.read_profiles(probe_dir)
    assert sorted(f"{t['phase']}-{t['call']}" for t in tables) == sorted(profiles)
    text = results.time_markdown([{"profile": "cpu", "step_phases": phases, "profiles": tables,
                                   "threads": next(r for r in records if r["event"] == "threads")}])
    assert "| cpu | update_actor:1 (2 forwards) |" in text and "fsdp post_backward_reduce" in text
    assert "torch CPU threads" in text and "| cpu | update_actor |" in text
