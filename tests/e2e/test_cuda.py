"""The CUDA stage on lab-in-a-box hosts, with the stand-in runfile and cuDNN archive
(tests/fixtures/standins/cuda.py) served by the lab mirror at the catalog's NVIDIA paths.

converge (4 boxes, relay and direct mode, global and cn profile, one too-old driver that must
fail alone) -> verify on each box -> idempotence (zero changed operations) -> faults: a killed
install converges on the next run; a corrupted archive is rejected in both modes, installing
nothing -> destroy (the fixture, even on failure).
"""

from __future__ import annotations

import re
import threading
import time
import uuid

import pytest

from tests.fixtures.standins import cuda as standin
from tests.lab import BoxSpec

PREFIX = "/usr/local/cuda-11.8"
MARKER = "/opt/verl-lab/markers/cuda.done"
RUNFILE = "/opt/verl-lab/cache/cuda_runfile/cuda_11.8.0_520.61.05_linux.run"
CUDNN = "/opt/verl-lab/cache/cudnn_archive/cudnn-linux-x86_64-8.9.7.29_cuda11-archive.tar.xz"
GOOD = ["fresh", "cuda12", "buildbox"]
ALL = [*GOOD, "olddrv"]
PER_HOST = {
    "cuda12": {"artifact_mode": "direct", "mirror_profile": "cn"},
    "buildbox": {"allow_no_driver": True},
}


@pytest.fixture(scope="module")
def lab(lab_factory):
    lab = lab_factory([
        BoxSpec("fresh", gpu="t4"),
        BoxSpec("cuda12", gpu="rtx3090"),
        BoxSpec("buildbox", driver=None),
        BoxSpec("olddrv", gpu="p40", driver="470.82.01"),
        BoxSpec("killme", gpu="a100"),
        BoxSpec("corrupt", gpu="t4"),
    ])
    lab.overrides = standin.publish(lab.mirror.root)
    lab.cuda12_before = standin.tree_digest(standin.fake_toolkit(lab.box("cuda12").root, "12.4"))
    return lab


def deploy(lab, hosts, per_host=None, **data):
    return lab.deploy("deploy/cuda.py", hosts=hosts, data={"catalog_overrides": lab.overrides, **data},
                      per_host={h: v for h, v in {**PER_HOST, **(per_host or {})}.items() if h in hosts})


@pytest.fixture(scope="module")
def converged(lab):
    return deploy(lab, ALL)


def marker(box) -> dict:
    return dict(line.split("=", 1) for line in box.read_text(MARKER).splitlines())


def test_old_driver_fails_alone_with_a_clear_message(converged):
    assert converged.rc != 0 and converged.failed_hosts == ["olddrv"], converged
    out = converged.output
    assert "NVIDIA driver 470.82.01 is too old for CUDA 11.8, which needs >= 520.61.05" in out
    assert "Tesla P40 (compute capability 6.1)" in out and "branch 535 .. 580" in out


def test_old_driver_box_untouched(lab, converged):
    box = lab.box("olddrv")
    assert not box.exists(PREFIX) and not box.exists(MARKER) and not box.exists("/opt/verl-lab/cache/cuda_runfile")


@pytest.mark.parametrize("name", GOOD)
def test_proofs_on_each_box(lab, converged, name):
    box = lab.box(name)
    assert "Cuda compilation tools, release 11.8, V11.8.89" in box.ssh(f"{PREFIX}/bin/nvcc --version").stdout
    header = box.read_text(f"{PREFIX}/include/cudnn_version.h")
    assert re.search(r"^#define CUDNN_MAJOR 8$", header, re.M) and re.search(r"^#define CUDNN_MINOR 9$", header, re.M)
    links = box.ssh(f"readlink {PREFIX}/lib64/libcudnn.so {PREFIX}/lib64/libcudnn.so.8").stdout.split()
    assert links == ["libcudnn.so.8", "libcudnn.so.8.9.7"]
    got = marker(box)
    assert got["nvcc_version"] == "11.8.89" and got["cudnn_header"] == "8.9.7" and got["prefix"] == PREFIX
    assert got["cudnn_sha256"] == lab.overrides["cudnn_archive"]["sha256"]
    assert got["host_cc"] == "/usr/bin/gcc-11"     # Debian 12's gcc 12 is too new for nvcc 11.8
    assert not box.exists(f"{PREFIX}/.verl-lab-in-progress")
    assert not box.exists(RUNFILE) and not box.exists(CUDNN)      # 4 GB back after a verified install
    assert box.exists("/var/log/cuda-installer.log") and not box.exists("/var/tmp/verl-lab/cuda-11.8.0")


