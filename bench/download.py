"""Download: the controller fetch (tasks.fetch.download) from the lab mirror vs curl of the same file.

    python bench/download.py [--size-mib M] [--repeat K] [--page-reporting as-found|both]

The mirror (tests/lab/mirror.py) runs in this process; each timed download runs in a process
of its own and reports its own time (no interpreter start-up in the figure):
  curl          : `curl -sS -o FILE URL` (time_total)
  curl+sha256   : the same, then sha256sum (what a verified download costs with curl)
  fetch         : tasks.fetch.download(url, dest, Expected(sha256, size)): transfer, size and
                  sha256 check, rename, stamp
                  (the product writes each received 256 KiB block whole)
  fetch, 256 KiB / 32 KiB writes: the same with the write size forced through download's
                  write_block (bench.vm_pages.piece_writer): whole blocks, or 32 KiB pieces,
                  the bench VM's tuning where it reports free pages to its host
                  (bench.vm_pages.write_size; each run records which arm that picks)
  fetch, no sha256: the same transfer with the sha256 replaced by a digest that does nothing
                  and Expected(None, size) (measurement only: what the hash costs)
K interleaved rounds, each starting one arm later (every arm runs after every other one:
whichever arm followed curl+sha256 was always ~1.6x slower, whatever its code), medians.
Target: fetch >= 0.8x curl's throughput.
Then the resume drill: the mirror cuts the connection once after half the file
(mirror.faulty("cut:N", times=1)); the fetch retries with a Range request, and the bench
checks the file is complete and verified and how many bytes the mirror sent in all.
--page-reporting both (root): the same rounds again with the VM's free page reporting turned off
(bench.harness.free_page_reporting_off; the order found is put back), after touching all free memory and one
untimed warm-up round: memory the host took back faults in again when the page cache next uses it, which made
this bench's page-cache writes slow and noisy on the VM it was written on.
Then (--link-mbit, default 1000) curl and the fetch again through the mirror paced to a link
of that speed (its "slow" fault), the case of a lab mirror on a real network.
Writes bench/results/download.json. No boxes needed (root only for --page-reporting both).
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

from bench.harness import (  # noqa: E402
    REPO,
    free_page_reporting,
    free_page_reporting_off,
    interleave,
    log,
    render_table,
    summary,
    touch_free_memory,
    write_result,
)
from bench.vm_pages import free_pages_reported, write_size  # noqa: E402
from tasks.fetch import Expected, download  # noqa: E402
from tests.lab.mirror import Mirror  # noqa: E402

TARGET = 0.8
REL = "nvidia/bench/artifact.bin"
WRITE_ARMS = {256 << 10: "fetch, 256 KiB writes", 32 << 10: "fetch, 32 KiB writes"}   # bytes per write -> arm

FETCH_CHILD = """
import json, sys, time
from pathlib import Path
import tasks.fetch
from bench.vm_pages import piece_writer
from tasks.fetch import Expected, download
url, dest, sha, size = sys.argv[1], Path(sys.argv[2]), sys.argv[3] or None, int(sys.argv[4])
write_block = None                # the product's write: each block whole
if sys.argv[5] == "no-sha256":    # measurement only: the same transfer with a digest that does nothing
    class _NoDigest:
        def update(self, _block): pass
        def hexdigest(self): return ""
    class _NoHashlib:
        sha256 = _NoDigest
    tasks.fetch.hashlib = _NoHashlib
elif sys.argv[5] != "default":     # a forced write size, in bytes
    write_block = piece_writer(int(sys.argv[5]))
t = time.monotonic()
download(url, dest, Expected(sha, size), progress=False, write_block=write_block)
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


def tuned_arm() -> str:
    """The write arm the bench VM's tuning picks here and now (bench.vm_pages.write_size: 32 KiB
    pieces where free pages are reported, whole 256 KiB blocks elsewhere)."""
    return WRITE_ARMS[write_size() or 256 << 10]


