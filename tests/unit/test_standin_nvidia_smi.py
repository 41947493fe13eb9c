"""The stand-in nvidia-smi (tests/lab/gpus.py) prints what the real one prints.

The H200 case is checked byte for byte against real output (/work/shared/data/nvidia-smi/,
copied into tests/fixtures/nvidia-smi/ when present); every GPU of the table is checked for
the fields and formats the provisioner reads.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from tests.lab.gpus import GPUS, Card, cards_for, cuda_of_driver, standin_nvidia_smi  # noqa: E402

REAL = [p for p in (REPO_ROOT / "tests/fixtures/nvidia-smi/h200.txt",
                    Path("/work/shared/data/nvidia-smi/h200.txt")) if p.is_file()]

# The real H200 capture, for when neither file is present (CI checkouts without /work/shared).
H200_CARD = Card(GPUS["h200"], 0, "GPU-e0de1f12-936f-3984-2319-4cf4caf631b6", "00000000:00:06.0",
                 temp_c=36, power_w=124)


@pytest.fixture
def smi(tmp_path):
    def make(cards, driver="535.104.05", clock=None):
        path = tmp_path / "nvidia-smi"
        path.write_text(standin_nvidia_smi(cards, driver, clock=clock))
        path.chmod(0o755)

        def run(*args):
            return subprocess.run([sys.executable, str(path), *args], capture_output=True, text=True)
        return run
    return make


def real_blocks(text: str):
    """(args, expected output) for each `$ nvidia-smi ...` block of a capture."""
    for block in re.split(r"^\$ ", text, flags=re.M)[1:]:
        cmd, _, out = block.partition("\n")
        if cmd.split()[0] == "nvidia-smi":
            yield cmd.split()[1:], out.rstrip("\n") + "\n"


@pytest.mark.skipif(not REAL, reason="real nvidia-smi capture h200.txt not found")
def test_h200_matches_real_capture_exactly(smi):
    run = smi([H200_CARD], "580.159.04", clock="Wed Dec  2 10:33:15 2026")
    blocks = list(real_blocks(REAL[0].read_text()))
    assert len(blocks) == 4
    for args, expected in blocks:
        res = run(*args)
        assert res.returncode == 0, res
        assert res.stdout == expected, f"nvidia-smi {' '.join(args)}"


@pytest.mark.parametrize("key", sorted(GPUS))
def test_every_gpu_answers_the_provisioner_query(smi, key):
    model = GPUS[key]
    run = smi(cards_for(f"box-{key}", [key]))
    res = run("--query-gpu=index,name,compute_cap,memory.total,driver_version", "--format=csv,noheader,nounits")
    assert res.returncode == 0
    assert res.stdout == f"0, {model.name}, {model.compute_cap}, {model.memory_mib}, 535.104.05\n"
    full = run("--query-gpu=index,name,compute_cap,memory.total,memory.used,memory.free,driver_version,uuid,pci.bus_id",
               "--format=csv").stdout.splitlines()
    assert full[0] == ("index, name, compute_cap, memory.total [MiB], memory.used [MiB], memory.free [MiB], "
                       "driver_version, uuid, pci.bus_id")
    idx, name, cc, total, used, free, drv, uuid, bus = full[1].split(", ")
    assert (name, cc, total, used) == (model.name, model.compute_cap, f"{model.memory_mib} MiB", "0 MiB")
    assert free.endswith(" MiB") and 0 < int(free.split()[0]) < model.memory_mib
    assert re.fullmatch(r"GPU-[0-9a-f]{8}-([0-9a-f]{4}-){3}[0-9a-f]{12}", uuid)
    assert re.fullmatch(r"[0-9A-F]{8}:[0-9A-F]{2}:[0-9A-F]{2}\.\d", bus)
    table = run().stdout.splitlines()
    assert all(len(line) == 91 for line in table[1:] if line), "table rows keep the real 91-column layout"
    assert any(model.name in line and "|" in line for line in table)
    assert any(f"0MiB / {model.memory_mib}MiB" in line for line in table)
    assert run("-L").stdout == f"GPU 0: {model.name} (UUID: {uuid})\n"


def test_table_and_expected_names():
    names = {k: (g.name, g.memory_mib, g.compute_cap) for k, g in GPUS.items()}
    assert names == {
        "k80": ("Tesla K80", 11441, "3.7"), "p40": ("Tesla P40", 24576, "6.1"), "p100": ("Tesla P100-PCIE-16GB", 16384, "6.0"),
        "v100": ("Tesla V100-SXM2-32GB", 32768, "7.0"), "t4": ("Tesla T4", 15360, "7.5"),
        "rtx2080ti": ("NVIDIA GeForce RTX 2080 Ti", 11264, "7.5"),
        "gtx1080": ("NVIDIA GeForce GTX 1080", 8192, "6.1"), "rtx2070": ("NVIDIA GeForce RTX 2070", 8192, "7.5"),
        "rtx4060": ("NVIDIA GeForce RTX 4060", 8188, "8.9"),
        "rtx3090": ("NVIDIA GeForce RTX 3090", 24576, "8.6"), "rtx4090": ("NVIDIA GeForce RTX 4090", 24564, "8.9"),
        "a100": ("NVIDIA A100-SXM4-80GB", 81920, "8.0"), "h100": ("NVIDIA H100 80GB HBM3", 81559, "9.0"),
        "h200": ("NVIDIA H200", 143771, "9.0"),
    }


def test_unknown_field_fails_like_the_real_one(smi):
    res = smi(cards_for("b", ["t4"]))("--query-gpu=index,bogus.field", "--format=csv")
    assert res.returncode == 2
    assert res.stdout.startswith('Field "bogus.field" is not a valid field to query.')


def test_units_and_header_switches(smi):
    run = smi(cards_for("b", ["p40"]))
    assert run("--query-gpu=memory.total", "--format=csv").stdout == "memory.total [MiB]\n24576 MiB\n"
    assert run("--query-gpu=memory.total", "--format=csv,nounits").stdout == "memory.total [MiB]\n24576\n"
    assert run("--query-gpu=memory.total", "--format=csv,noheader").stdout == "24576 MiB\n"
    assert run("--query-gpu=name", "--format=csv,noheader").stdout == "Tesla P40\n"


def test_multi_gpu_box_and_index_selection(smi):
    run = smi(cards_for("big", ["a100", "a100"]))
    out = run("--query-gpu=index,name", "--format=csv,noheader").stdout
    assert out == "0, NVIDIA A100-SXM4-80GB\n1, NVIDIA A100-SXM4-80GB\n"
    assert run("--query-gpu=index", "--format=csv,noheader", "-i", "1").stdout == "1\n"
    uuids = run("--query-gpu=uuid", "--format=csv,noheader").stdout.split()
    assert len(set(uuids)) == 2
    assert len(run("-L").stdout.splitlines()) == 2


def test_driver_is_configurable_and_sets_cuda_banner(smi):
    run = smi(cards_for("b", ["p40"]), driver="470.239.06")
    assert run("--query-gpu=driver_version", "--format=csv,noheader").stdout == "470.239.06\n"
    assert "CUDA Version: 11.4" in run().stdout
    assert cuda_of_driver("535.104.05") == "12.2" and cuda_of_driver("580.159.04") == "13.0"


def test_standin_is_marked_in_the_file_only(smi):
    text = standin_nvidia_smi(cards_for("b", ["t4"]))
    assert "STAND-IN" in text.splitlines()[1]
    run = smi(cards_for("b", ["t4"]))
    for args in ((), ("-L",), ("--query-gpu=name", "--format=csv")):
        assert "stand-in" not in run(*args).stdout.lower()


def test_uuids_differ_between_boxes():
    a = cards_for("p40-aaaaaa", ["p40"])[0].uuid
    b = cards_for("p40-bbbbbb", ["p40"])[0].uuid
    assert a != b and a == cards_for("p40-aaaaaa", ["p40"])[0].uuid
