"""The GPU fact: parser on the real H200 capture and on stand-in formats, and the fact's
shell command run against fake nvidia-smi programs (missing, no driver, old driver)."""

from __future__ import annotations

import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tasks.facts.gpu import NvidiaGpus
from verl_lab_box import gpu as gpufact
from verl_lab_box.gpu import (
    GpuInventory,
    compute_capability_from_name,
    parse_fact_output,
    parse_gpu_query,
)

H200_CAPTURE = Path("/work/shared/data/nvidia-smi/h200.txt")
REPO = Path(__file__).resolve().parents[2]


def _capture_section(command_prefix: str) -> str:
    """The output printed under the `$ <command>` line of the real capture."""
    text = H200_CAPTURE.read_text()
    blocks = re.split(r"^\$ ", text, flags=re.M)
    for block in blocks:
        head, _, body = block.partition("\n")
        if head.startswith(command_prefix):
            return body.strip("\n")
    raise AssertionError(f"no `{command_prefix}` section in {H200_CAPTURE}")


@pytest.mark.skipif(not H200_CAPTURE.exists(), reason="real nvidia-smi capture not present")
def test_real_h200_noheader_nounits():
    body = _capture_section("nvidia-smi --query-gpu=index,name,compute_cap,memory.total,driver_version --format=csv,noheader,nounits")
    inv = parse_gpu_query(body, ("index", "name", "compute_cap", "memory.total", "driver_version"))
    assert inv.ok and inv.problem is None
    (g,) = inv.gpus
    assert (g.index, g.name, g.compute_capability, g.memory_total_mib, g.driver_version) == (
        0, "NVIDIA H200", "9.0", 143771, "580.159.04")
    assert g.cc == (9, 0)
    assert g.memory_free_mib is None


@pytest.mark.skipif(not H200_CAPTURE.exists(), reason="real nvidia-smi capture not present")
def test_real_h200_with_header_and_units():
    body = _capture_section("nvidia-smi --query-gpu=index,name,compute_cap,memory.total,memory.used,memory.free,driver_version,uuid,pci.bus_id --format=csv")
    fields = ("index", "name", "compute_cap", "memory.total", "memory.used", "memory.free",
              "driver_version", "uuid", "pci.bus_id")
    inv = parse_gpu_query(body, fields)
    (g,) = inv.gpus
    assert g.memory_total_mib == 143771 and g.memory_free_mib == 143156
    assert g.compute_capability_from == "nvidia-smi"


def test_multi_gpu_and_free_memory():
    text = ("0, NVIDIA GeForce RTX 3090, 8.6, 24576, 24250, 535.104.05\n"
            "1, NVIDIA GeForce RTX 3090, 8.6, 24576, 1200, 535.104.05\n")
    inv = parse_gpu_query(text)
    assert [g.index for g in inv.gpus] == [0, 1]
    assert [g.memory_free_mib for g in inv.gpus] == [24250, 1200]
    assert inv.driver_version == "535.104.05"


def test_not_available_fields():
    inv = parse_gpu_query("0, Tesla P40, [N/A], 24576, [N/A], 470.82.01\n")
    (g,) = inv.gpus
    assert g.compute_capability == "6.1" and g.compute_capability_from == "name table"
    assert g.memory_free_mib is None
    assert any("name table" in n for n in inv.notes)


@pytest.mark.parametrize("name,cc", [
    ("Tesla P40", "6.1"), ("Tesla P100-PCIE-16GB", "6.0"), ("Tesla V100-SXM2-32GB", "7.0"),
    ("Tesla T4", "7.5"), ("NVIDIA GeForce RTX 2080 Ti", "7.5"), ("GeForce RTX 2080 Ti", "7.5"),
    ("NVIDIA GeForce RTX 3090", "8.6"), ("NVIDIA A10", "8.6"), ("NVIDIA GeForce RTX 4090", "8.9"),
    ("NVIDIA L40S", "8.9"), ("NVIDIA A100-SXM4-80GB", "8.0"), ("NVIDIA A100-PCIE-40GB", "8.0"),
    ("NVIDIA H100 80GB HBM3", "9.0"), ("NVIDIA H200", "9.0"), ("Tesla K80", "3.7"), ("Tesla K40m", "3.5"),
    ("Tesla M40 24GB", "5.2"), ("NVIDIA B200", "10.0"), ("NVIDIA GeForce RTX 5090", "12.0"),
])
def test_name_table(name, cc):
    assert compute_capability_from_name(name) == cc


