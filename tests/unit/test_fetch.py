"""The fetcher against the lab's real HTTP mirror: verify, resume, refuse bad answers."""

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tasks.fetch import ChecksumMismatch, Expected, FetchError, box_fetch_script, download
from tests.lab.mirror import Mirror

PAYLOAD = os.urandom(3 * 1024 * 1024 + 123)
SHA = hashlib.sha256(PAYLOAD).hexdigest()
REL = "nvidia/cudnn/blob.tar.xz"


@pytest.fixture
def mirror(tmp_path):
    m = Mirror(tmp_path / "mirror")
    m.add_file(REL, PAYLOAD)
    with m:
        yield m


def fetch(mirror, dest, **kw):
    kw.setdefault("sleep", lambda s: None)
    return download(f"{mirror.url}/{REL}", dest, Expected(kw.pop("sha", SHA), kw.pop("size", len(PAYLOAD))),
                    progress=False, **kw)


def test_download_verifies_and_second_call_fetches_nothing(mirror, tmp_path):
    dest = tmp_path / "cache" / "blob.tar.xz"
    assert fetch(mirror, dest).read_bytes() == PAYLOAD
    served = mirror.bytes_served
    assert served == len(PAYLOAD)
    fetch(mirror, dest)
    assert mirror.bytes_served == served  # verified copy reused, no network


def test_cut_connection_resumes_without_refetching(mirror, tmp_path):
    dest = tmp_path / "blob"
    with mirror.faulty("cut:1000000", prefix="/nvidia/", times=1):
        fetch(mirror, dest)
    assert dest.read_bytes() == PAYLOAD
    # the retry asked only for the rest
    first, second = mirror.requests
    assert first.fault == "cut:1000000" and second.status == 206 and second.range.startswith("bytes=")
    resumed_at = int(second.range.split("=")[1].rstrip("-"))
    assert 0 < resumed_at <= 1_000_000
    assert mirror.bytes_served == len(PAYLOAD) + (1_000_000 - resumed_at)


def test_partial_file_from_an_earlier_run_is_resumed(mirror, tmp_path):
    dest = tmp_path / "blob"
    (tmp_path / "blob.part").write_bytes(PAYLOAD[:2_000_000])
    fetch(mirror, dest)
    assert dest.read_bytes() == PAYLOAD
    assert mirror.bytes_served == len(PAYLOAD) - 2_000_000


def test_checksum_mismatch_deletes_and_names_both_sums(mirror, tmp_path):
    dest = tmp_path / "blob"
    with pytest.raises(ChecksumMismatch) as err:
        fetch(mirror, dest, sha="0" * 64)
    assert "expected " + "0" * 64 in str(err.value) and SHA in str(err.value)
    assert not dest.exists() and not (tmp_path / "blob.part").exists()


def test_size_mismatch_is_refused(mirror, tmp_path):
    with pytest.raises(FetchError, match="size mismatch"):
        fetch(mirror, tmp_path / "blob", size=len(PAYLOAD) - 1)


def test_html_answer_is_refused_and_nothing_kept(mirror, tmp_path):
    dest = tmp_path / "blob"
    with mirror.faulty("html"):
        with pytest.raises(FetchError, match="HTML page"):
            fetch(mirror, dest)
    assert not dest.exists()


def test_server_errors_retry_a_bounded_number_of_times(mirror, tmp_path):
    with mirror.faulty("500"):
        with pytest.raises(FetchError, match=r"failed after 3 tries.*HTTP 500"):
            fetch(mirror, tmp_path / "blob")
    with mirror.faulty("500", times=1):
        fetch(mirror, tmp_path / "blob")  # one bad answer, then the retry succeeds


def test_stalled_mirror_times_out_with_the_url(mirror, tmp_path):
    mirror.stall_s = 5
    with mirror.faulty("stall"):
        with pytest.raises(FetchError, match=f"{mirror.url}/{REL}"):
            fetch(mirror, tmp_path / "blob", timeout=(2, 1))


def test_not_found_is_a_clear_error(mirror, tmp_path):
    with pytest.raises(FetchError, match="HTTP 404.*mirror_urls"):
        download(f"{mirror.url}/nvidia/none", tmp_path / "x", Expected(SHA, None), progress=False)


def run_box_script(script):
    return subprocess.run(["sh", "-c", script], capture_output=True, text=True)


