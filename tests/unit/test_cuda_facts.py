"""Facts of the CUDA stage: parsers on real output formats, and the fact commands run for real
(read-only) against stand-in toolkits and fake nvidia-smi programs in a temp folder."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tasks.facts.disk import FreeDisk
from tasks.facts.gpu import NvidiaGpus, driver_view, parse_gpu_query, parse_proc_driver_version, parse_smi_banner
from tasks.facts.nvidia import (
    CudaHostCompiler,
    CudaToolkits,
    parse_cudnn_version_header,
    parse_nvcc_version,
)
from tests.fixtures.standins.cuda import CUDNN_VERSION_H, NVCC_OUTPUT, fake_toolkit

H200_CAPTURE = Path("/work/shared/data/nvidia-smi/h200.txt")

PROC_PROPRIETARY = (
    "NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.104.05  Sat Aug 19 01:15:15 UTC 2023\n"
    "GCC version:  gcc version 12.2.0 (Debian 12.2.0-14) \n"
)
PROC_OPEN = (
    "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.159.04  Release Build  "
    "(dvs-builder@U16-I3-B16-1-3)  Thu Nov 13 23:47:21 UTC 2025\n"
    "GCC version:  gcc version 12.3.0 (Ubuntu 12.3.0-1ubuntu1~22.04) \n"
)
PROC_OLD = "NVRM version: NVIDIA UNIX x86_64 Kernel Module  470.82.01  Wed Oct 27 21:21:55 UTC 2021\n"
SMI_NO_DRIVER = ("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
                 "Make sure that the latest NVIDIA driver is installed and running.")


def run_fact(fact, *args, env=None) -> object:
    """Run a fact's real shell command here (read-only commands only) and process its output."""
    cmd = fact.command(*args)
    out = subprocess.run(["sh", "-c", cmd], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    return fact.process(out.stdout.splitlines())


# ---------------------------------------------------------------- parsers


@pytest.mark.parametrize("release,version", [("11.8", "11.8.89"), ("12.1", "12.1.105"), ("12.4", "12.4.131")])
def test_nvcc_version_real_outputs(release, version):
    assert parse_nvcc_version(NVCC_OUTPUT[release]) == {"release": release, "version": version}


def test_nvcc_version_garbage():
    assert parse_nvcc_version("") is None
    assert parse_nvcc_version("sh: 1: nvcc: not found") is None
    assert parse_nvcc_version("Cuda compilation tools, release 11.8") is None  # no V build


def test_proc_driver_version_formats():
    assert parse_proc_driver_version(PROC_PROPRIETARY) == "535.104.05"
    assert parse_proc_driver_version(PROC_OPEN) == "580.159.04"
    assert parse_proc_driver_version(PROC_OLD) == "470.82.01"
    assert parse_proc_driver_version("") is None


@pytest.mark.skipif(not H200_CAPTURE.exists(), reason="real nvidia-smi capture not present")
def test_smi_banner_on_real_h200_capture():
    assert parse_smi_banner(H200_CAPTURE.read_text()) == "580.159.04"


def test_driver_view_of_an_old_driver_without_compute_cap():
    inv = parse_gpu_query("0, Tesla P40, 24576, 24400, 470.82.01",
                          ("index", "name", "memory.total", "memory.free", "driver_version"))
    assert driver_view(inv) == {"version": "470.82.01", "source": "nvidia-smi", "error": None,
                                "gpus": [{"driver": "470.82.01", "name": "Tesla P40", "compute_cap": "6.1"}]}


def test_cudnn_header():
    assert parse_cudnn_version_header(CUDNN_VERSION_H) == "8.9.7"
    assert parse_cudnn_version_header("#define CUDNN_MAJOR 8\n#define CUDNN_MINOR 9\n") is None
    nine = "#define CUDNN_MAJOR 9\n#define CUDNN_MINOR 1\n#define CUDNN_PATCHLEVEL 0\n"
    assert parse_cudnn_version_header(nine) == "9.1.0"


# ---------------------------------------------------------------- facts, commands run for real


def _fake_smi(tmp_path: Path, body: str, rc: int = 0) -> dict:
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    smi = bindir / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\ncat <<'EOF'\n{body}\nEOF\nexit {rc}\n")
    smi.chmod(0o755)
    return {**os.environ, "PATH": f"{bindir}:/usr/bin:/bin"}


def test_driver_from_the_gpu_fact(tmp_path):
    env = _fake_smi(tmp_path, "0, Tesla P40, 6.1, 24576, 24400, 535.104.05")
    got = driver_view(run_fact(NvidiaGpus(), env=env))
    assert got["version"] == "535.104.05" and got["source"] == "nvidia-smi"
    assert got["gpus"] == [{"driver": "535.104.05", "name": "Tesla P40", "compute_cap": "6.1"}]


def test_driver_from_the_gpu_fact_smi_failing(tmp_path):
    env = _fake_smi(tmp_path, SMI_NO_DRIVER, rc=9)
    if Path("/proc/driver/nvidia/version").exists():
        pytest.skip("this machine has a real NVIDIA driver")
    got = driver_view(run_fact(NvidiaGpus(), env=env))
    assert got["version"] is None and "couldn't communicate" in got["error"]


def test_driver_from_the_gpu_fact_no_driver(tmp_path):
    if Path("/proc/driver/nvidia/version").exists():
        pytest.skip("this machine has a real NVIDIA driver")
    env = {**os.environ, "PATH": f"{tmp_path}:/nonexistent"}  # no nvidia-smi anywhere
    cmd = NvidiaGpus().command()
    out = subprocess.run(["/bin/sh", "-c", cmd], capture_output=True, text=True, env=env)
    assert driver_view(NvidiaGpus().process(out.stdout.splitlines())) is None


def test_toolkits_fact_reads_each_prefix(tmp_path):
    other = fake_toolkit(tmp_path, "12.4", link=False)
    ours = tmp_path / "cuda-11.8"
    (ours / "bin").mkdir(parents=True)
    (ours / "include").mkdir()
    from tests.fixtures.standins.cuda import nvcc_script
    (ours / "bin" / "nvcc").write_text(nvcc_script("11.8"))
    (ours / "bin" / "nvcc").chmod(0o755)
    (ours / "include" / "cudnn_version.h").write_text(CUDNN_VERSION_H)
    partial = tmp_path / "cuda-partial"
    partial.mkdir()
    (partial / ".verl-lab-in-progress").write_text("cuda_link=absent\n")
    got = run_fact(CudaToolkits(), [str(other), str(ours), str(partial), str(tmp_path / "missing")])
    tks = got["toolkits"]
    assert tks[str(other)] == {"nvcc": {"release": "12.4", "version": "12.4.131"}, "cudnn": None, "in_progress": False}
    assert tks[str(ours)] == {"nvcc": {"release": "11.8", "version": "11.8.89"}, "cudnn": "8.9.7", "in_progress": False}
    assert tks[str(partial)] == {"nvcc": None, "cudnn": None, "in_progress": True}
    assert str(tmp_path / "missing") not in tks


def test_free_disk_nearest_existing_parent(tmp_path):
    got = run_fact(FreeDisk(), str(tmp_path / "not" / "yet" / "there"))
    assert got["path"] == str(tmp_path)
    assert got["free_mib"] > 0 and got["mount"].startswith("/")


def test_host_compiler_fact_runs_here():
    here = run_fact(CudaHostCompiler())
    assert set(here) == {"gcc", "gcc-11", "g++-11"}