def measure(arms, repeat: int, size_mib: int) -> dict:
    """``repeat`` rotated rounds of every arm; medians, MiB/s and the fetch's ratios to curl."""
    times = interleave(arms, repeat, rotate=True)
    med = {k: summary(v) for k, v in times.items()}
    mib_s = {k: size_mib / v["median"] for k, v in med.items()}
    vs_curl = mib_s["fetch"] / mib_s["curl"]
    return {"free_page_reporting_order": free_page_reporting(), "free_pages_reported": free_pages_reported(),
            "vm_tuned_arm": tuned_arm(), "rounds": repeat, "samples": times, "summary": med,
            "mib_per_s": mib_s, "fetch_vs_curl": vs_curl,
            "fetch_vs_curl_sha256": mib_s["fetch"] / mib_s["curl+sha256"] if "curl+sha256" in mib_s else None,
            "met": vs_curl >= TARGET}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mib", type=int, default=1024)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--page-reporting", choices=("as-found", "both"), default="as-found",
                    help="both: measure again with this VM's free page reporting turned off (root; put back after)")
    ap.add_argument("--link-mbit", type=int, default=1000,
                    help="then curl and fetch through a mirror paced to this link speed (0: skip)")
    ap.add_argument("--link-repeat", type=int, default=3)
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

        arms = {"curl": curl, "curl+sha256": curl_sha, "fetch": fetch(sha),
                **{name: fetch(sha, str(piece)) for piece, name in WRITE_ARMS.items()},
                "fetch, no sha256 (measurement only)": fetch("", "no-sha256")}
        runs = {"as found": measure(arms, args.repeat, args.size_mib)}
        if args.page_reporting == "both":
            with free_page_reporting_off() as found:
                if found is None:
                    log("this kernel does not report free pages: nothing to turn off")
                else:
                    log(f"free page reporting off (order {found} -> above the largest buddy order); touching free memory (untimed)")
                    log(f"touched {touch_free_memory()} MiB; one untimed warm-up round")
                    for arm in arms.values():
                        arm()
                    runs["free page reporting off"] = measure(arms, args.repeat, args.size_mib)
        if args.link_mbit:
            # a mirror link of that speed: the mirror's "slow" fault paces every body to the rate
            # (both clients get the same link)
            rate = args.link_mbit * 1_000_000 // 8
            def paced(arm):
                def run():
                    with mirror.faulty(f"slow:{rate}", prefix="/" + REL):
                        return arm()
                return run
            runs[f"paced to {args.link_mbit} Mbit/s"] = measure(
                {"curl": paced(curl), "fetch": paced(fetch(sha))}, args.link_repeat, args.size_mib)

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

    for name, run in runs.items():
        med, mib_s = run["summary"], run["mib_per_s"]
        print(f"\nDownload of {args.size_mib} MiB from the lab mirror (127.0.0.1), {run['rounds']} interleaved "
              f"rounds, {name} (free page reporting order: {run['free_page_reporting_order']}; "
              f"the bench VM's tuning would write as {run['vm_tuned_arm']!r})")
        rows = [[k, med[k]["median"], med[k]["min"], med[k]["max"], mib_s[k], mib_s[k] / mib_s["curl"]] for k in med]
        print(render_table(["client", "median s", "min", "max", "MiB/s", "x curl"], rows))
        vs_sha = run["fetch_vs_curl_sha256"]
        print(f"target: fetch >= {TARGET}x curl -> {'MET' if run['met'] else 'MISSED'} "
              f"({run['fetch_vs_curl']:.2f}x" + (f"; {vs_sha:.2f}x curl+sha256sum)" if vs_sha else ")"))
    print(f"\nResume: connection cut once at {cut_at} bytes -> requests {reqs}")
    print(f"mirror sent {served} bytes for a {size}-byte file ({served / size:.3f}x); verified: {resumed_ok}; "
          f"{resume_s:.2f}s")
    path = write_result("download", {
        "size_bytes": size, "repeat": args.repeat, "target": TARGET, "runs": runs,
        "resume": {"cut_at": cut_at, "requests": reqs, "bytes_served": served, "seconds": resume_s,
                   "verified": resumed_ok}})
    print(f"\nwrote {path}")
    return 0 if resumed_ok else 1


if __name__ == "__main__":
    sys.exit(main())
