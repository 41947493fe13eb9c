"""The speed model of the CPU-offload rung (tasks/speed.py) and the plan's use of it (tasks/plan/memory_fit.py
search_offload): pure, plain values. What the model rests on is in its docstring; its constants are inferred
from GPU calls 9-10 until the speed runs measure them (bench/gpu/run_speed.sh, docs/training-runs.md)."""

from __future__ import annotations

import itertools
import json
from dataclasses import replace
from pathlib import Path

import pytest

from tasks.plan import (
    FORWARD_MICRO_CHOICES,
    OFFLOAD_KNOBS,
    UNMEASURED_KNOBS,
    GpuTarget,
    Workload,
    default_estimator,
    knob_values,
    load_model_config,
    make_plan,
    offload_seconds,
    rollout_chunk_choices,
)
from tasks.plan.memory_fit import _divisors, _micro_choices
from tasks.speed import DECODE_STEP_S, OffloadStep, offload_step_seconds

REPO = Path(__file__).resolve().parents[2]
# the GTX 1080 Ti's plan before the speed work (call 10, step 2, beside the GTX 1080's run for part of it)
CALL10 = REPO / "bench/gpu/results/ppo-20261205/call10/gtx1080ti"
BEFORE = OffloadStep(params=494_032_768, train_dtype="fp32", sequences=256, mini_batch=64, micro_batch=8,
                     log_prob_micro_batch=8, rollout_chunk=256, prompt_len=256, response_len=256, grad_ckpt=True)


CALL13 = REPO / "bench/gpu/results/ppo-20261206/call13"
GATHERED = {"rollout_gather_once": True, "actor_gather_once": True, "ref_gather_once": True}


def _phase_seconds(run: Path) -> dict[str, float]:
    """Each phase's seconds in its last call (call 10: step 2; call 13: step 1, its update cut)."""
    names = {"generate_sequences": "rollout", "compute_log_prob": "actor_log_prob",
             "compute_ref_log_prob": "ref_log_prob", "update_actor": "update"}
    out = {}
    for line in (p for f in (run / "probe").glob("*.jsonl") for p in f.read_text().splitlines()):
        r = json.loads(line)
        if r.get("event") == "phase" and r["phase"] in names and "seconds" in r:
            out[names[r["phase"]]] = r["seconds"]
    return out


@pytest.mark.parametrize("run,step", [
    (CALL10, BEFORE),                                                              # GTX 1080 Ti plan, fp32
    (CALL13 / "rtx2080ti-before", replace(BEFORE, rollout_dtype="fp16")),          # RTX 2080 Ti plan, fp16 rollout
    (CALL13 / "rtx2080ti-gathered", replace(BEFORE, rollout_dtype="fp16", **GATHERED)),
])
def test_the_model_matches_the_runs_its_constants_came_from(run, step):
    measured = _phase_seconds(run)
    model = offload_step_seconds(step)
    assert measured
    for phase, seconds in measured.items():
        assert 0.8 <= model[phase] / seconds <= 1.25, (phase, model[phase], seconds)


def test_each_knob_cuts_its_own_phase_only():
    plain = offload_step_seconds(BEFORE)
    for knob, phases in {"rollout_gather_once": {"rollout"}, "ref_gather_once": {"ref_log_prob"},
                         "actor_gather_once": {"actor_log_prob", "update"},
                         "accumulate_grads_unsharded": {"update"}, "fused_adamw": {"update"}}.items():
        faster = offload_step_seconds(replace(BEFORE, **{knob: True}))
        changed = {p for p in plain if p != "step" and faster[p] != plain[p]}
        assert changed == phases and all(faster[p] < plain[p] for p in phases), knob
    # gathered once, more chunks add only their decoding steps' own time, not a gather each; the update no longer
    # grows with the micro-batches
    once = replace(BEFORE, rollout_gather_once=True, actor_gather_once=True, accumulate_grads_unsharded=True)
    more_chunks = offload_step_seconds(replace(once, rollout_chunk=64))["rollout"] - offload_step_seconds(once)["rollout"]
    assert more_chunks == pytest.approx(3 * 256 * DECODE_STEP_S["same"], abs=0.02)
    assert offload_step_seconds(replace(once, micro_batch=1))["update"] == offload_step_seconds(once)["update"]
    assert offload_step_seconds(replace(BEFORE, micro_batch=1))["update"] > 2 * plain["update"]
    # checkpointing costs one more forward
    assert offload_step_seconds(replace(once, grad_ckpt=False))["update"] < offload_step_seconds(once)["update"]


OFFLOAD_CARDS = [("NVIDIA GeForce GTX 1080", "6.1", 8192), ("NVIDIA GeForce GTX 1080 Ti", "6.1", 11264),
                 ("NVIDIA GeForce RTX 2080 Ti", "7.5", 11264), ("NVIDIA GeForce RTX 3060", "8.6", 12288),
                 ("NVIDIA GeForce RTX 4060", "8.9", 8188)]


