"""The memory model against real verl 0.5.0 PPO and GRPO runs on the H200 (bench/gpu/results/ppo-*).

The raw records of the GPU harness (console logs and the workers' per-phase memory probes) are
committed; bench/gpu/ppo_results.py reads them and re-estimates, with the memory model as it is
in this tree, exactly the workload each profile ran (PPO with the critic, or GRPO with the actor
on FSDP2 CPU offload: calls 7-9). A change to tasks/memory/ or tasks/plan/ that moves a
prediction more than 10% from what verl measured fails here.
What this cannot show: a configuration that was not run (docs/training-runs.md lists them).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "bench" / "gpu" / "results"
PPO_PHASES = {"generate_sequences", "compute_log_prob", "compute_values", "update_critic", "update_actor"}
GRPO_PHASES = {"generate_sequences", "compute_log_prob", "compute_ref_log_prob", "update_actor"}
# runs that did not record every phase: call 6 (PPO with the critic on FSDP2: verl 0.5.0 failed at the
# critic's init, nothing to estimate) and call 7's 8 GiB probe (its update was cut by the call's limit)
# and call 13's two profiling runs (issue 29: step 1's update_actor ran under torch.profiler and was cut)
INCOMPLETE = {"ppo-20261204/call6/fsdp2-11g", "ppo-20261204/call6/fsdp2-8g", "ppo-20261204/call7/grpo-8g",
              "ppo-20261206/call13/rtx2080ti-before", "ppo-20261206/call13/rtx2080ti-gathered"}
# Phases the memory model under-predicts by more than a tenth, to be mended (strict xfail: a mend that makes
# one pass fails the test until it is taken off this list).
PHASE_GAPS: dict[str, str] = {}
# (call 13's were mended in issue 29: the fp16 HF rollout over fp32 weights keeps its residual stream in fp32, and
# the gathered passes of patches 0007-0008 hold the whole model: tasks/memory/verl_budget.py)


def _results_module():
    spec = importlib.util.spec_from_file_location("ppo_results", REPO / "bench" / "gpu" / "ppo_results.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


RUNS = sorted(p for p in RESULTS.glob("ppo-*/call*/*") if (p / "console.log").is_file() and (p / "profile.json").is_file())


def _key(p: Path) -> str:
    return f"{p.parent.parent.name}/{p.parent.name}/{p.name}"


# the runs of a plan (the seed recipe has none to predict with)
PLANNED = [_key(p) for p in RUNS if json.loads((p / "profile.json").read_text()).get("plan")]
MEASURED = [k for k in PLANNED if k not in INCOMPLETE]


@pytest.fixture(scope="module")
def summaries():
    mod = _results_module()
    return {_key(p): mod.summarise(p) for p in RUNS}


def test_the_records_are_there():
    names = {p.name for p in RUNS}
    assert {"p40", "t4", "rtx3090", "h200", "p40-today", "seed", "grpo-11g", "gtx1080ti", "gtx1080"} <= names
    assert {run.split("/")[-1] for run in PLANNED} == names - {"seed"}
    assert {"ppo-20261204/call7/grpo-11g", "ppo-20261204/call8/gtx1080ti", "ppo-20261204/call8/gtx1080",
            "ppo-20261205/call9/gtx1080ti", "ppo-20261205/call9/gtx1080", "ppo-20261205/call10/gtx1080ti",
            "ppo-20261205/call10/gtx1080"} <= set(MEASURED)


def test_the_workload_that_ran_is_rebuilt(summaries):
    """estimate_as_ran rebuilds what verl ran from the run's plan.json and the harness's overrides:
    call 7 ran the P40 plan (PPO) turned into GRPO by overrides; call 8 the GTX plans as rendered."""
    for run, mb in (("ppo-20261204/call7/grpo-11g", (2, 8, 128, False)), ("ppo-20261204/call8/gtx1080", (4, 8, 128, True)),
                    ("ppo-20261204/call8/gtx1080ti", (8, 8, 256, True)),
                    # the plans as they are now (calls 9 and 10): the GTX 1080 at micro-batch 8
                    ("ppo-20261205/call9/gtx1080", (8, 8, 128, True)), ("ppo-20261205/call10/gtx1080", (8, 8, 128, True)),
                    ("ppo-20261205/call10/gtx1080ti", (8, 8, 256, True))):
        w = summaries[run]["as_ran"]
        assert (w["algorithm"], w["rollout_n"], w["use_kl_loss"], w["actor_offload_policy"], w["rollout"]) == \
            ("grpo", 4, True, True, "hf"), run
        m = w["micro_batches"]
        assert (m["actor"], m["log_prob"], m["rollout"], w["gradient_checkpointing"]) == mb, run
        assert m["critic"] is None and not w["offload"]["critic_optimizer_offload"], run
    w = summaries["ppo-20261203/call4/p40"]["as_ran"]
    assert (w["algorithm"], w["rollout_n"], w["actor_offload_policy"]) == ("ppo", 1, False)
    assert summaries["ppo-20261204/call6/fsdp2-11g"]["predicted_peak_mib"] is None   # verl could not build it


def test_every_complete_run_recorded_its_algorithms_phases(summaries):
    for run in MEASURED:
        r = summaries[run]
        want = GRPO_PHASES if r["as_ran"]["algorithm"] == "grpo" else PPO_PHASES
        assert want <= set(r["phases"]), run


# runs that ran out of memory, and why: the model they were planned with under-counted them
KNOWN_OOM = {
    # the RTX 3060's grpo-rung plan (GRPO on FSDP1, bf16, update micro-batch 1): the FSDP1 ref stayed on the
    # GPU although the plan offloaded it, and the AdamW step's temporary outgrew micro-batch 1's activations
    "ppo-20261205/call12/rtx3060",
}


def test_a_run_that_ran_out_of_memory_is_one_the_model_now_refuses(summaries):
    """The model as it is now predicts more than the card's budget for exactly what ran out of
    memory, so no plan would choose it again."""
    from tasks.plan import GpuTarget, gpu_budget_mib

    oom = {run for run, r in summaries.items() if r["oom"]}
    assert oom == KNOWN_OOM
    for run in oom:
        profile = json.loads((RESULTS / run / "profile.json").read_text())
        budget = gpu_budget_mib(GpuTarget(profile["gpu_name"], profile["compute_capability"], profile["memory_mib"]))
        assert summaries[run]["predicted_peak_mib"] > budget, run


def test_no_run_ran_out_of_memory_or_over_its_cap(summaries):
    for run, r in summaries.items():
        if run in KNOWN_OOM:
            continue
        assert not r["oom"], f"{run} ran out of memory: {r['oom']}"
        if r["cap_mib"] and r["measured_peak_allocated_mib"] is not None:   # call 6 never reached a phase
            assert r["measured_peak_allocated_mib"] <= r["cap_mib"], run
            # the allocator's cap is a fraction of the H200's memory: 1 MiB of rounding either side
            assert r["measured_peak_reserved_mib"] <= r["cap_mib"] + 1, \
                f"{run}: reserved {r['measured_peak_reserved_mib']} MiB over the cap"


@pytest.mark.parametrize("run", MEASURED)
def test_prediction_within_ten_percent_of_the_measured_peak(summaries, run):
    r = summaries[run]
    ratio = r["measured_peak_mib"] / r["predicted_peak_mib"]
    assert 0.9 <= ratio <= 1.1, (f"{run}: measured {r['measured_peak_mib']} MiB (allocated + outside torch), "
                                 f"predicted {r['predicted_peak_mib']} MiB for what ran: ratio {ratio:.3f}")


@pytest.mark.parametrize("run", [pytest.param(k, marks=pytest.mark.xfail(reason=PHASE_GAPS[k], strict=True))
                                 if k in PHASE_GAPS else k
                                 for k in PLANNED if not k.startswith("ppo-20261204/call6/")])
def test_each_training_phase_is_predicted_within_a_tenth_or_over(summaries, run):
    """Per phase (every phase a run recorded, call 7's cut 8 GiB probe too): never more than 10%
    under what verl allocated (an under-prediction is an OOM risk); over-predictions of phases below
    the peak only cost speed."""
    r = summaries[run]
    phases = {k: p for k, p in r["phases"].items() if k in PPO_PHASES | GRPO_PHASES}
    assert phases, run
    for phase, p in phases.items():
        assert p["peak_allocated_mib"] <= 1.1 * p["predicted_mib"], (
            f"{run} {phase}: allocated {p['peak_allocated_mib']} MiB, predicted {p['predicted_mib']} MiB")


def test_fixed_rollout_samples_the_actors_policy_and_the_old_one_did_not(summaries):
    """The rollout's own log-probs of the tokens it sampled against the actor's (fp32 P40 plan:
    both in fp32): near zero with patch 0004, large with the patches as they were."""
    fixed = [r for k, r in summaries.items() if k.endswith("/p40")]
    fixed += [r for k, r in summaries.items() if k.startswith("ppo-20261204/") and r["logprob_gap_max"] is not None]
    old = [r for k, r in summaries.items() if k.endswith("/p40-today") or k.endswith("/seed")]
    assert fixed and old
    assert all(r["logprob_gap_max"] < 1e-3 for r in fixed)
    assert all(r["logprob_gap_max"] > 0.1 for r in old)


def test_speed_claims_in_the_docs_are_the_records(summaries):
    """docs/training-runs.md's throughput ratios come from this session's records (calls 4 and 5:
    one profile at a time): the P40 plan against the plan before this work (same call) and
    against the seed recipe; the targets are 3x and 20x."""
    plan = summaries["ppo-20261203/call4/p40"]["prompts_per_s"]
    before = summaries["ppo-20261203/call4/p40-today"]["prompts_per_s"]
    seed = summaries["ppo-20261203/call5/seed"]["prompts_per_s"]
    docs = (REPO / "docs" / "training-runs.md").read_text()
    assert f"**{plan / before:.2f}x**" in docs and f"**{plan / seed:.1f}x**" in docs
    assert f"**{plan:.2f}**" in docs
    assert plan / before >= 3 and plan / seed >= 20
