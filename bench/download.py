"""Download: the controller fetch (tasks.fetch.download) from the lab mirror vs curl of the same file.

    python bench/download.py [--size-mib M] [--repeat K]

The mirror (tests/lab/mirror.py) runs in this process; each timed download runs in a process
of its own and reports its own time (no interpreter start-up in the figure):
  curl          : `curl -sS -o FILE URL` (time_total)
  curl+sha256   : the same, then sha256sum (what a verified download costs with curl)
  fetch         : tasks.fetch.download(url, dest, Expected(sha256, size)): transfer, size and
                  sha256 check, rename, stamp
  fetch, 1 MiB reads: the same with tasks.fetch.READ_CHUNK at 1 MiB (the alternative tried)
  fetch, size check only: the same with Expected(None, size) (the hash still runs while
                  downloading; the check after it is skipped)
K interleaved rounds, each starting one arm later (every arm runs after every other one:
whichever arm followed curl+sha256 was always ~1.6x slower, whatever its code), medians. Target: fetch >= 0.8x curl's throughput.
Then the resume drill: the mirror cuts the connection once after half the file
(mirror.faulty("cut:N", times=1)); the fetch retries with a Range request, and the bench
checks the file is complete and verified and how many bytes the mirror sent in all.
Writes bench/results/download.json. No boxes needed (root not required for this one).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.harness import REPO, interleave, log, render_table, summary, write_result  # noqa: E402
from tasks.fetch import Expected, download  # noqa: E402
from tests.lab.mirror import Mirror  # noqa: E402

TARGET = 0.8
REL = "nvidia/bench/artifact.bin"

FETCH_CHILD = """
import json, sys, time
from pathlib import Path
import tasks.fetch
from tasks.fetch import Expected, download
url, dest, sha, size = sys.argv[1], Path(sys.argv[2]), sys.argv[3] or None, int(sys.argv[4])
if sys.argv[5] != "default":       # another block size, to compare with READ_CHUNK
    tasks.fetch.READ_CHUNK = int(sys.argv[5])
t = time.monotonic()
download(url, dest, Expected(sha, size), progress=False)
print(json.dumps({"seconds": time.monotonic() - t}))
"""


def make_file(path: Path, size: int) -> str:
    """Incompressible content of ``size`` bytes; returns its sha256."""
    path.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    block = os.urandom(1 << 20)
    with open(path, "wb") as fh:
        left = size
        i = 0
        while left > 0:
            chunk = (block[i % 251:] + block[:i % 251])[: min(left, len(block))]
            fh.write(chunk)
            digest.update(chunk)
            left -= len(chunk)
            i += 1
    return digest.hexdigest()


def clean(dest: Path) -> None:
    """Remove the last arm's output, then flush the page cache's dirty pages (untimed): the kernel
    writing back the previous arm's 1 GiB would otherwise slow whichever arm runs next."""
    for p in (dest, dest.with_name(dest.name + ".sha256"), dest.with_name(dest.name + ".part"),
              dest.with_name(dest.name + ".lock")):
        p.unlink(missing_ok=True)
    os.sync()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mib", type=int, default=1024)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--boxes", type=int, default=0, help="unused (no boxes needed); accepted for symmetry")
    args = ap.parse_args(argv)
    size = args.size_mib << 20
    work = Path(tempfile.mkdtemp(prefix="verl-lab-bench-download-", dir="/var/tmp"))
    mirror = Mirror(work / "mirror").start()
    try:
        log(f"writing a {args.size_mib} MiB file")
        sha = make_file(mirror.path(REL), size)
        url = f"{mirror.url}/{REL}"
        dest = work / "out" / "artifact.bin"
        dest.parent.mkdir()
        env = {**os.environ, "PYTHONPATH": str(REPO)}

        def curl():
            clean(dest)
            out = subprocess.run(["curl", "-sS", "-o", str(dest), "-w", "%{time_total}", url],
                                 check=True, capture_output=True, text=True).stdout
            assert dest.stat().st_size == size
            return {"seconds": float(out)}

        def curl_sha():
            got = curl()
            t = time.monotonic()
            assert subprocess.run(["sha256sum", str(dest)], check=True, capture_output=True,
                                  text=True).stdout.split()[0] == sha
            return {"seconds": got["seconds"] + time.monotonic() - t}

        def fetch(want_sha, chunk="default"):
            def arm():
                clean(dest)
                out = subprocess.run([sys.executable, "-c", FETCH_CHILD, url, str(dest), want_sha, str(size), chunk],
                                     check=True, capture_output=True, text=True, env=env).stdout
                assert dest.stat().st_size == size
                return json.loads(out.strip().splitlines()[-1])
            return arm

        times = interleave({"curl": curl, "curl+sha256": curl_sha, "fetch": fetch(sha),
                            "fetch, 1 MiB reads": fetch(sha, str(1 << 20)),
                            "fetch, size check only": fetch("")}, args.repeat, rotate=True)
        med = {k: summary(v) for k, v in times.items()}
        mib_s = {k: args.size_mib / v["median"] for k, v in med.items()}
        vs_curl = mib_s["fetch"] / mib_s["curl"]
        vs_curl_sha = mib_s["fetch"] / mib_s["curl+sha256"]

        # resume after a cut connection, in this process (the mirror's fault is ours to set)
        clean(dest)
        mirror.reset_counters()
        cut_at = size // 2
        t = time.monotonic()
        with mirror.faulty(f"cut:{cut_at}", prefix="/" + REL, times=1):
            download(url, dest, Expected(sha, size), progress=False, sleep=lambda s: None)
        resume_s = time.monotonic() - t
        reqs = [(r.status, r.range, r.sent, r.fault) for r in mirror.requests if r.path == "/" + REL]
        served = mirror.served("/" + REL)
        stamp = dest.with_name(dest.name + ".sha256").read_text().strip()
        resumed_ok = (dest.stat().st_size == size and stamp.startswith(sha) and len(reqs) == 2
                      and reqs[0][3] == f"cut:{cut_at}" and reqs[1][0] == 206 and reqs[1][1] == f"bytes={cut_at}-")
    finally:
        mirror.stop()
        subprocess.run(["rm", "-rf", str(work)], check=False)

    print(f"\nDownload of {args.size_mib} MiB from the lab mirror (127.0.0.1), {args.repeat} interleaved rounds")
    rows = [[k, med[k]["median"], med[k]["min"], med[k]["max"], mib_s[k], mib_s[k] / mib_s["curl"]] for k in med]
    print(render_table(["client", "median s", "min", "max", "MiB/s", "x curl"], rows))
    print(f"target: fetch >= {TARGET}x curl -> {'MET' if vs_curl >= TARGET else 'MISSED'} ({vs_curl:.2f}x; "
          f"{vs_curl_sha:.2f}x curl+sha256sum)")
    print(f"\nResume: connection cut once at {cut_at} bytes -> requests {reqs}")
    print(f"mirror sent {served} bytes for a {size}-byte file ({served / size:.3f}x); verified: {resumed_ok}; "
          f"{resume_s:.2f}s")
    path = write_result("download", {
        "size_bytes": size, "repeat": args.repeat, "samples": times, "summary": med, "mib_per_s": mib_s,
        "fetch_vs_curl": vs_curl, "fetch_vs_curl_sha256": vs_curl_sha, "target": TARGET, "met": vs_curl >= TARGET,
        "resume": {"cut_at": cut_at, "requests": reqs, "bytes_served": served, "seconds": resume_s,
                   "verified": resumed_ok}})
    print(f"\nwrote {path}")
    return 0 if resumed_ok else 1


if __name__ == "__main__":
    sys.exit(main())
