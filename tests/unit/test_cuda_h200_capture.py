"""Real output of the CUDA stage's fact commands on the lent H200 box (Ubuntu 24.04, driver
 580.159.04, CUDA 13.0 installed through update-alternatives), captured 2026-12-02 by running
 the commands of tasks/facts/{nvidia,disk}.py there; replayed through the facts and the planner.
 The driver's lines (nvidia-smi's query and banner, /proc/driver/nvidia/version) are laid out as
 the GPU fact (tasks/facts/gpu.py) prints them; the toolkits', disk's and compiler's outputs are
 cases of the facts' table (tests/fixtures/facts/, tests/unit/test_facts_table.py)."""

from __future__ import annotations

import json
from pathlib import Path

from tasks.cuda import CudaFacts, cuda_want, plan_cuda
from tasks.facts.disk import FreeDisk
from tasks.facts.gpu import NvidiaGpus, driver_view
from tasks.facts.nvidia import CudaHostCompiler, CudaToolkits
from tasks.settings import load_settings
from tasks.target import decide_compiler

FACT_CASES = Path(__file__).resolve().parents[1] / "fixtures" / "facts"

H200_DRIVER = """\
0, NVIDIA H200, 9.0, 143771, 143156, 580.159.04
__verl_lab_rc__=0
__verl_lab_proc_driver__
NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.159.04  Release Build  (nixbld@)  
GCC version:  gcc version 15.3.0 (GCC) 
"""
# the same box with nvidia-smi's query failing: the banner and /proc still name the driver
H200_DRIVER_QUERY_FAILED = """\
Failed to initialize NVML: Unknown Error
__verl_lab_rc__=255
__verl_lab_smi_banner__
Failed to initialize NVML: Unknown Error
__verl_lab_proc_driver__
NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.159.04  Release Build  (nixbld@)  
GCC version:  gcc version 15.3.0 (GCC) 
"""


def recorded(fact: str, case: str) -> list[str]:
    """The box's output of a fact, as recorded in the facts' table (tests/unit/test_facts_table.py)."""
    return json.loads((FACT_CASES / fact / f"{case}.json").read_text())["output"]


H200_TOOLKITS = recorded("nvidia.CudaToolkits", "h200")
H200_DISK_PREFIX = recorded("disk.FreeDisk", "h200_prefix")
H200_COMPILER = recorded("nvidia.CudaHostCompiler", "h200")
H200_OS_RELEASE = {"ID": "ubuntu", "VERSION_ID": "24.04", "PRETTY_NAME": "Ubuntu 24.04.3 LTS"}


def lines(text: str) -> list[str]:
    return text.splitlines()


def test_driver_fact_on_real_h200():
    got = driver_view(NvidiaGpus().process(lines(H200_DRIVER)))
    assert got == {"version": "580.159.04", "source": "nvidia-smi", "error": None,
                   "gpus": [{"driver": "580.159.04", "name": "NVIDIA H200", "compute_cap": "9.0"}]}


def test_proc_fallback_on_real_h200_open_module():
    inv = NvidiaGpus().process(lines(H200_DRIVER_QUERY_FAILED))
    assert not inv.ok
    got = driver_view(inv)
    assert got["version"] == "580.159.04" and got["source"] == "proc"


def test_plan_for_the_real_h200_box():
    want = cuda_want(load_settings("h200", {}))
    disk = FreeDisk().process(H200_DISK_PREFIX)
    facts = CudaFacts(
        os_release=H200_OS_RELEASE,
        driver=driver_view(NvidiaGpus().process(lines(H200_DRIVER))),
        toolkits=CudaToolkits().process(H200_TOOLKITS),
        disk={want.tmpdir: disk, want.prefix: disk, want.box_cache: disk},
        compiler=decide_compiler(H200_OS_RELEASE, CudaHostCompiler().process(H200_COMPILER)),
        marker=None,
    )
    plan = plan_cuda(want, facts)
    # driver 580 >= 520.61.05, Hopper is not limited to branch <= 580, 65 GB free > 23.4 GB needed;
    # gcc 13 is too new for nvcc 11.8, so gcc-11/g++-11 get installed
    assert plan.action == "install" and not plan.problems
    assert facts.compiler.install and plan.host_cc == "/usr/bin/gcc-11"
