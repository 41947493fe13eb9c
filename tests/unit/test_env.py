"""The Python-env stage without a box: planning, the conda path's commands (fake facts,
asserted commands), the rendered build script and .condarc under the global and cn profiles,
the fact parsers, and the build/keep decision."""

from __future__ import annotations

import shlex
from dataclasses import replace

import jinja2
import pytest

import tasks.env as envstage
import tasks.verl.source as verl_source
from tasks.facts.gpu import Gpu, GpuInventory
from tasks.settings import load_settings
from tasks.target import decide_compiler, decide_gpu

BUILD = {"mem_total_kib": 24 * 1024 * 1024, "cpus": 16,
         "python_version": "3.11", "python_headers": True, "conda": False, "nvcc_release": "11.8"}


DEBIAN12_GCC = decide_compiler({"ID": "debian", "VERSION_ID": "12"},
                               {"gcc": "12.2.0", "gcc-11": "/usr/bin/gcc-11", "g++-11": "/usr/bin/g++-11"})


def gpus(name="Tesla P40", cc="6.1", count=1):
    """The host's target (tasks/target.py) of a Debian 12 box (gcc 12, gcc-11 there) with these GPUs."""
    return replace(decide_gpu(load_settings("box1", {}),
                              GpuInventory(gpus=tuple(Gpu(i, name, cc, 24576, 24000, "535.104.05") for i in range(count)))),
                   compiler=DEBIAN12_GCC)


def settings(**data):
    return load_settings("box1", data)


def render(name, **ctx):
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(envstage.TEMPLATES)), keep_trailing_newline=True)
    return env.get_template(name).render(**ctx)


class FakeHost:
    def __init__(self, facts):
        self.facts, self.noops = facts, []

    def get_fact(self, fact, **kwargs):
        return self.facts[fact.__name__]

    def noop(self, message):
        self.noops.append(message)


def run_op(op, monkeypatch, module, facts, **kwargs):
    fake = FakeHost(facts)
    monkeypatch.setattr(module, "host", fake)
    return [str(c.get_raw_value() if hasattr(c, "get_raw_value") else c) for c in op._inner(**kwargs)], fake


# ------------------------------------------------------------------ planning

@pytest.mark.parametrize("gpu,cc,install", [
    ("Tesla P40", "6.1", False), ("Tesla P100-PCIE-16GB", "6.0", False), ("Tesla V100-SXM2-16GB", "7.0", True),
    ("Tesla T4", "7.5", True), ("NVIDIA GeForce RTX 3090", "8.6", True), ("NVIDIA H200", "9.0", True),
])
def test_vllm_only_from_compute_capability_7(gpu, cc, install):
    plan = envstage.plan_env(settings(), gpus(gpu, cc), BUILD)
    assert plan.vllm is install
    assert plan.arch_list == cc
    if not install:
        assert "< 7.0" in plan.vllm_reason and plan.expect["vllm"] is None and plan.expect["vllm_skip"]
    else:
        assert plan.expect["vllm"] == "0.8.5"


def test_workload_rollout_hf_builds_the_env_without_vllm():
    """The escape hatch for a box whose vLLM wheel will not load: no vLLM and no xformers in its env
    (another env stamp: the env is rebuilt beside the old one, swapped in after its proofs)."""
    auto = envstage.plan_env(settings(), gpus("NVIDIA GeForce RTX 3090", "8.6"), BUILD)
    hf = envstage.plan_env(settings(workload={"rollout": "hf"}), gpus("NVIDIA GeForce RTX 3090", "8.6"), BUILD)
    assert auto.vllm and auto.xformers
    assert not hf.vllm and not hf.xformers and hf.vllm_reason.startswith("workload.rollout = 'hf'")
    assert hf.expect["vllm"] is None and hf.expect["vllm_skip"] == hf.vllm_reason and hf.stamp != auto.stamp
    assert not any("xformers" in c for c in hf.constraints)
    vllm = envstage.plan_env(settings(workload={"rollout": "vllm"}), gpus("Tesla T4", "7.5"), BUILD)
    assert vllm.vllm and vllm.stamp == envstage.plan_env(settings(), gpus("Tesla T4", "7.5"), BUILD).stamp


