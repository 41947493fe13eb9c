"""The doctor's vLLM 0.8.5 rules (files/doctor/vllm.toml), through ``python -m tasks.doctor``.

Every excerpt (tests/fixtures/doctor/vllm-*.log) holds vLLM's message as the release formats it
(its f-strings with realistic numbers: read in the vllm-0.8.5 wheel), in the chain Ray 2.46 and
Hydra print at the driver (frames and line numbers from verl 0.5.0, vLLM 0.8.5 and Ray 2.46), and
behind Ray's ``(WorkerDict pid=N)`` prefix. tests/unit/test_doctor.py matches each rule on its
excerpt and its look-alike; here each log goes through ``main()``, which must name the cause and the
fix, and the fix must name what changes it (the share and how, workload.rollout, the batch)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tasks.doctor import RULES_DIR, diagnose, load_rules, main

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "doctor"
RULES = {r.id: r for r in load_rules(RULES_DIR / "vllm.toml")}
PREFIX = "(WorkerDict pid=4112) "
SHARE = "actor_rollout_ref.rollout.gpu_memory_utilization"


def excerpt(rule_id: str) -> str:
    return (FIXTURES / f"{rule_id}.log").read_text()


def test_the_vllm_rules_are_the_ones_the_issue_asks_for():
    assert set(RULES) == {"vllm-no-cache-memory", "vllm-v0-kv-cache-short", "vllm-v1-kv-cache-short",
                          "vllm-cuda-graph-oom", "vllm-attention-backend", "vllm-v1-unsupported", "vllm-engine-died",
                          "vllm-share-at-launch"}      # the last: the launcher's preflight (tests/unit/test_launch_share.py)


@pytest.mark.parametrize("rule_id", sorted(RULES))
def test_the_doctor_names_cause_and_fix_of_each_vllm_message(rule_id, tmp_path, capsys):
    log = tmp_path / "journal.log"
    log.write_text(excerpt(rule_id))
    assert main(["--host", "rtx3090-box", str(log)]) == 1
    out = capsys.readouterr().out
    rule = RULES[rule_id]
    assert out.startswith("== rtx3090-box: failed")
    assert f"  [{rule_id}] {rule.cause}" in out and f"    fix: {rule.fix}" in out
    assert "no rule matched" not in out


@pytest.mark.parametrize("rule_id", sorted(set(RULES) - {"vllm-engine-died", "vllm-share-at-launch"}))
def test_each_message_is_read_behind_rays_workerdict_prefix(rule_id):
    """The worker's own line (``(WorkerDict pid=N) ...``) alone is enough."""
    prefixed = [line for line in excerpt(rule_id).splitlines() if line.startswith(PREFIX)]
    assert prefixed, f"{rule_id}: the excerpt has no line behind Ray's prefix"
    rule = RULES[rule_id]
    if rule.near:   # the OOM line counts only with vLLM's capture frames before it: keep them
        text = excerpt(rule_id)
    else:
        text = "\n".join(prefixed)
    found = {f.rule: f for f in diagnose("box", {"journal": text}).findings}
    assert rule_id in found and any(ev.startswith(PREFIX) for ev in found[rule_id].evidence), found


@pytest.mark.parametrize("rule_id", sorted(RULES))
def test_each_fix_names_what_changes_it(rule_id):
    fix = RULES[rule_id].fix
    assert "workload.rollout = 'hf'" in fix, "every vLLM failure has the HF rollout as its way out"
    if "kv-cache" in rule_id or "cache-memory" in rule_id or "graph" in rule_id:
        assert f"`train-launcher -- {SHARE}=" in fix, "the share, and how to change it by hand"
        assert "workload.train_batch_size" in fix or "workload.max_response_length" in fix


# the other wordings each rule knows, as vLLM 0.8.5 and Ray 2.46 print them
VARIANTS = [
    ("vllm-attention-backend", "(WorkerDict pid=4112) ValueError: Invalid attention backend for cuda, with use_v1: "
                               "False use_mla: False"),
    ("vllm-attention-backend", "(WorkerDict pid=4112) ERROR 12-04 10:41:07 [fa_utils.py:42] Cannot use FA version 2 is "
                               "not supported due to FA2 is only supported on devices with compute capability >= 8"),
    ("vllm-v1-unsupported", "NotImplementedError: VLLM_USE_V1=1 is not supported with --dtype torch.float32."),
    ("vllm-engine-died", "(AsyncvLLMServer pid=5120) ERROR 12-04 10:52:31 [multiproc_executor.py:124] Worker proc "
                         "VllmWorker-0 died unexpectedly, shutting down executor."),
    ("vllm-engine-died", "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue. See stack trace "
                         "(above) for the root cause."),
    ("vllm-engine-died", "(raylet) A worker died or was killed while executing a task by an unexpected system error. "
                         "To troubleshoot the problem, check the logs for the dead worker."),
    ("vllm-no-cache-memory", "(WorkerDict pid=4112) ValueError: No available memory for the cache blocks. Try "
                             "increasing `gpu_memory_utilization` when initializing the engine."),
]