def test_no_cuda_link_stays_absent(lab, converged):
    box = lab.box("fresh")
    assert box.ssh("test -e /usr/local/cuda || test -L /usr/local/cuda", check=False).returncode == 1
    assert marker(box)["cuda_link"] == "absent"


def test_existing_cuda12_left_exactly_as_it_was(lab, converged):
    box = lab.box("cuda12")
    assert box.ssh("readlink /usr/local/cuda").stdout.strip() == "/usr/local/cuda-12.4"
    assert standin.tree_digest(box.root / "usr/local/cuda-12.4") == lab.cuda12_before
    assert "release 12.4, V12.4.131" in box.ssh("/usr/local/cuda/bin/nvcc --version").stdout
    # the runfile did re-point the link (its log says so), and the stage put it back
    assert "Creating symlink /usr/local/cuda -> /usr/local/cuda-11.8" in box.read_text("/var/log/cuda-installer.log")
    assert marker(box)["cuda_link"] == "link:/usr/local/cuda-12.4"


def test_direct_mode_box_downloaded_itself(lab, converged):
    # relay boxes got their copy from the controller cache; the direct box fetched from the mirror
    assert (lab.controller_cache / "artifacts" / "cuda_runfile").is_dir()
    assert marker(lab.box("cuda12"))["runfile_sha256"] == lab.overrides["cuda_runfile"]["sha256"]


def test_rerun_changes_nothing(lab, converged):
    deploy(lab, GOOD).assert_idempotent()


def test_killed_install_is_redone(lab):
    box = lab.box("killme")
    result = {}
    thread = threading.Thread(target=lambda: result.setdefault("res", deploy(lab, ["killme"])))
    thread.start()
    pid = None
    deadline = time.monotonic() + 120
    while pid is None and time.monotonic() < deadline:
        if box.exists(f"{PREFIX}/bin/ptxas"):          # the runfile is midway through the tree
            for line in box.ssh("ps -eo pid=,args=").stdout.splitlines():
                found, _, args = line.strip().partition(" ")
                if args.startswith(f"sh {RUNFILE} --silent"):
                    pid = int(found)
        time.sleep(0.1)
    assert pid, "the runfile never ran on killme"
    box.ssh(f"kill -9 {pid}")
    thread.join(timeout=300)
    killed = result["res"]
    assert killed.failed_hosts == ["killme"] and "the CUDA runfile failed" in killed.output
    assert not box.exists(MARKER)
    assert box.exists(f"{PREFIX}/.verl-lab-in-progress") and box.exists(f"{PREFIX}/bin/nvcc")

    again = deploy(lab, ["killme"])
    again.assert_ok()
    assert "interrupted install" in again.output
    assert marker(box)["nvcc_version"] == "11.8.89"
    assert not box.exists(f"{PREFIX}/.verl-lab-in-progress")
    deploy(lab, ["killme"]).assert_idempotent()


def test_corrupted_archive_rejected_in_both_modes(lab):
    """Runs last: from here on the mirror serves a cuDNN archive whose sha256 is wrong."""
    box = lab.box("corrupt")
    expected = lab.overrides["cudnn_archive"]["sha256"]
    actual = standin.corrupt(lab.mirror.root, "cudnn_archive")
    direct = deploy(lab, ["corrupt"], artifact_mode="direct")
    assert direct.failed_hosts == ["corrupt"]
    assert f"expected {expected}, got {actual}" in direct.output
    relay = deploy(lab, ["corrupt"], artifact_mode="relay",
                   controller_cache=str(lab.controller_cache.parent / f"cache-{uuid.uuid4().hex[:6]}"))
    assert relay.rc != 0 and f"expected {expected}, got {actual}" in relay.output
    for path in (PREFIX, MARKER, CUDNN, CUDNN + ".part"):
        assert not box.exists(path), path