def test_vllm_skipped_without_gpu_and_arch_list_falls_back():
    plan = envstage.plan_env(settings(), decide_gpu(settings(), GpuInventory(problem="no nvidia-smi")), BUILD)
    assert plan.vllm is False and "no usable NVIDIA GPU" in plan.vllm_reason
    assert plan.arch_list == envstage.NO_GPU_ARCH_LIST and plan.gpu_cc is None


def test_mixed_box_builds_apex_for_every_arch_and_vllm_by_the_weakest():
    inv = GpuInventory(gpus=(Gpu(0, "NVIDIA GeForce RTX 3090", "8.6", 24576, 24000, "535.104.05"),
                             Gpu(1, "Tesla P40", "6.1", 24576, 24000, "535.104.05")))
    plan = envstage.plan_env(settings(), decide_gpu(settings(), inv), BUILD)
    assert plan.arch_list == "6.1;8.6"
    assert plan.vllm is False and "6.1 < 7.0" in plan.vllm_reason


def test_torch_pins_index_and_constraints_from_catalog():
    plan = envstage.plan_env(settings(), gpus(), BUILD)
    assert plan.torch_requirements == ("torch==2.6.0+cu118", "torchvision==0.21.0+cu118", "torchaudio==2.6.0+cu118")
    assert plan.torch_version == "2.6.0+cu118" and plan.cuda == "11.8"
    assert plan.torch_index == "https://download.pytorch.org/whl/cu118"
    assert plan.pypi_index == "https://pypi.org/simple"
    assert plan.constraints[:3] == plan.torch_requirements
    assert "ray==2.46.0" in plan.constraints and not any("[" in c for c in plan.constraints)
    assert "setuptools==80.9.0" in plan.constraints
    assert plan.problems == ()


def test_cn_profile_points_every_index_at_the_cn_mirrors():
    plan = envstage.plan_env(settings(mirror_profile="cn"), gpus(), BUILD)
    assert plan.pypi_index == "https://pypi.tuna.tsinghua.edu.cn/simple"
    assert plan.torch_index == "https://mirror.nju.edu.cn/pytorch/whl/cu118"
    assert plan.apex_url == "https://github.com/NVIDIA/apex.git" and plan.apex_ref == "25.09"


@pytest.mark.parametrize("mem_gib,cpus,jobs", [(24, 16, 6), (128, 16, 16), (3, 8, 1), (8, 1, 1), (None, None, 1)])
def test_max_jobs_bounded_by_ram(mem_gib, cpus, jobs):
    assert envstage.build_jobs(mem_gib * 1024 * 1024 if mem_gib else None, cpus) == jobs


def test_box_problems_fail_the_box_with_a_fix():
    no_nvcc = envstage.plan_env(settings(), gpus(), {**BUILD, "nvcc_release": None})
    assert any("run the CUDA stage first" in p for p in no_nvcc.problems)
    wrong = envstage.plan_env(settings(), gpus(), {**BUILD, "nvcc_release": "12.2"})
    assert any("release 12.2" in p for p in wrong.problems)
    old = envstage.plan_env(settings(env_backend="venv"), gpus(), {**BUILD, "python_version": "3.9"})
    assert any("needs >= 3.10" in p for p in old.problems)


def test_cpu_standin_profile():
    s = settings(catalog_overrides={"torch": {"requirements": ["torch==2.13.0"], "cuda": "none", "version": "2.13.0"}},
                 env_backend="venv")
    plan = envstage.plan_env(s, gpus(), {**BUILD, "nvcc_release": None})
    assert plan.problems == ()  # no nvcc needed for the CPU stand-in
    assert plan.cuda == "none" and plan.torch_version == "2.13.0" and plan.python_version == "3.11"
    assert any("CPU stand-in" in n for n in plan.notes)


