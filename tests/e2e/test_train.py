"""The training stage on lab-in-a-box hosts: three stand-in GPUs get three plans, launchers
and units; a box without a GPU fails alone; gpu_override plans for a GPU a box lacks.

deploy/train.py runs alone (the env and data stages are not wired here), so the launcher's
--check must report the missing env and data, and that no usable CUDA device is present
(the stand-in nvidia-smi answers, but there is no NVIDIA kernel driver in a box).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.lab import BoxSpec

REPO = Path(__file__).resolve().parents[2]
GPU_BOXES = ["p40", "t4", "rtx3090"]
NOGPU = "nogpu"
TRAIN = "/opt/verl-lab/train"
UNIT = "/etc/systemd/system/verl-lab-train.service"
EXPECT = {
    # box: (gpu name, rollout, train dtype, rollout dtype, torch.compile)
    "p40": ("Tesla P40", "hf", "fp32", "float32", False),
    "t4": ("Tesla T4", "vllm", "fp32", "float16", True),
    "rtx3090": ("NVIDIA GeForce RTX 3090", "vllm", "bf16", "bfloat16", True),
}
A100 = {"name": "NVIDIA A100-SXM4-80GB", "compute_capability": "8.0", "memory_mib": 81920, "count": 1}


@pytest.fixture(scope="module")
def lab(lab_factory):
    return lab_factory([*GPU_BOXES, BoxSpec(NOGPU, driver=None)])


@pytest.fixture(scope="module")
def converged(lab):
    return lab.deploy("deploy/train.py", hosts=[*GPU_BOXES, NOGPU], timeout=900)


def plan_of(lab, name):
    return json.loads(lab.box(name).read_text(f"{TRAIN}/plan.json"))


def test_gpu_boxes_converge_and_the_gpuless_box_fails_alone(converged):
    assert converged.failed_hosts == [NOGPU], converged.tail()
    for name in GPU_BOXES:
        assert converged.changed_by_host[name] > 0, converged
    assert "no usable NVIDIA GPU: nvidia-smi is not installed" in converged.output
    assert "gpu_override" in converged.output


@pytest.mark.parametrize("name", GPU_BOXES)
def test_three_gpus_three_plans(lab, converged, name):
    gpu, rollout, dtype, rdtype, compile_ok = EXPECT[name]
    plan = plan_of(lab, name)
    assert plan["gpu"]["name"] == gpu and plan["plan_source"] == "nvidia-smi"
    assert (plan["rollout"], plan["train_dtype"], plan["rollout_dtype"], plan["use_torch_compile"]) == (
        rollout, dtype, rdtype, compile_ok)
    assert plan["attn_implementation"] == "sdpa"
    assert f"actor_rollout_ref.rollout.name={rollout}" in plan["overrides"]
    assert all(r["why"] for r in plan["reasons"])
    box = lab.box(name)
    printed = box.ssh(f"runuser -u verl -- /usr/bin/python3 {TRAIN}/train-launcher --print-overrides").stdout
    assert printed.splitlines() == plan["overrides"]
    launch = plan["launch"]           # what the launcher reads: every override with its reason
    assert [o["override"] for o in launch["overrides"]] == plan["overrides"]
    assert all(o["why"] for o in launch["overrides"])
    assert box.read_text(f"{TRAIN}/train-launcher") == (REPO / "verl_lab_box" / "train_launcher.py").read_text()
    assert box.read_text(f"{TRAIN}/verl_lab_gpu.py") == (REPO / "verl_lab_box" / "gpu.py").read_text()
    for placed, part in (("verl_lab_preflight.py", "preflight.py"), ("verl_lab_after_run.py", "after_run.py")):
        assert box.read_text(f"{TRAIN}/{placed}") == (REPO / "verl_lab_box" / part).read_text()   # the launcher's parts
    unit = box.read_text(UNIT)
    assert f"({plan['gpu']['count']} x {gpu})" in unit and "User=verl" in unit


def test_plans_differ_between_boxes(lab, converged):
    lines = {name: tuple(plan_of(lab, name)["overrides"]) for name in GPU_BOXES}
    assert len(set(lines.values())) == 3
    units = {lab.box(name).read_text(UNIT) for name in GPU_BOXES}
    assert len(units) == 3


@pytest.mark.parametrize("name", GPU_BOXES)
def test_unit_verifies_and_is_enabled(lab, converged, name):
    box = lab.box(name)
    out = box.ssh(f"systemd-analyze verify {UNIT}", check=False)
    assert out.returncode == 0, out.stdout + out.stderr
    assert box.ssh("systemctl is-enabled verl-lab-train.service", check=False).stdout.strip() == "enabled"
    assert box.ssh("systemctl is-active verl-lab-train.service", check=False).stdout.strip() == "inactive"
    assert box.stat(f"{TRAIN}/train.env") == ("640", "root", "verl")
    assert box.stat(f"{TRAIN}/train-launcher") == ("750", "root", "verl")
    assert box.stat(f"{TRAIN}/checkpoints")[1:] == ("verl", "verl")
    env = box.read_text(f"{TRAIN}/train.env")
    assert "HF_HUB_OFFLINE=1" in env and "CUDA_HOME=/usr/local/cuda-11.8" in env
    assert ("PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in env.splitlines()) == (name == "p40")
    marker = box.read_text("/opt/verl-lab/markers/train.done")
    assert "stage=train" in marker and f"gpu=1 x {EXPECT[name][0]}" in marker


@pytest.mark.parametrize("name", GPU_BOXES)
def test_check_reports_no_real_gpu_and_missing_stages(lab, converged, name):
    out = lab.box(name).ssh(f"/usr/bin/python3 {TRAIN}/train-launcher --check", user="verl", check=False)
    text = out.stdout
    assert out.returncode == 1, text
    assert f"ok    gpu: 1 x {EXPECT[name][0]}" in text            # the stand-in nvidia-smi matches the plan
    assert "FAIL  cuda device: no usable CUDA device" in text      # but no kernel driver: no real GPU
    assert "/dev/nvidia0" in text
    assert "FAIL  env python" in text and "FAIL  env marker" in text
    assert "FAIL  data marker" in text and "FAIL  model" in text
    assert "would run (in /opt/verl-lab/train/work)" in text and "-m verl.trainer.main_ppo" in text
    assert "verl-lab preflight FAILED" in out.stderr


def test_rerun_changes_nothing(lab, converged):
    again = lab.deploy("deploy/train.py", hosts=GPU_BOXES, timeout=900)
    again.assert_idempotent()


def test_gpu_override_plans_for_a_gpu_the_box_lacks(lab, converged):
    res = lab.deploy("deploy/train.py", hosts=[NOGPU], per_host={NOGPU: {"gpu_override": A100}}, timeout=900)
    res.assert_ok()
    plan = plan_of(lab, NOGPU)
    assert plan["plan_source"] == "gpu_override"
    assert (plan["gpu"]["name"], plan["train_dtype"], plan["rollout"]) == (A100["name"], "bf16", "vllm")
    out = lab.box(NOGPU).ssh(f"/usr/bin/python3 {TRAIN}/train-launcher --check", user="verl", check=False)
    assert out.returncode == 1
    assert "FAIL  gpu: nvidia-smi: nvidia-smi is not installed" in out.stdout
    again = lab.deploy("deploy/train.py", hosts=[NOGPU], per_host={NOGPU: {"gpu_override": A100}}, timeout=900)
    again.assert_idempotent()


def test_unit_state_installed_disables(lab, converged):
    res = lab.deploy("deploy/train.py", hosts=["t4"], per_host={"t4": {"train_unit_state": "installed"}},
                     timeout=900)
    res.assert_ok()
    box = lab.box("t4")
    assert box.ssh("systemctl is-enabled verl-lab-train.service", check=False).stdout.strip() == "disabled"
    assert "unit_state=installed" in box.read_text("/opt/verl-lab/markers/train.done")