def test_direct_mode_script_verifies_before_naming_the_file(mirror, tmp_path):
    dest = str(tmp_path / "box" / "blob")
    ok = run_box_script(box_fetch_script(f"{mirror.url}/{REL}", dest, SHA, len(PAYLOAD)))
    assert ok.returncode == 0, ok.stderr
    assert open(dest, "rb").read() == PAYLOAD
    assert open(dest + ".sha256").read().split() == [SHA, str(len(PAYLOAD))]
    bad = run_box_script(box_fetch_script(f"{mirror.url}/{REL}", str(tmp_path / "box" / "other"), "1" * 64, None))
    assert bad.returncode != 0 and "sha256 mismatch" in bad.stderr and SHA in bad.stderr
    assert not os.path.exists(tmp_path / "box" / "other")


GREENLETS = r"""
from gevent import monkey; monkey.patch_all()
import sys, gevent
from pathlib import Path
from tasks.fetch import Expected, download
url, dest, sha, size = sys.argv[1], Path(sys.argv[2]), sys.argv[3], int(sys.argv[4])
jobs = [gevent.spawn(download, url, dest, Expected(sha, size), progress=False) for _ in range(3)]
gevent.joinall(jobs, timeout=30, raise_error=True)
print("done" if all(j.successful() for j in jobs) else "stuck")
"""


def test_concurrent_hosts_in_one_pyinfra_process_share_one_download(mirror, tmp_path):
    """pyinfra prepares hosts as gevent greenlets: they must queue, not deadlock on flock."""
    run = subprocess.run(
        [sys.executable, "-c", GREENLETS, f"{mirror.url}/{REL}", str(tmp_path / "blob"), SHA, str(len(PAYLOAD))],
        capture_output=True, text=True, timeout=45, cwd=Path(__file__).resolve().parents[2],
    )
    assert run.stdout.strip() == "done", run.stderr
    assert mirror.bytes_served == len(PAYLOAD)  # fetched once for all three


def test_direct_mode_script_names_an_html_answer(mirror, tmp_path):
    dest = str(tmp_path / "box" / "blob")
    with mirror.faulty("html"):
        bad = run_box_script(box_fetch_script(f"{mirror.url}/{REL}", dest, SHA, len(PAYLOAD)))
    assert bad.returncode != 0 and "answered an HTML page" in bad.stderr, bad.stderr
    assert not os.path.exists(dest) and not os.path.exists(dest + ".part")


class _Recorder:
    def __init__(self):
        self.sizes, self.data = [], bytearray()

    def write(self, b):
        self.sizes.append(len(b))
        self.data += b
        return len(b)


def test_blocks_are_written_whole_or_in_pieces_in_order():
    import tasks.fetch as fetch_mod

    block = os.urandom(fetch_mod.READ_CHUNK + 5)
    out = _Recorder()
    fetch_mod.write_in_pieces(out, block, 32 * 1024)
    assert bytes(out.data) == block
    assert max(out.sizes) == 32 * 1024 and out.sizes[-1] == len(block) % (32 * 1024)
    whole = _Recorder()
    fetch_mod.write_in_pieces(whole, block, None)
    assert whole.sizes == [len(block)] and bytes(whole.data) == block


def _sysfs(root: Path, order: str | None, devices: dict[str, tuple[str, str]]) -> Path:
    if order is not None:
        from tasks.fetch import PAGE_REPORTING_ORDER
        param = root / PAGE_REPORTING_ORDER
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
    from tasks.fetch import free_pages_reported

    assert free_pages_reported(_sysfs(tmp_path / "sys", order, devices)) is reported


def test_download_writes_pieces_only_where_free_pages_are_reported(mirror, tmp_path, monkeypatch):
    import builtins

    import tasks.fetch as fetch_mod

    sizes = []
    real_open = builtins.open

    def spying_open(file, mode="r", *a, **kw):
        fh = real_open(file, mode, *a, **kw)
        if str(file).endswith(".part") and "b" in mode and ("a" in mode or "w" in mode):
            write = fh.write
            fh.write = lambda b: (sizes.append(len(b)), write(b))[1]  # type: ignore[method-assign]
        return fh

    monkeypatch.setattr(builtins, "open", spying_open)
    monkeypatch.setattr(fetch_mod, "SYS", _sysfs(tmp_path / "vm", "9", {"virtio0": ("0x0005", BALLOON_REPORTING)}))
    assert fetch(mirror, tmp_path / "a").read_bytes() == PAYLOAD
    assert sum(sizes) == len(PAYLOAD) and max(sizes) == fetch_mod.WRITE_CHUNK_REPORTING_VM
    sizes.clear()
    monkeypatch.setattr(fetch_mod, "SYS", _sysfs(tmp_path / "metal", None, {}))
    assert fetch(mirror, tmp_path / "b").read_bytes() == PAYLOAD
    assert sum(sizes) == len(PAYLOAD) and max(sizes) > fetch_mod.WRITE_CHUNK_REPORTING_VM   # whole blocks
