"""One target per host (tasks/target.py: GPU and host compiler), read by every stage that depends on it: the
env stage's vLLM choice and compose proof agree with the training plan, also under gpu_override."""

from __future__ import annotations

from dataclasses import replace

import tasks.env as envstage
from tasks.facts.gpu import Gpu, GpuInventory
from tasks.plan import make_plan
from tasks.settings import load_settings
from tasks.target import decide_compiler, decide_gpu
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
    small = GpuInventory(gpus=(Gpu(0, "NVIDIA GeForce GTX 1050", "6.1", 2048, 2000, "535.104.05"),))   # no rung fits 2 GB
    overrides, note = envstage.compose_overrides(decide_gpu(settings, small), settings)
    assert overrides == () and "no training plan" in note and "short by" in note
    overrides, note = envstage.compose_overrides(decide_gpu(settings, GpuInventory(problem="no nvidia-smi")), settings)
    assert overrides == () and "no GPU target" in note


# ---------------------------------------------------------------- the host compiler, decided once

GCC = {"gcc": None, "gcc-11": None, "g++-11": None}
BOOKWORM = {"ID": "debian", "VERSION_ID": "12"}


def test_a_gcc_newer_than_nvcc_accepts_gets_gcc11_installed_once():
    c = decide_compiler(BOOKWORM, {**GCC, "gcc": "12.2.0"})
    assert (c.cc, c.cxx, c.needed, c.install) == ("/usr/bin/gcc-11", "/usr/bin/g++-11", True, True)
    assert "gcc 12.2.0" in c.reason and "installed by the base stage" in c.reason


def test_gcc11_already_there_is_used_not_reinstalled():
    c = decide_compiler(BOOKWORM, {"gcc": "12.2.0", "gcc-11": "/opt/gcc11/bin/gcc-11", "g++-11": "/opt/gcc11/bin/g++-11"})
    assert (c.cc, c.needed, c.install) == ("/opt/gcc11/bin/gcc-11", True, False)
    half = decide_compiler(BOOKWORM, {"gcc": "12.2.0", "gcc-11": "/usr/bin/gcc-11", "g++-11": None})
    assert half.install                               # g++-11 missing: both packages are installed


def test_a_default_gcc_nvcc_accepts_is_kept():
    c = decide_compiler({"ID": "ubuntu", "VERSION_ID": "22.04"}, {**GCC, "gcc": "11.4.0"})
    assert (c.cc, c.cxx, c.needed, c.install) == ("gcc", "g++", False, False)


def test_no_gcc_decides_by_the_distros_default():
    assert decide_compiler(BOOKWORM, GCC).install                                   # Debian 12: gcc 12
    assert decide_compiler({"ID": "ubuntu", "VERSION_ID": "24.04"}, GCC).install    # gcc 13
    assert not decide_compiler({"ID": "ubuntu", "VERSION_ID": "20.04"}, GCC).needed  # gcc 9
    assert decide_compiler({"ID": "arch"}, None).install                             # unknown: assume too new


def test_the_env_builds_apex_with_the_host_targets_compiler():
    settings = load_settings("box1", {})
    gpu = replace(decide_gpu(settings, P40_BOX), compiler=decide_compiler(BOOKWORM, {**GCC, "gcc": "12.2.0"}))
    env = envstage.plan_env(settings, gpu, BUILD)
    assert (env.cc, env.cxx) == ("/usr/bin/gcc-11", "/usr/bin/g++-11")
    plain = envstage.plan_env(settings, decide_gpu(settings, P40_BOX), BUILD)     # the default: gcc
    assert (plain.cc, plain.cxx) == (None, None)