@pytest.mark.parametrize("rule_id, line", VARIANTS)
def test_every_wording_of_a_rule(rule_id, line):
    assert rule_id in [f.rule for f in diagnose("box", {"journal": line}).findings]


def test_an_oom_outside_cuda_graph_capture_is_not_called_one():
    """vllm-cuda-graph-oom needs vLLM's capture frames before the OOM; the generic cuda-oom still fires."""
    oom = excerpt("vllm-cuda-graph-oom").splitlines()
    assert "vllm-cuda-graph-oom" in [f.rule for f in diagnose("b", {"j": "\n".join(oom)}).findings]
    without = [line for line in oom if "capture" not in line]
    rules = [f.rule for f in diagnose("b", {"j": "\n".join(without)}).findings]
    assert "cuda-oom" in rules and "vllm-cuda-graph-oom" not in rules
    frames = oom[:oom.index(next(line for line in oom if line.startswith("torch.OutOfMemoryError")))]
    late = ["torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 MiB."]
    assert "vllm-cuda-graph-oom" in [f.rule for f in diagnose("b", {"j": "\n".join(frames + late)}).findings]
    far = frames + ["(TaskRunner pid=3871) step:1 - a later line"] * 80 + late      # the frames are 80 lines back
    assert "vllm-cuda-graph-oom" not in [f.rule for f in diagnose("b", {"j": "\n".join(far)}).findings]


RTX3090_PLAN = {"rung": "ppo", "predicted_peak_mib": 19414,           # what every plan.json has (doctor --plan)
                "gpu": {"name": "NVIDIA GeForce RTX 3090", "memory_mib": 24576}, "env": {"VLLM_USE_V1": "1"},
                "vllm_gpu_memory_utilization": 0.42, "breakdown": {"vllm_kv_wanted": 1690}}


def test_the_v1_kv_message_is_read_against_the_plan(tmp_path, capsys):
    """The numbers vLLM printed, the plan's engine and share, and the share that would have held the
    plan's KV cache given what vLLM found available: 0.42 + (1690 MiB - 0.02 GiB) / 24576 MiB."""
    log, plan = tmp_path / "journal.log", tmp_path / "plan.json"
    log.write_text(excerpt("vllm-v1-kv-cache-short"))
    plan.write_text(json.dumps(RTX3090_PLAN))
    assert main(["--json", "--plan", str(plan), str(log)]) == 1
    (finding,) = [f for f in json.loads(capsys.readouterr().out)["findings"] if f["rule"] == "vllm-v1-kv-cache-short"]
    assert finding["details"] == {"max_model_len": 1280, "kv_needed_gib": 0.04, "kv_available_gib": 0.02,
                                  "plan_engine": "V1", "plan_share": 0.42, "plan_kv_cache_mib": 1690,
                                  "share_that_holds_the_plans_kv_cache": 0.49}
    assert 0.42 + (1690 - 0.02 * 1024) / 24576 == pytest.approx(0.4879, abs=1e-4)


def test_the_v0_kv_message_and_no_plan():
    (finding,) = [f for f in diagnose("t4", {"j": excerpt("vllm-v0-kv-cache-short")}).findings]
    assert finding.details["max_model_len"] == 512 and finding.details["kv_cache_tokens"] == 496
    assert "no plan.json" in finding.details["advice"]
    t4 = {"env": {"VLLM_USE_V1": "0"}, "vllm_gpu_memory_utilization": 0.3, "gpu": {"memory_mib": 15360}}
    (finding,) = diagnose("t4", {"j": excerpt("vllm-v0-kv-cache-short")}, t4).findings
    assert (finding.details["plan_engine"], finding.details["plan_share"]) == ("V0", 0.3)
    assert "share_that_holds_the_plans_kv_cache" not in finding.details


def test_a_log_holding_every_vllm_message_names_every_rule(tmp_path, capsys):
    log = tmp_path / "all.log"
    log.write_text("\n".join(excerpt(r) for r in sorted(RULES)))
    assert main([str(log)]) == 1
    out = capsys.readouterr().out
    assert all(f"  [{r}] " in out for r in RULES), out