def test_stamp_follows_the_plan():
    a = envstage.plan_env(settings(), gpus(), BUILD)
    assert a.stamp == envstage.plan_env(settings(), gpus(), {**BUILD, "conda": True}).stamp
    assert a.stamp != envstage.plan_env(settings(), gpus("Tesla T4", "7.5"), BUILD).stamp
    assert a.stamp != envstage.plan_env(settings(mirror_profile="cn"), gpus(), BUILD).stamp


# ------------------------------------------------------------------ conda path commands

def test_miniforge_install_command(monkeypatch):
    s = settings()
    installer = "/opt/verl-lab/cache/miniforge_installer/Miniforge3-25.3.0-3-Linux-x86_64.sh"
    cmds, _ = run_op(envstage.miniforge, monkeypatch, envstage, {"BuildHost": BUILD}, settings=s, installer=installer)
    assert cmds == [f"bash {installer} -b -p /opt/verl-lab/miniforge3"]
    cmds, fake = run_op(envstage.miniforge, monkeypatch, envstage, {"BuildHost": {**BUILD, "conda": True}},
                        settings=s, installer=installer)
    assert cmds == [] and "already" in fake.noops[0]


@pytest.mark.parametrize("profile,base", [("global", "https://conda.anaconda.org"),
                                          ("cn", "https://mirrors.tuna.tsinghua.edu.cn/anaconda/cloud")])
def test_condarc_from_mirror_profile(profile, base):
    s = settings(mirror_profile=profile)
    text = render("condarc.j2", profile=profile, conda_base=s.mirrors.base("conda"))
    assert f"channel_alias: {base}\n" in text
    assert f"  conda-forge: {base}\n" in text
    assert f"  - {base}/conda-forge\n" in text
    body = "\n".join(line for line in text.splitlines() if not line.startswith("#"))
    assert "defaults" not in body and "repo.anaconda.com" not in body
    assert "channels:\n  - conda-forge\n" in text


def _build_script(s, plan, wheel=None):
    return render("env-build.sh.j2", **envstage.build_script_context(s, plan, wheel))


def test_conda_env_create_and_pip_commands():
    s = settings()
    plan = envstage.plan_env(s, gpus("Tesla T4", "7.5"), BUILD)
    text = _build_script(s, plan, "/opt/verl-lab/cache/vllm/vllm-0.8.5+cu118-cp38-abi3-manylinux1_x86_64.whl")
    assert ("/opt/verl-lab/miniforge3/bin/conda create -y -q -p \"$GEN\" --override-channels -c conda-forge"
            " python=3.10") in text
    assert "-m venv" not in text
    assert "export PIP_CONSTRAINT=\"$GEN/verl-lab-constraints.txt\"" in text
    assert "export PIP_INDEX_URL=https://pypi.org/simple" in text
    assert "export PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cu118" in text
    assert "pip_install torch==2.6.0+cu118 torchvision==0.21.0+cu118 torchaudio==2.6.0+cu118" in text
    assert "export TORCH_CUDA_ARCH_LIST=7.5 MAX_JOBS=6" in text
    assert "export CC=/usr/bin/gcc-11 CXX=/usr/bin/g++-11" in text
    assert "export CUDA_HOME=/usr/local/cuda-11.8 PATH=/usr/local/cuda-11.8/bin:$PATH" in text
    assert ('--config-settings "--build-option=--cpp_ext" --config-settings "--build-option=--cuda_ext" .'
            in text)
    assert "export APEX_CPP_EXT=1 APEX_CUDA_EXT=1" in text
    assert "--branch 25.09 https://github.com/NVIDIA/apex.git" in text
    assert "pip_install /opt/verl-lab/cache/vllm/vllm-0.8.5+cu118-cp38-abi3-manylinux1_x86_64.whl" in text
    assert "pip_install --no-deps -e /opt/verl-lab/src/verl" in text
    # order: the env's pip, build tools, torch, Apex, verl deps, vLLM, verl; proofs before the swap, marker last
    assert "PIP_PIN=pip==25.1.1 MIN_PIP=23.1" in text
    order = [text.index(k) for k in ("conda create", 'pip_install "$PIP_PIN"', "pip_new_enough \"$pip_now\"",
                                     "pip_install -r /opt/verl-lab/env-build/build-tools.txt", "pip_install torch==",
                                     "pip install -v --no-build-isolation",
                                     "pip_install -r /opt/verl-lab/env-build/verl-requirements.txt",
                                     "pip_install --no-deps --index-url https://download.pytorch.org/whl/cu118 xformers",
                                     "pip_install /opt/verl-lab/cache/vllm", "pip_install --no-deps -e",
                                     "verl-lab-proof.json", "mv -T \"$PREFIX.link-new\" \"$PREFIX\"",
                                     "/opt/verl-lab/markers/env.done.part")]
    assert order == sorted(order)


