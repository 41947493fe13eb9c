"""The bench scripts' statistics, tables, interleaving and command counting (bench/harness.py)."""

from __future__ import annotations

import json

import pytest

from bench.harness import (
    CommandLog,
    count_commands,
    free_page_reporting,
    free_page_reporting_off,
    interleave,
    ratio,
    render_table,
    summary,
    touch_free_memory,
)


def test_summary_is_the_median_of_odd_and_even_counts():
    assert summary([3.0, 1.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0, "n": 3}
    assert summary([4.0, 1.0, 2.0, 3.0])["median"] == 2.5
    with pytest.raises(ValueError):
        summary([])


def test_ratio_refuses_a_zero_baseline():
    assert ratio(3.0, 1.5) == 2.0
    with pytest.raises(ValueError):
        ratio(1.0, 0.0)


def test_table_aligns_columns_and_formats_floats():
    text = render_table(["what", "s", "x"], [["floor", 1.23456, 0.5], ["no-op deploy", 12.0, 2]])
    lines = text.splitlines()
    assert lines[0].split() == ["what", "s", "x"]
    assert lines[2].split() == ["floor", "1.23", "0.500"]
    assert lines[3].startswith("no-op deploy") and lines[3].split()[-2:] == ["12.00", "2"]
    assert len({len(line) for line in lines}) == 1


def test_interleave_alternates_arms_and_uses_reported_seconds():
    order = []
    ticks = iter(range(100))
    arms = {"a": lambda: order.append("a"), "b": lambda: (order.append("b"), {"seconds": 7.5})[1]}
    times = interleave(arms, 3, clock=lambda: float(next(ticks)))
    assert order == ["a", "b"] * 3
    assert times["a"] == [1.0, 1.0, 1.0] and times["b"] == [7.5, 7.5, 7.5]


def test_count_commands_per_host_stage_and_fact(tmp_path):
    recs = [
        {"host": "b1", "kind": "fact", "fact": "verl_lab.Marker", "stage": "cuda", "command": "cat m", "seconds": 0.25},
        {"host": "b1", "kind": "fact", "fact": "verl_lab.Marker", "stage": "hfdata", "command": "cat m"},
        {"host": "b1", "kind": "fact", "fact": "server.Hostname", "stage": None, "command": "uname -n"},
        {"host": "b1", "kind": "upload", "fact": None, "stage": "artifacts", "command": "/x.part", "seconds": 2.5},
        {"host": "b2", "kind": "op", "fact": None, "stage": "base", "command": "mkdir -p /x"},
    ]
    path = tmp_path / "log.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    got = count_commands(CommandLog.read(path))
    assert got["b1"] == {"commands": 3, "uploads": 1, "by_stage": {"cuda": 1, "hfdata": 1, "?": 1},
                         "by_fact": {"verl_lab.Marker": 2, "server.Hostname": 1},
                         "command_seconds": 0.25, "upload_seconds": 2.5,
                         "repeated_facts": {"verl_lab.Marker: cat m": 2},
                         "slowest": [{"seconds": 0.25, "stage": "cuda", "fact": "verl_lab.Marker", "command": "cat m"},
                                     {"seconds": None, "stage": "hfdata", "fact": "verl_lab.Marker", "command": "cat m"},
                                     {"seconds": None, "stage": None, "fact": "server.Hostname",
                                      "command": "uname -n"}]}
    assert got["b2"]["commands"] == 1 and got["b2"]["by_fact"] == {}
    assert count_commands(CommandLog.read(tmp_path / "missing.jsonl")) == {}


def test_interleave_rotates_the_order_each_round():
    order = []
    arms = {name: (lambda n=name: order.append(n)) for name in "abc"}
    times = interleave(arms, 4, clock=lambda: 0.0, rotate=True)
    assert order == list("abc" "bca" "cab" "abc")
    assert {k: len(v) for k, v in times.items()} == {"a": 4, "b": 4, "c": 4}


def test_free_page_reporting_is_read_and_put_back_after_turning_it_off(tmp_path):
    from bench.vm_pages import PAGE_REPORTING_ORDER

    sys_root = tmp_path / "sys"
    param = sys_root / PAGE_REPORTING_ORDER
    assert free_page_reporting(sys_root) is None       # no such kernel module: nothing reported
    with free_page_reporting_off(sys_root) as found:
        assert found is None and not param.exists()    # and nothing written
    param.parent.mkdir(parents=True)
    param.write_text("9\n")
    assert free_page_reporting(sys_root) == 9
    with pytest.raises(RuntimeError):
        with free_page_reporting_off(sys_root) as found:
            assert found == 9 and param.read_text().strip() == "11"
            raise RuntimeError("a bench arm failed")
    assert param.read_text().strip() == "9"            # put back even when the bench fails


def test_touch_free_memory_leaves_what_it_is_asked_to_keep(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(f"MemTotal:       24683664 kB\nMemFree:           {2048 * 1024 + 3 * 1024} kB\nMemAvailable: 1 kB\n")
    assert touch_free_memory(keep_mib=2048, meminfo=meminfo) == 3
    meminfo.write_text("MemFree:           1024 kB\n")
    assert touch_free_memory(keep_mib=2048, meminfo=meminfo) == 0


def test_the_rollout_hf_profile_renders_the_products_plan_for_workload_rollout_hf(tmp_path):
    """Profile rtx3090-rollout-hf (for the lead's GPU run): rendered here, on CPU, through the
    product's setting (host data workload.rollout = 'hf', not the harness's rollout_engine): the
    launcher's plan.json is an HF-rollout plan for the RTX 3090 with its reasons, train.env pins no
    vLLM engine, and ppo_results' estimate of that profile is the plan's own prediction."""
    import sys

    from bench.gpu import ppo_profiles
    from bench.gpu.ppo_results import estimate_as_ran

    ppo_profiles.render(["rtx3090-rollout-hf"], tmp_path, ppo_profiles.TODAY_REF)
    out = tmp_path / "rtx3090-rollout-hf"
    record = json.loads((out / "profile.json").read_text())
    assert record["kind"] == "launcher" and record["rollout"] == "hf" and record["rollout_engine"] == "auto"
    assert record["cap_mib"] == 24576 - ppo_profiles.OUTSIDE_TORCH_MIB and record["plan"]["rollout"] == "hf"
    assert "trainer.test_freq=-1" in record["extra_overrides"]
    plan = json.loads((out / "train" / "plan.json").read_text())
    assert plan["gpu"]["name"] == "NVIDIA GeForce RTX 3090" and plan["rollout"] == "hf"
    assert plan["vllm_gpu_memory_utilization"] is None and plan["launch"]["predicted_peak_mib"] == plan["predicted_peak_mib"]
    launch = [o["override"] for o in plan["launch"]["overrides"]]
    assert "actor_rollout_ref.rollout.name=hf" in launch and "trainer.total_training_steps=3" in launch
    assert any("workload.rollout = 'hf'" in r["why"] for r in plan["reasons"] if r["setting"] == "rollout")
    env = (out / "train" / "train.env").read_text()
    assert "VLLM_USE_V1" not in env and "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in env
    assert ppo_profiles.settings_data(record)["workload"] == {"rollout": "hf"}
    sys.path.insert(0, str(ppo_profiles.REPO))
    assert estimate_as_ran(record)["peak_mib"] == plan["predicted_peak_mib"]
