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


def _spy_part_writes(monkeypatch) -> list[int]:
    """The sizes of every write to a ``.part`` file opened from now on."""
    import builtins

    sizes: list[int] = []
    real_open = builtins.open

    def spying_open(file, mode="r", *a, **kw):
        fh = real_open(file, mode, *a, **kw)
        if str(file).endswith(".part") and "b" in mode and ("a" in mode or "w" in mode):
            write = fh.write
            fh.write = lambda b: (sizes.append(len(b)), write(b))[1]  # type: ignore[method-assign]
        return fh

    monkeypatch.setattr(builtins, "open", spying_open)
    return sizes


def test_download_writes_each_received_block_whole(mirror, tmp_path, monkeypatch):
    from tasks.fetch import READ_CHUNK

    sizes = _spy_part_writes(monkeypatch)
    assert fetch(mirror, tmp_path / "blob").read_bytes() == PAYLOAD
    assert sum(sizes) == len(PAYLOAD)
    assert sizes[:-1] == [READ_CHUNK] * (len(sizes) - 1) and 0 < sizes[-1] <= READ_CHUNK


def test_write_block_gets_every_block_in_order_across_a_resume(mirror, tmp_path, monkeypatch):
    """The seam the download bench uses to choose a write size: every received block goes
    through it, the part file holds exactly what it wrote, and resume and sha256 still hold."""
    sizes = _spy_part_writes(monkeypatch)
    blocks: list[int] = []

    def halves(out, block):
        blocks.append(len(block))
        out.write(block[: len(block) // 2])
        out.write(block[len(block) // 2:])

    dest = tmp_path / "blob"
    with mirror.faulty("cut:1000000", prefix="/nvidia/", times=1):
        assert fetch(mirror, dest, write_block=halves).read_bytes() == PAYLOAD
    assert mirror.requests[1].status == 206                       # resumed, not refetched
    assert sum(sizes) == sum(blocks) == len(PAYLOAD) and len(sizes) == 2 * len(blocks)
    assert dest.with_name("blob.sha256").read_text().split() == [SHA, str(len(PAYLOAD))]
