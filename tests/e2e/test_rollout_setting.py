"""workload.rollout on lab-in-a-box hosts (real pyinfra over SSH, real systemd boxes, stand-in
nvidia-smi): a box whose GPU cannot run the rollout asked for fails in the base stage before
anything on it changes, and the other box goes on; the HF escape hatch plans the HF rollout on a
GPU vLLM could run on; the launcher the stage places sizes vLLM's share at start with the share module
placed beside it. deploy/train.py runs alone (it starts with the base stage, as every deploy file does)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TRAIN = "/opt/verl-lab/train"


@pytest.fixture(scope="module")
def lab(lab_factory):
    return lab_factory(["p40", "rtx3090"])


def plan_of(lab, name):
    return json.loads(lab.box(name).read_text(f"{TRAIN}/plan.json"))


def test_vllm_below_7_0_fails_that_box_before_it_changes_and_only_that_box(lab):
    res = lab.deploy("deploy/train.py", data={"workload": {"rollout": "vllm"}}, timeout=900)
    assert res.failed_hosts == ["p40"], res.tail()
    assert ("host p40: workload.rollout = 'vllm' (GPU from nvidia-smi): vLLM 0.8.5 needs compute capability >= 7.0, "
            "and Tesla P40 has 6.1. Fix: set workload.rollout to 'auto' or 'hf'") in res.output, res.tail()
    assert res.changed_by_host.get("p40", 0) == 0, res.changed_ops
    p40 = lab.box("p40")
    assert not p40.exists("/opt/verl-lab"), "the base stage changed the box before refusing it"
    assert p40.ssh("id verl", check=False).returncode != 0, "the training user was made before the refusal"
    plan = plan_of(lab, "rtx3090")
    assert plan["rollout"] == "vllm" and plan["env"]["VLLM_USE_V1"] == "1"
    assert any("workload.rollout = 'vllm'" in r["why"] for r in plan["reasons"] if r["setting"] == "rollout")
    # the launcher's preflight sizes vLLM's share again with the module the stage placed beside it, from the
    # box's (stand-in) nvidia-smi: nothing else on the GPU, CUDA's total its memory.used + memory.free
    box = lab.box("rtx3090")
    assert box.read_text(f"{TRAIN}/verl_lab_vllm_share.py") == (REPO / "verl_lab_box" / "vllm_share.py").read_text()
    check = box.ssh(f"runuser -u verl -- /usr/bin/python3 {TRAIN}/train-launcher --check", check=False).stdout
    share = plan["launch"]["vllm"]["share"]
    assert (f"  ok    vllm share: V1, V1 counts what other processes hold on the GPU: "
            f"actor_rollout_ref.rollout.gpu_memory_utilization {share} as planned (GPU 0: 0 MiB in use; ") in check, check
    assert "CUDA counts GPU 0: 24250 MiB (the plan: 24576 MiB)" in check, check


def test_rollout_hf_plans_the_hf_rollout_on_a_vllm_capable_gpu(lab):
    res = lab.deploy("deploy/train.py", data={"workload": {"rollout": "hf"}}, timeout=900)
    res.assert_ok()
    plan = plan_of(lab, "rtx3090")
    assert (plan["rollout"], plan["rollout_dtype"], plan["vllm_gpu_memory_utilization"]) == ("hf", "bfloat16", None)
    assert "VLLM_USE_V1" not in lab.box("rtx3090").read_text(f"{TRAIN}/train.env")
    printed = lab.box("rtx3090").ssh(f"runuser -u verl -- /usr/bin/python3 {TRAIN}/train-launcher --print-overrides "
                                     "--against-plan").stdout.splitlines()
    assert "actor_rollout_ref.rollout.name=hf" in printed
    assert not [o for o in printed if "gpu_memory_utilization" in o or "engine_kwargs.vllm" in o]
    assert plan_of(lab, "p40")["rollout"] == "hf"      # refused a moment ago, provisioned now