VLLM_WHEEL = "/opt/verl-lab/cache/vllm/vllm-0.8.5+cu118-cp38-abi3-manylinux1_x86_64.whl"
XFORMERS = ("PIP_EXTRA_INDEX_URL={index} pip_install --no-deps --index-url {index} xformers==0.0.29.post2")


@pytest.mark.parametrize("gpu,cc,engine", [
    ("Tesla V100-SXM2-16GB", "7.0", "V0"), ("Tesla T4", "7.5", "V0"), ("NVIDIA GeForce RTX 2080 Ti", "7.5", "V0"),
    ("NVIDIA GeForce RTX 3090", "8.6", "V1"), ("NVIDIA H200", "9.0", "V1"),
])
@pytest.mark.parametrize("profile,index", [("global", "https://download.pytorch.org/whl/cu118"),
                                           ("cn", "https://mirror.nju.edu.cn/pytorch/whl/cu118")])
def test_vllm_boxes_get_the_cu118_xformers_before_vllm(gpu, cc, engine, profile, index):
    """vLLM 0.8.5 pins xformers==0.0.29.post2, a name both PyPI (a CUDA 12.4 build) and the cu118
    index serve: the cu118 build goes in first, from that index only, and is pinned so vLLM's
    install keeps it. 7.x boxes run vLLM's V0 engine, whose attention is xformers; 8.0+ boxes run
    V1, which does not use it, and get the same build (vLLM requires it on every box)."""
    s = settings(mirror_profile=profile)
    plan = envstage.plan_env(s, gpus(gpu, cc), BUILD)
    assert plan.xformers and plan.xformers_version == "0.0.29.post2" and plan.xformers_index == index
    assert f"{engine} engine" in plan.xformers_reason
    assert "xformers==0.0.29.post2" in plan.constraints
    assert plan.expect["xformers"] == "0.0.29.post2" and plan.expect["xformers_cuda"] == "11.8"
    text = _build_script(s, plan, VLLM_WHEEL)
    line = XFORMERS.format(index=index)
    assert line in text
    assert text.index("pip_install -r /opt/verl-lab/env-build/verl-requirements.txt") < text.index(line)
    assert text.index(line) < text.index(f"pip_install {VLLM_WHEEL}")
    assert " xformers=0.0.29.post2 " in text            # in the marker


def test_no_vllm_no_xformers():
    s = settings()
    plan = envstage.plan_env(s, gpus(), BUILD)                     # a P40
    assert not plan.xformers and "no vLLM" in plan.xformers_reason
    assert not any(c.startswith("xformers") for c in plan.constraints)
    assert plan.expect["xformers"] is None and plan.expect["xformers_skip"]
    text = _build_script(s, plan)
    assert "xformers==" not in text and " xformers=skipped " in text


def test_cn_profile_build_script_and_vllm_skip_message():
    s = settings(mirror_profile="cn")
    plan = envstage.plan_env(s, gpus(), BUILD)
    text = _build_script(s, plan)
    assert "export PIP_INDEX_URL=https://pypi.tuna.tsinghua.edu.cn/simple" in text
    assert "export PIP_EXTRA_INDEX_URL=https://mirror.nju.edu.cn/pytorch/whl/cu118" in text
    assert "vLLM not installed: compute capability 6.1 < 7.0" in text
    assert "pip_install /" not in text


