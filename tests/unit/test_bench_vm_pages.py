"""The bench VM's free page reporting detection and write sizes (bench/vm_pages.py), and how the
download bench (bench/download.py) wires them into its arms through tasks.fetch.download."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench import vm_pages
from tests.lab.mirror import Mirror

REPO = Path(__file__).resolve().parents[2]
PAYLOAD = os.urandom(1024 * 1024 + 77)
SHA = hashlib.sha256(PAYLOAD).hexdigest()
REL = "nvidia/bench/artifact.bin"


class _Recorder:
    def __init__(self):
        self.sizes, self.data = [], bytearray()

    def write(self, b):
        self.sizes.append(len(b))
        self.data += b
        return len(b)


def test_blocks_are_written_whole_or_in_pieces_in_order():
    block = os.urandom(256 * 1024 + 5)
    out = _Recorder()
    vm_pages.write_in_pieces(out, block, 32 * 1024)
    assert bytes(out.data) == block
    assert max(out.sizes) == 32 * 1024 and out.sizes[-1] == len(block) % (32 * 1024)
    whole = _Recorder()
    vm_pages.write_in_pieces(whole, block, None)
    assert whole.sizes == [len(block)] and bytes(whole.data) == block
    assert vm_pages.piece_writer(None) is None               # the fetcher's own whole-block write
    pieces = _Recorder()
    vm_pages.piece_writer(100 * 1024)(pieces, block)
    assert pieces.sizes == [100 * 1024, 100 * 1024, 56 * 1024 + 5] and bytes(pieces.data) == block


def _sysfs(root: Path, order: str | None, devices: dict[str, tuple[str, str]]) -> Path:
    if order is not None:
        param = root / vm_pages.PAGE_REPORTING_ORDER
        param.parent.mkdir(parents=True)
        param.write_text(order + "\n")
    for name, (device_id, features) in devices.items():
        dev = root / "bus/virtio/devices" / name
        dev.mkdir(parents=True)
        (dev / "device").write_text(device_id + "\n")
        (dev / "features").write_text(features + "\n")
    return root


# the features line of this project's bench VM's balloon (bits 1, 2, 5, 7, 32) and of a disk
BALLOON_REPORTING = "0110010100000000000000000000000010000000000000000000000000000000"
BALLOON_NO_REPORTING = "0110000100000000000000000000000010000000000000000000000000000000"
BLK = "0000011000000000000000000000000010000000000000000000000000000000"


@pytest.mark.parametrize("order, devices, reported", [
    ("9", {"virtio0": ("0x0005", BALLOON_REPORTING), "virtio1": ("0x0002", BLK)}, True),
    ("11", {"virtio0": ("0x0005", BALLOON_REPORTING)}, False),      # reporting stopped (bench)
    ("9", {"virtio0": ("0x0005", BALLOON_NO_REPORTING)}, False),    # balloon without reporting
    ("9", {"virtio1": ("0x0002", BLK)}, False),                     # no balloon (bit 5 of a disk)
    (None, {"virtio0": ("0x0005", BALLOON_REPORTING)}, False),      # kernel without page reporting
])
def test_free_page_reporting_is_read_from_sysfs(tmp_path, order, devices, reported):
    root = _sysfs(tmp_path / "sys", order, devices)
    assert vm_pages.free_pages_reported(root) is reported
    assert vm_pages.write_size(root) == (vm_pages.WRITE_PIECE_REPORTING_VM if reported else None)
    assert vm_pages.page_reporting_order(root) == (int(order) if order else None)


@pytest.fixture
def mirror(tmp_path):
    m = Mirror(tmp_path / "mirror")
    m.add_file(REL, PAYLOAD)
    with m:
        yield m


def test_piece_writer_makes_the_fetcher_write_32_kib_pieces(mirror, tmp_path, monkeypatch):
    from tasks.fetch import Expected, download
    from tests.unit.test_fetch import _spy_part_writes

    sizes = _spy_part_writes(monkeypatch)
    dest = download(f"{mirror.url}/{REL}", tmp_path / "a", Expected(SHA, len(PAYLOAD)), progress=False,
                    write_block=vm_pages.piece_writer(vm_pages.WRITE_PIECE_REPORTING_VM))
    assert dest.read_bytes() == PAYLOAD
    assert sum(sizes) == len(PAYLOAD) and max(sizes) == vm_pages.WRITE_PIECE_REPORTING_VM


def test_download_bench_arms_are_wired(mirror, tmp_path, monkeypatch):
    """bench/download.py imports without root, its write arms are the forced 256 KiB and 32 KiB
    sizes, the arm the VM tuning picks follows the sysfs, and its timed child process fetches a
    verified file in each mode it is given (the product's default, a forced size, no sha256)."""
    from bench import download as bench_download

    assert bench_download.WRITE_ARMS == {256 << 10: "fetch, 256 KiB writes", 32 << 10: "fetch, 32 KiB writes"}
    monkeypatch.setattr(vm_pages, "SYS", _sysfs(tmp_path / "vm", "9", {"virtio0": ("0x0005", BALLOON_REPORTING)}))
    assert bench_download.tuned_arm() == "fetch, 32 KiB writes"
    monkeypatch.setattr(vm_pages, "SYS", _sysfs(tmp_path / "metal", None, {}))
    assert bench_download.tuned_arm() == "fetch, 256 KiB writes"

    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for mode, sha in [("default", SHA), (str(256 << 10), SHA), (str(32 << 10), SHA), ("no-sha256", "")]:
        dest = tmp_path / "out" / mode / "artifact.bin"
        run = subprocess.run([sys.executable, "-c", bench_download.FETCH_CHILD, f"{mirror.url}/{REL}", str(dest),
                              sha, str(len(PAYLOAD)), mode], capture_output=True, text=True, env=env, timeout=60)
        assert run.returncode == 0, run.stderr
        assert json.loads(run.stdout.strip().splitlines()[-1])["seconds"] > 0
        assert dest.read_bytes() == PAYLOAD