def test_name_table_unknown_and_no_false_prefix():
    assert compute_capability_from_name("Matrox G200") is None
    assert compute_capability_from_name("NVIDIA A1000") is None      # not an A100


def test_driver_failure_message_is_a_problem():
    text = ("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
            "Make sure that the latest NVIDIA driver is installed and running.\n")
    inv = parse_gpu_query(text)
    assert not inv.ok and inv.gpus == ()
    assert "driver is not loaded" in inv.problem


def test_garbage_is_a_problem_not_a_crash():
    assert "expected 6" in parse_gpu_query("hello world\n").problem
    assert "not a GPU record" in parse_gpu_query("x, Tesla T4, 7.5, lots, 1, 535\n").problem
    assert parse_gpu_query("").problem == "nvidia-smi listed no GPU"


def test_inventory_round_trips_json():
    inv = parse_gpu_query("0, Tesla T4, 7.5, 15360, 15102, 535.104.05\n")
    import json
    assert GpuInventory.from_dict(json.loads(inv.to_json())) == inv


# ---------------------------------------------------------------- the fact's shell command

def _fake_smi(tmp_path: Path, script: str) -> dict:
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    smi = bindir / "nvidia-smi"
    smi.write_text("#!/bin/sh\n" + script)
    smi.chmod(smi.stat().st_mode | stat.S_IEXEC)
    return {"PATH": f"{bindir}:/usr/bin:/bin"}


