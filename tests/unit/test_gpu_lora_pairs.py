"""Issue 42's GPU calls, prepared here (the plumbing; the runs need the device): the profiles (bench/gpu/ppo_profiles.py
I42_*), the one command per call (bench/gpu/run_lora.sh i42a, i42b, i42-export) and the reader of the pairs
(bench/gpu/lora_pairs.py), which is run here on GPU call 15's real records.

What this proves: each LoRA run is compared with its own card's full plan at the same batch and step count, alone,
within one device call; the reader's arithmetic. Not proven: any number of the runs themselves.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench" / "gpu"))
import lora_pairs  # noqa: E402
import ppo_profiles  # noqa: E402

CALLS = {"i42a": ["gtx1080-full-i42", "gtx1080-lora-i42", "rtx3060-full-i42", "rtx3060-lora-i42"],
         "i42b": ["rtx2080ti-full-i42", "rtx2080ti-lora-i42", "rtx3060-lora-export"],
         "i42-export": ["rtx3060-lora-export"]}
SETUP_S = 60          # install.sh and the model on a cold machine (calls 14-15: 78-87 s for eight; 40 s warm)


def script() -> str:
    return (REPO / "bench" / "gpu" / "run_lora.sh").read_text()


def test_each_lora_run_is_paired_with_its_cards_full_plan_at_the_same_batch():
    for card in ("gtx1080", "rtx3060", "rtx2080ti"):
        lora, full = ppo_profiles.BY_NAME[f"{card}-lora-i42"], ppo_profiles.BY_NAME[f"{card}-full-i42"]
        assert lora.compare_with == full.name and (lora.finetune, full.finetune) == ("lora", "full")
        same = ("gpu_name", "compute_capability", "memory_mib", "rollout_engine", "steps", "overrides", "validate",
                "probe_profile", "model", "gpus")
        assert all(getattr(lora, k) == getattr(full, k) for k in same), card
        assert lora.steps == 1 and lora.overrides == ("data.train_batch_size=16",) and not lora.probe_profile
    export = ppo_profiles.BY_NAME["rtx3060-lora-export"]
    assert export.export and export.finetune == "lora" and export.compute_capability == "8.6"   # a bf16 base
    assert export in ppo_profiles.LORA_PROFILES


@pytest.mark.parametrize("call", sorted(CALLS))
def test_each_call_runs_its_profiles_one_at_a_time_within_one_device_call(call):
    text = script()
    limits = {k: int(v) for k, v in re.findall(r"\[([a-z0-9.-]+)\]=(\d+)", text)}
    line = next(x for x in text.splitlines() if x.strip().startswith(f"{call})"))
    names = line.split("set --", 1)[1].split(";")[0].split()
    assert names == CALLS[call] and "jobs=" not in line                    # jobs stays 1: each alone
    assert sum(limits[n] for n in names) + SETUP_S <= 600, call


def test_the_script_refuses_what_is_not_rendered(tmp_path):
    res = subprocess.run(["bash", str(REPO / "bench/gpu/run_lora.sh"), "i42a"], cwd=tmp_path, capture_output=True,
                         text=True)
    assert res.returncode == 2 and "gtx1080-full-i42 is not rendered" in res.stderr


def test_the_lora_plans_render_with_the_new_micro_batches(tmp_path):
    """Rendered as the lead renders them (`ppo_profiles.py render`): the full plans as in call 15, the LoRA plans
    with the micro-batches chosen by speed (the GTX 1080's 4 with checkpointing, not 1 without)."""
    names = ["gtx1080-full-i42", "gtx1080-lora-i42"]
    res = subprocess.run([sys.executable, str(REPO / "bench/gpu/ppo_profiles.py"), "render", "--only", ",".join(names),
                          "--out", str(tmp_path)], capture_output=True, text=True, cwd=REPO)
    assert res.returncode == 0, res.stderr
    import json

    full, lora = (json.loads((tmp_path / n / "profile.json").read_text()) for n in names)
    assert full["plan"]["rung"] == "grpo-cpu-offload" and lora["plan"]["rung"] == "grpo-lora"
    assert (lora["plan"]["micro_batches"]["actor"], lora["plan"]["gradient_checkpointing"]) == (4, True)
    for p in (full, lora):
        assert "data.train_batch_size=16" in p["extra_overrides"] and "trainer.test_freq=-1" in p["extra_overrides"]
        assert p["plan"]["train_batch_size"] == 64                      # the plan's; the run trains 16


def test_the_plans_step_is_rebuilt_from_a_smaller_runs_phases():
    """16 prompts of a plan of 64 (GRPO: x4 sequences): generation scales with the HF chunks (GTX 1080's 128: 2 for
    the plan, 1 for the run; a chunk of 256: 1 and 1), the rest with the prompts."""
    gtx = {"plan": {"rung": "grpo-lora", "train_batch_size": 64, "micro_batches": {"rollout": 128}},
           "overrides": ["data.train_batch_size=16"]}
    assert lora_pairs.plan_step_seconds(gtx, s_step=30.0, gen_s=20.0) == pytest.approx(2 * 20 + 4 * 10)
    rtx = {**gtx, "plan": {**gtx["plan"], "micro_batches": {"rollout": 256}}}
    assert lora_pairs.plan_step_seconds(rtx, s_step=30.0, gen_s=20.0) == pytest.approx(20 + 4 * 10)
    assert lora_pairs.plan_step_seconds({**gtx, "overrides": []}, 30.0, 20.0) is None      # the plan's own batch


def test_the_reader_on_call_15s_records():
    """GPU call 15's pairs (64 prompts, eight side by side): its ratios as docs/training-runs.md reads them; LoRA's
    generation against the full plan's beside call 15's (there the same run: the same ratio)."""
    runs = REPO / "bench/gpu/results/ppo-20261205/call15/runs"
    p = lora_pairs.pair(runs, "gtx1080-lora")
    assert (p["lora_run"], p["full_run"], p["ratio"], p["plan_ratio"]) == ("gtx1080-lora", "gtx1080-after", 1.03, None)
    assert p["generation_ratio"] == p["call15_generation_ratio"] == 1.75
    assert p["lora"]["phases"]["update_actor"] == pytest.approx(144.32)
    text = lora_pairs.lines(runs, ["gtx1080-lora", "rtx3060-lora", "gtx1080-after"])
    assert "gtx1080-lora / gtx1080-after: prompts/s 0.219 / 0.212 = 1.03 at 64 prompts" in text
    assert "rtx3060-lora / rtx3060-after" in text and text.count("prompts/s") == 2