def test_venv_backend_script():
    s = settings(env_backend="venv", venv_python="/usr/bin/python3")
    text = _build_script(s, envstage.plan_env(s, gpus(), BUILD))
    assert "/usr/bin/python3 -m venv \"$GEN\"" in text and "conda create" not in text
    # the venv's bundled pip (22.0.2 on Ubuntu 22.04) is replaced before the Apex build needs it
    assert text.index('pip_install "$PIP_PIN"') < text.index('--config-settings "--build-option=--cpp_ext"')


def test_a_pip_pin_below_23_1_is_refused(tmp_path):
    old = tmp_path / "build-tools.txt"
    old.write_text("pip==23.0.1\nsetuptools==80.9.0\n")
    with pytest.raises(envstage.EnvPlanError, match="pip==23.0.1.*need pip >= 23.1"):
        envstage.env_pip_version(old)
    old.write_text("setuptools==80.9.0\n")
    with pytest.raises(envstage.EnvPlanError, match="pin no pip=="):
        envstage.env_pip_version(old)
    assert envstage.env_pip_version() == "25.1.1"


# ------------------------------------------------------------------ verl source ops

def test_verl_clone_and_patch_commands(monkeypatch):
    s = settings()
    cmds, _ = run_op(verl_source.verl_clone, monkeypatch, verl_source, {"VerlCheckout": None}, settings=s)
    script = shlex.split(cmds[0])[2]
    assert "clone -q --branch v0.5.0 --depth 1 https://github.com/volcengine/verl.git /opt/verl-lab/src/verl.part" in script
    assert "mv /opt/verl-lab/src/verl.part /opt/verl-lab/src/verl" in script
    at_tag = {"head": "a", "tag_commit": "a", "at_ref": True, "patches": {}}
    cmds, fake = run_op(verl_source.verl_clone, monkeypatch, verl_source, {"VerlCheckout": at_tag}, settings=s)
    assert cmds == [] and fake.noops
    patch = verl_source.box_patch_paths(s, "0.5.0")[0]
    name = patch.rsplit("/", 1)[1]
    applied = {**at_tag, "patches": {name: "applied"}}
    cmds, _ = run_op(verl_source.verl_patch, monkeypatch, verl_source, {"VerlCheckout": applied}, settings=s, patch=patch)
    assert cmds == []
    cmds, _ = run_op(verl_source.verl_patch, monkeypatch, verl_source,
                     {"VerlCheckout": {**at_tag, "patches": {name: "applicable"}}}, settings=s, patch=patch)
    script = shlex.split(cmds[0])[2]
    assert script.index("git apply --reverse --check") < script.index("git apply --check") < script.index(f"git apply {patch}")


# ------------------------------------------------------------------ facts and decisions

def test_env_decision():
    plan = envstage.plan_env(settings(), gpus(), BUILD)
    healthy = {"present": True, "healthy": True, "stamp": plan.stamp, "target": "verl.gen1", "broken": [], "checks": {}}
    assert envstage.env_decision(healthy, plan, {"stamp": plan.stamp})[0] == "ok"
    assert envstage.env_decision(healthy, plan, None)[0] == "marker"
    assert envstage.env_decision(healthy, plan, {"stamp": plan.stamp}, force=True)[0] == "build"
    assert envstage.env_decision({**healthy, "stamp": "old"}, plan, {"stamp": plan.stamp})[0] == "build"
    broken = {**healthy, "healthy": False, "broken": ["torch"], "checks": {"torch": {"ok": False, "detail": "gone"}}}
    action, why = envstage.env_decision(broken, plan, {"stamp": plan.stamp})
    assert action == "build" and "torch: gone" in why
    assert envstage.env_decision({"present": False}, plan, None)[0] == "build"


def test_catalog_torch_cuda_is_overridable():
    s = settings(catalog_overrides={"torch": {"cuda": "none"}})
    assert s.catalog.artifact("torch").get("cuda") == "none"
