"""The line per host deploy/full.py ends with (tasks/run_summary.py), on plain values; the e2e
checks (tests/e2e/test_readme_path.py, the transcript) read it from real runs."""

from __future__ import annotations

from tasks.plan import GpuTarget, doc_workload, make_plan
from tasks.run_summary import host_line, last_run, plan_line, record_run, stage_words, visible_words


def test_stage_words():
    assert stage_words("cuda", []) == "cuda proven"
    assert stage_words("env", [(False, True), (False, True)]) == "env checked"
    assert stage_words("env", [(True, True), (False, True), (True, True)]) == "env changed 2"
    assert stage_words("data", [(True, True), (False, False)]) == "data FAILED"
    assert stage_words("train", [(None, None)]) == "train not run"
    # the undo stage (tasks/undo.py) is named only where it queued something (issue 44)
    assert visible_words([("base", []), ("undo", []), ("train", [(True, True)])]) == ["base proven", "train changed 1"]
    assert visible_words([("undo", [(True, True), (True, True)])]) == ["undo changed 2"]


def test_host_line_and_plan_line():
    plan = make_plan(GpuTarget("Tesla T4", "7.5", 15360), doc_workload()).to_dict()
    words = plan_line(plan)
    assert words.startswith("Qwen/Qwen2.5-0.5B-Instruct, ppo, full fine-tuning, train fp32, rollout vllm float16 "
                            "(share 0.") and "offload actor optimizer" in words
    assert f"peak {plan['predicted_peak_mib']} of {plan['budget_mib']} MiB" in words
    line = host_line("t4", "1 x Tesla T4, from nvidia-smi", ["base proven", "cuda proven"], 0, words, "enabled", False)
    assert line == f"verl-lab: t4 (1 x Tesla T4, from nvidia-smi): base proven, cuda proven; changed nothing; plan {words}; unit enabled"
    assert "; changed 1 operation;" in host_line("t4", "g", ["x"], 1, None, "enabled", False)
    assert "; FAILED (see above);" in host_line("t4", "g", ["x"], 1, None, "enabled", True)


def test_plan_line_names_the_model_the_rung_and_lora():
    """The 3B on a P40 trains LoRA adapters (grpo-lora): the line says so, and which model."""
    from dataclasses import replace

    from tasks.catalog import default_catalog
    from tasks.plan import with_model
    w = with_model(doc_workload(), default_catalog().artifact("qwen_3b_model"))
    w = replace(w, model_path="/opt/verl-lab/models/Qwen--Qwen2.5-3B-Instruct")
    plan = make_plan(GpuTarget("Tesla P40", "6.1", 24576), w).to_dict()
    assert plan_line(plan).startswith(f"Qwen/Qwen2.5-3B-Instruct, grpo-lora, LoRA rank {plan['lora']['rank']}, ")


def test_the_last_run_is_recorded_on_the_controller(tmp_path):
    assert last_run(tmp_path, "b") is None
    record_run(str(tmp_path), "b", ok=False, stage="data", message="no such repo", line="l")
    got = last_run(tmp_path, "b")
    assert (got["ok"], got["stage"], got["message"]) == (False, "data", "no such repo") and got["when"].endswith("UTC")