def _run_fact(env: dict) -> GpuInventory:
    out = subprocess.run(["sh", "-c", gpufact.fact_command()], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return NvidiaGpus().process(out.stdout.splitlines())


def test_fact_no_nvidia_smi(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    # PATH without nvidia-smi, but with the shell tools the command uses
    inv = _run_fact({"PATH": f"{empty}:/usr/bin:/bin"} if not Path("/usr/bin/nvidia-smi").exists() else {"PATH": str(empty)})
    assert inv.gpus == () and "not installed" in inv.problem


def test_fact_driver_not_loaded(tmp_path):
    env = _fake_smi(tmp_path, "echo \"NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
                              "Make sure that the latest NVIDIA driver is installed and running.\"\nexit 9\n")
    inv = _run_fact(env)
    assert inv.gpus == ()
    assert "driver is not loaded" in inv.problem and "exited 9" in inv.problem


def test_fact_no_devices(tmp_path):
    env = _fake_smi(tmp_path, "echo 'No devices were found'\nexit 6\n")
    inv = _run_fact(env)
    assert "sees no NVIDIA GPU" in inv.problem


def test_fact_old_driver_without_compute_cap(tmp_path):
    # an old (470) nvidia-smi: compute_cap is an unknown field, the query without it works
    env = _fake_smi(tmp_path, """
case "$1" in
  *compute_cap*) echo 'Field "compute_cap" is not a valid field to query.'; echo; exit 2;;
  --query-gpu=index,name,memory.total,memory.free,driver_version)
     echo '0, Tesla P40, 24451, 24300, 470.82.01'; echo '1, Tesla P40, 24451, 24300, 470.82.01';;
  *) echo "unexpected: $*"; exit 3;;
esac
""")
    inv = _run_fact(env)
    assert inv.ok and len(inv.gpus) == 2
    assert all(g.compute_capability == "6.1" and g.compute_capability_from == "name table" for g in inv.gpus)
    assert "no compute_cap field" in inv.notes[0]


def test_fact_rejects_a_real_failure_on_old_query(tmp_path):
    env = _fake_smi(tmp_path, """
case "$1" in
  *compute_cap*) echo 'Field "compute_cap" is not a valid field to query.'; exit 2;;
  *) echo "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver."; exit 9;;
esac
""")
    inv = _run_fact(env)
    assert inv.gpus == () and "driver is not loaded" in inv.problem



@pytest.mark.parametrize("key", ["p40", "p100", "v100", "t4", "rtx2080ti", "rtx3090", "rtx4090",
                                 "a100", "h100", "h200"])
def test_fact_against_lab_standin(tmp_path, key):
    from tests.lab import gpus as labgpus  # an import error fails the test, never skips it

    cards = labgpus.cards_for("box", [key, key])
    bindir = tmp_path / "bin"
    bindir.mkdir()
    smi = bindir / "nvidia-smi"
    smi.write_text(labgpus.standin_nvidia_smi(cards).replace("#!/usr/bin/python3", f"#!{sys.executable}", 1))
    smi.chmod(0o755)
    inv = _run_fact({"PATH": f"{bindir}:/usr/bin:/bin"})
    model = labgpus.gpu(key)
    assert inv.ok and len(inv.gpus) == 2
    g = inv.gpus[1]
    assert (g.index, g.name, g.compute_capability, g.memory_total_mib) == (1, model.name, model.compute_cap, model.memory_mib)
    assert g.memory_free_mib == model.memory_mib - model.reserved_mib
    assert compute_capability_from_name(model.name) == model.compute_cap


def test_nvml_reader_without_driver():
    """On this machine NVML either is not installed or finds no driver: an answer, not a crash."""
    inv = gpufact.read_nvml()
    if inv.ok:  # pragma: no cover - only on a machine with a GPU
        assert inv.gpus[0].compute_capability_from == "nvml"
    else:
        assert inv.gpus == () and inv.source == "nvml"
        assert "NVML" in inv.problem


def test_nvml_reader_with_fake_library(monkeypatch):
    """The reader's use of the pynvml API, with a fake module shaped like nvidia-ml-py."""
    import types

    class Mem:
        total, free = 150754820096, 150109880320

    fake = types.SimpleNamespace(
        nvmlInit=lambda: None, nvmlShutdown=lambda: None,
        nvmlSystemGetDriverVersion=lambda: "580.159.04",
        nvmlDeviceGetCount=lambda: 1,
        nvmlDeviceGetHandleByIndex=lambda i: ("h", i),
        nvmlDeviceGetName=lambda h: "NVIDIA H200",
        nvmlDeviceGetCudaComputeCapability=lambda h: (9, 0),
        nvmlDeviceGetMemoryInfo=lambda h: Mem,
    )
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    inv = gpufact.read_nvml()
    (g,) = inv.gpus
    # the H200's NVML numbers (real capture): 143771 MiB total, 143156 MiB free
    assert (g.name, g.compute_capability, g.memory_total_mib, g.memory_free_mib) == ("NVIDIA H200", "9.0", 143771, 143156)


def test_box_module_imports_without_pyinfra(tmp_path):
    """The launcher's preflight loads verl_lab_box/gpu.py in the training env, where pyinfra is
    absent; the fact module re-exports the same objects."""
    code = ("import sys, builtins\n"
            "real = builtins.__import__\n"
            "def block(name, *a, **k):\n"
            "    if name.startswith('pyinfra'): raise ImportError(name)\n"
            "    return real(name, *a, **k)\n"
            "builtins.__import__ = block\n"
            f"sys.path.insert(0, {str(REPO / 'verl_lab_box')!r})\n"
            "import gpu\n"
            "assert not hasattr(gpu, 'NvidiaGpus')\n"
            "print(gpu.parse_gpu_query('0, Tesla T4, 7.5, 15360, 15102, 535.104.05').gpus[0].name)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "Tesla T4"
    from tasks.facts import gpu as fact

    assert fact.GpuInventory is GpuInventory and fact.parse_fact_output is parse_fact_output


REPO_CAPTURE = REPO / "bench" / "gpu" / "results" / "h200-gpu-fact.txt"


@pytest.mark.skipif(not REPO_CAPTURE.exists(), reason="bench/gpu/results/h200-gpu-fact.txt not captured yet")
def test_repo_h200_capture_with_free_memory():
    """The device capture kept in the repo (bench/gpu): the fact's fields plus memory.used."""
    text = REPO_CAPTURE.read_text()
    head = "$ nvidia-smi --query-gpu=index,name,compute_cap,memory.total,memory.used,memory.free,driver_version"
    body = text.split(head, 1)[1].split("\n", 1)[1].split("\n\n", 1)[0]
    inv = parse_gpu_query(body, ("index", "name", "compute_cap", "memory.total", "memory.used", "memory.free",
                                 "driver_version"))
    (g,) = inv.gpus
    assert (g.name, g.compute_capability, g.memory_total_mib, g.memory_free_mib, g.driver_version) == (
        "NVIDIA H200", "9.0", 143771, 143156, "580.159.04")
    # and NVML's bytes from the same capture, rounded the way read_nvml rounds them
    assert "total=150754820096 free=150109880320" in text
    assert round(150109880320 / 2**20) == g.memory_free_mib
