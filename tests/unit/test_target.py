"""One GPU target per host (tasks/target.py), read by every stage that depends on the GPU: the
env stage's vLLM choice and compose proof agree with the training plan, also under gpu_override."""

from __future__ import annotations

import tasks.env as envstage
from tasks.facts.gpu import Gpu, GpuInventory
from tasks.plan import make_plan
from tasks.settings import load_settings
from tasks.target import decide_gpu
from tasks.train import training_workload
from tests.unit.test_env import BUILD

A100 = {"name": "NVIDIA A100-SXM4-80GB", "compute_capability": "8.0", "memory_mib": 81920, "count": 1}
P40_BOX = GpuInventory(gpus=(Gpu(0, "Tesla P40", "6.1", 24576, 24400, "535.104.05"),))


def test_override_naming_an_ampere_gpu_gets_vllm_in_the_env_and_in_the_plan():
    for inventory in (GpuInventory(problem="nvidia-smi is not installed (no NVIDIA driver on this box)"), P40_BOX):
        settings = load_settings("build1", {"gpu_override": A100})
        gpu = decide_gpu(settings, inventory)
        env = envstage.plan_env(settings, gpu, BUILD)
        plan = make_plan(gpu.target, training_workload(settings))
        assert env.vllm and env.gpu_cc == "8.0" and env.arch_list == "8.0"
        assert plan.precision.rollout == "vllm"
        assert gpu.source == "gpu_override"


def test_without_override_the_box_decides_both():
    settings = load_settings("box1", {})
    gpu = decide_gpu(settings, P40_BOX)
    env = envstage.plan_env(settings, gpu, BUILD)
    assert not env.vllm and make_plan(gpu.target, training_workload(settings)).precision.rollout == "hf"


def test_compose_proof_uses_the_hosts_own_settings():
    settings = load_settings("box1", {"train_steps": 7, "lab_root": "/srv/lab", "env_prefix": "/srv/lab/env"})
    overrides, note = envstage.compose_overrides(decide_gpu(settings, P40_BOX), settings)
    assert note is None
    assert "trainer.total_training_steps=7" in overrides
    assert "actor_rollout_ref.model.path=/srv/lab/models/Qwen--Qwen2.5-0.5B-Instruct" in overrides
    assert overrides == tuple(make_plan(decide_gpu(settings, P40_BOX).target, training_workload(settings)).override_lines)


def test_compose_proof_says_when_there_is_no_plan():
    settings = load_settings("box1", {})
    small = GpuInventory(gpus=(Gpu(0, "NVIDIA GeForce RTX 2080 Ti", "7.5", 11264, 11000, "535.104.05"),))
    overrides, note = envstage.compose_overrides(decide_gpu(settings, small), settings)
    assert overrides == () and "no training plan" in note and "short by" in note
    overrides, note = envstage.compose_overrides(decide_gpu(settings, GpuInventory(problem="no nvidia-smi")), settings)
    assert overrides == () and "no GPU target" in note
