"""The lab mirror (tests/lab/mirror.py): ranges, lengths, counters, faults, dumb-HTTP git."""

from __future__ import annotations

import http.client
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from tests.lab.mirror import Mirror  # noqa: E402

DATA = bytes(range(256)) * 40   # 10240 bytes


@pytest.fixture
def mirror(tmp_path):
    m = Mirror(tmp_path / "root").start()
    m.add_file("nvidia/cuda/x.run", DATA)
    yield m
    m.stop()


def get(m, path, headers=None, method="GET"):
    conn = http.client.HTTPConnection("127.0.0.1", m.port, timeout=5)
    conn.request(method, path, headers=headers or {})
    resp = conn.getresponse()
    try:
        body = resp.read()
    except http.client.IncompleteRead as exc:
        body = exc.partial
    conn.close()
    return resp, body


def test_whole_file_with_length_and_counter(mirror):
    resp, body = get(mirror, "/nvidia/cuda/x.run")
    assert resp.status == 200 and body == DATA
    assert resp.headers["Content-Length"] == str(len(DATA))
    assert resp.headers["Accept-Ranges"] == "bytes" and resp.headers["ETag"]
    assert mirror.bytes_served == len(DATA) and mirror.served("/nvidia/") == len(DATA)


@pytest.mark.parametrize("rng,start,end", [("bytes=100-199", 100, 199), ("bytes=10000-", 10000, 10239),
                                           ("bytes=-40", 10200, 10239), ("bytes=10200-99999", 10200, 10239)])
def test_ranges_answer_206(mirror, rng, start, end):
    resp, body = get(mirror, "/nvidia/cuda/x.run", {"Range": rng})
    assert resp.status == 206
    assert body == DATA[start:end + 1]
    assert resp.headers["Content-Range"] == f"bytes {start}-{end}/{len(DATA)}"
    assert resp.headers["Content-Length"] == str(end - start + 1)


def test_unsatisfiable_range_is_416(mirror):
    resp, _ = get(mirror, "/nvidia/cuda/x.run", {"Range": "bytes=20000-"})
    assert resp.status == 416 and resp.headers["Content-Range"] == f"bytes */{len(DATA)}"


def test_head_and_404(mirror):
    resp, body = get(mirror, "/nvidia/cuda/x.run", method="HEAD")
    assert resp.status == 200 and body == b"" and resp.headers["Content-Length"] == str(len(DATA))
    assert get(mirror, "/nvidia/nope")[0].status == 404
    assert get(mirror, "/../../etc/passwd")[0].status in (403, 404)


def test_fault_500_and_html_on_a_prefix_only(mirror):
    mirror.add_file("github/a.txt", b"ok")
    with mirror.faulty("500", prefix="/nvidia/"):
        assert get(mirror, "/nvidia/cuda/x.run")[0].status == 500
        assert get(mirror, "/github/a.txt")[1] == b"ok"
    mirror.set_fault("html")
    resp, body = get(mirror, "/github/a.txt")
    assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/html") and b"<html>" in body
    mirror.clear_fault()
    assert get(mirror, "/github/a.txt")[1] == b"ok"


def test_cut_then_resume_with_range(mirror):
    mirror.set_fault("cut:3000", times=1)
    resp, body = get(mirror, "/nvidia/cuda/x.run")
    assert resp.headers["Content-Length"] == str(len(DATA))   # the client was promised the whole file
    assert body == DATA[:3000]
    resp, rest = get(mirror, "/nvidia/cuda/x.run", {"Range": f"bytes={len(body)}-"})
    assert resp.status == 206 and body + rest == DATA
    assert mirror.fault is None                                 # times=1 used up


def test_slow_paces_the_body_to_its_rate(mirror):
    import time

    big = bytes(range(256)) * 12000                 # 3,072,000 bytes
    mirror.add_file("nvidia/cuda/big.run", big)
    start = time.monotonic()
    with mirror.faulty("slow:10000000"):            # 10 MB/s: ~0.31 s
        resp, body = get(mirror, "/nvidia/cuda/big.run")
    took = time.monotonic() - start
    assert body == big and resp.status == 200
    # never faster than the rate; and paced by the rate, not by a sleep per 64 KiB file chunk
    # (which made any rate above ~650 KB/s send at ~650 KB/s: 4.7 s here)
    assert 0.30 <= took < 2.5, took


def test_stall_sends_headers_then_nothing(mirror):
    mirror.stall_s = 30
    mirror.set_fault("stall")
    req = urllib.request.Request(f"{mirror.url}/nvidia/cuda/x.run")
    with pytest.raises((TimeoutError, OSError)):
        with urllib.request.urlopen(req, timeout=1) as resp:
            resp.read()
    mirror.clear_fault()


def test_unknown_fault_is_refused(mirror):
    with pytest.raises(ValueError):
        mirror.set_fault("explode")


def test_directory_listing_and_index(mirror):
    body = get(mirror, "/nvidia/cuda/")[1].decode()
    assert 'href="x.run"' in body
    mirror.add_file("pytorch/cu118/index.html", "<html>idx</html>")
    assert get(mirror, "/pytorch/cu118/")[1] == b"<html>idx</html>"
    assert get(mirror, "/pytorch/cu118")[0].status == 301


def test_route_for_api_stand_ins(mirror):
    mirror.add_route("/huggingface/api/", lambda h, path, q: (200, {"Content-Type": "application/json"}, b'{"ok":1}'))
    assert get(mirror, "/huggingface/api/models/x")[1] == b'{"ok":1}'


def test_git_clone_over_dumb_http(mirror, tmp_path):
    src = tmp_path / "src"
    subprocess.run(["git", "init", "-q", "-b", "main", str(src)], check=True)
    (src / "f").write_text("one\n")
    g = ["git", "-C", str(src), "-c", "user.name=t", "-c", "user.email=t@example.invalid"]
    subprocess.run([*g, "add", "f"], check=True)
    subprocess.run([*g, "commit", "-q", "-m", "1"], check=True)
    subprocess.run([*g, "tag", "v0.5.0"], check=True)
    url = mirror.publish_git("github/volcengine/verl.git", src)
    dest = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", "--branch", "v0.5.0", url, str(dest)], check=True)
    assert (dest / "f").read_text() == "one\n"


def test_mirror_urls_cover_the_lab_sources(mirror):
    urls = mirror.mirror_urls
    assert urls["nvidia"] == f"{mirror.url}/nvidia" and "pypi" not in urls