@pytest.mark.parametrize("name,cc,mib", OFFLOAD_CARDS)
@pytest.mark.parametrize("engine", ["auto", "hf"])
def test_the_plan_takes_the_fastest_configuration_that_fits(name, cc, mib, engine):
    """Every combination of the rung's choices the plan may take (the knobs it may turn on: knob_values;
    checkpointing, micro-batches, chunk), estimated: none that fits is faster by the speed model than the
    plan's, and the plan is no slower by it than the same batches with every knob off. (How much faster a
    step really is, the issue's 2x, is what bench/gpu/run_speed.sh measures on the GPU.)"""
    gpu = GpuTarget(name, cc, mib)
    w = Workload(model_path="m", train_files="t", val_files="v", checkpoint_dir="c", model_config=load_model_config(),
                 rollout_engine=engine, finetune="full")      # "auto" gives these cards LoRA (tasks/plan/lora.py)
    plan = make_plan(gpu, w)
    assert plan.rung == "grpo-cpu-offload"
    w, prec, chosen = plan.workload, plan.precision, plan.memory
    best = offload_seconds(gpu, w, prec, chosen)["step"]
    n = w.rollout_n
    chunks = rollout_chunk_choices(w, gpu) if prec.rollout == "hf" else [chosen.rollout_micro_batch]
    for micro, ckpt, lp, chunk, *knobs in itertools.product(
            _micro_choices(w.ppo_mini_batch_size * n), (False, True),
            _divisors(w.train_batch_size * n, FORWARD_MICRO_CHOICES), chunks, *[knob_values(k) for k in OFFLOAD_KNOBS]):
        other = replace(chosen, actor_micro_batch=micro, critic_micro_batch=micro, grad_ckpt=ckpt,
                        log_prob_micro_batch=lp, rollout_micro_batch=chunk, **dict(zip(OFFLOAD_KNOBS, knobs, strict=True)))
        if prec.rollout != "hf" and other.rollout_gather_once:
            continue
        if default_estimator(gpu, w, prec, other).fits:
            assert offload_seconds(gpu, w, prec, other)["step"] >= best - 1e-6, other
    plain = offload_seconds(gpu, w, prec, replace(chosen, **{k: False for k in OFFLOAD_KNOBS}))["step"]
    assert plain >= best, (plain, best)
    assert not any(getattr(chosen, k) for k in UNMEASURED_KNOBS), chosen


def test_unmeasured_knobs_are_left_off():
    """The update's knobs (patches 0007-0008 through a whole update) have not run to an update's end on a GPU:
    the plan never turns them on; every other knob it may."""
    assert UNMEASURED_KNOBS == {"actor_gather_once", "accumulate_grads_unsharded"}
    assert all(knob_values(k) == (False,) for k in UNMEASURED_KNOBS)
    assert all(knob_values(k) == (True, False) for k in OFFLOAD_KNOBS if k not in UNMEASURED_KNOBS)


def test_the_speed_bench_runs_the_speed_profiles_and_refuses_others(tmp_path):
    """bench/gpu/run_speed.sh (the device's one command): its time limits name exactly the speed profiles of
    bench/gpu/ppo_profiles.py (before and after per card, and the knobs' diagnostic), and it stops before any run
    on a profile it does not know or one not rendered into .gpu/profiles (plumbing; the runs need the GPU)."""
    import re
    import subprocess
    import sys

    sys.path.insert(0, str(REPO / "bench" / "gpu"))
    import ppo_profiles

    script = (REPO / "bench" / "gpu" / "run_speed.sh").read_text()
    limits = set(re.findall(r"\[([a-z0-9-]+)\]=\d+", script))
    assert limits == {p.name for p in ppo_profiles.SPEED_PROFILES} | {"rtx2080ti-gathered"}
    for word, names in (("before", "-before"), ("after", "-after")):
        line = next(line for line in script.splitlines() if line.strip().startswith(f"{word})"))
        assert sorted(re.findall(r"[a-z0-9]+-(?:before|after)", line)) == sorted(
            p.name for p in ppo_profiles.SPEED_PROFILES if p.name.endswith(names))
    run = lambda *a: subprocess.run(["bash", str(REPO / "bench/gpu/run_speed.sh"), *a], cwd=tmp_path,  # noqa: E731
                                    capture_output=True, text=True)
    unknown = run("gtx1080-sideways")
    assert unknown.returncode == 2 and "unknown profile gtx1080-sideways" in unknown.stderr
    missing = run("gtx1080-before")
    assert missing.returncode == 2 and "not rendered" in missing.stderr
