"""Where a test run's CPU goes: per work unit (tests/conftest.py), by program (issue 45, docs/testing.md "CPU time").

The fresh-clone CI is CPU-bound (2 cores, 4 workers: both cores ~95% busy the whole run), so its time is its CPU
seconds over two; this says which units and which programs spend them. Two sources, both recorded while the run
runs (needs root):

* BSD process accounting (the kernel writes a record for every process that ends, from every PID namespace: the
  boxes' processes too): its CPU seconds, PID, parent PID, start and end, and command name (the name of its last
  thread: a Python process that loaded pyarrow ends as ``jemalloc_bg_thd``, one that ran gloo as
  ``pt_gloo_runloop``; a ``python`` is labelled with its parent's name, ``W`` for a pytest worker);
* ``bench/ci_timeline.py``, a pytest plugin: when each test started and ended on which worker.

A process counts to the test running on its worker when it ended, found through its parents (a process left
behind by a closed lab, such as its folder's deletion, counts to the next test on that worker: the report says
so by naming the program). Usage:

    python3 bench/ci_cpu.py acct-on /tmp/acct.log           # as root, before the run
    PYTHONPATH=bench PYTEST_ADDOPTS="-p ci_timeline" CI_TIMELINE=/tmp/timeline bash .ci/run
    python3 bench/ci_cpu.py acct-off
    python3 bench/ci_cpu.py report /tmp/acct.log /tmp/timeline [--units 25] [--programs 12]

One unit alone (pytest without -n, the same plugin): ``python3 bench/ci_cpu.py tree /tmp/acct.log /tmp/timeline``
sums the pytest process and every process descending from it, by lab box: other work on the machine left out.

Not a timed test: it prints numbers; docs/testing.md keeps the ones measured.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import ctypes
import os
import stat
import struct
import sys
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# struct acct_v3 (linux/acct.h): flag, version, tty, exitcode, uid, gid, pid, ppid, btime, etime (float, ticks),
# utime, stime, mem, io, rw, minflt, majflt, swaps (comp_t), comm[16]
ACCT_V3 = struct.Struct("<BBHIIIIIIf8H16s")
TICKS = 100          # AHZ: comp_t times and etime are in 1/100 s
PYTHONS = {"python", "python3", "python3.11", "python3.12", "python3.10"}


def comp_t(v: int) -> int:
    """comp_t: 13-bit mantissa, 3-bit base-8 exponent."""
    return (v & 0x1FFF) << (3 * (v >> 13))


def own_file(path: str) -> None:
    """Create ``path`` (or take it) as this user's own regular file, never through a link: root writes there, and
    a file or link another user placed (in /tmp, say) must not become the place it writes to."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_APPEND, 0o600)
    except OSError as exc:
        sys.exit(f"{path}: {exc.strerror} (a link is not followed); give a new path")
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            sys.exit(f"{path}: not a regular file of this user; give a new path")
    finally:
        os.close(fd)


def acct(path: str | None) -> None:
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    if path:
        own_file(path)
    if libc.acct(path.encode() if path else None) != 0:
        err = ctypes.get_errno()
        sys.exit(f"acct({path!r}) failed: {os.strerror(err)} (needs root and CONFIG_BSD_PROCESS_ACCT)")


def records(path: Path) -> list[tuple[int, int, float, float, float, str]]:
    """(pid, ppid, start, end, cpu seconds, command) of every v3 record."""
    data = path.read_bytes()
    out = []
    for off in range(0, len(data) - ACCT_V3.size + 1, ACCT_V3.size):
        f = ACCT_V3.unpack_from(data, off)
        if f[1] != 3:
            continue
        start = float(f[8])
        out.append((f[6], f[7], start, start + f[9] / TICKS, (comp_t(f[10]) + comp_t(f[11])) / TICKS,
                    f[-1].split(b"\0")[0].decode(errors="replace")))
    return out


def parents(recs: list) -> Callable:
    """``parent(record)``: the record of the process that started it (alive then), or None."""
    by_pid = collections.defaultdict(list)
    for r in recs:
        by_pid[r[0]].append(r)

    def parent(r):
        for p in by_pid.get(r[1], ()):
            if p[2] <= r[2] + 1 and p[3] >= r[2] - 1:        # alive when r started (1 s of acct's rounding)
                return p
        return None
    return parent


def timeline(folder: Path) -> tuple[dict[int, str], dict[str, list[tuple[float, float, str]]]]:
    """({worker pid: name}, {worker name: [(start, end, nodeid)] sorted})."""
    pids: dict[int, str] = {}
    tests: dict[str, list[tuple[float, float, str]]] = {}
    for f in sorted(folder.glob("*.tsv")):
        started: dict[str, float] = {}
        rows = []
        for line in f.read_text().splitlines():
            kind, when, rest = line.split("\t", 2)
            if kind == "P":
                pids[int(rest)] = f.stem
            elif kind == "S":
                started[rest] = float(when)
            elif rest in started:
                rows.append((started.pop(rest), float(when), rest))
        tests[f.stem] = sorted(rows)
    return pids, tests


def report(acct_log: Path, folder: Path, n_units: int, n_programs: int) -> None:
    sys.path.insert(0, str(REPO))
    from tests.conftest import work_unit

    recs = records(acct_log)
    workers, tests = timeline(folder)
    parent = parents(recs)

    def owner(r):
        names, x = [], r
        for _ in range(80):
            if x is None:
                return None, names
            if x[1] in workers:
                return workers[x[1]], names
            names.append(x[5])
            x = parent(x)
        return None, names

    starts = {w: [t[0] for t in rows] for w, rows in tests.items()}

    def unit_at(worker: str, when: float) -> str:
        i = bisect.bisect_right(starts[worker], when) - 1
        return work_unit(tests[worker][i][2]) if i >= 0 else "(before the first test)"

    per_unit: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    count: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for r in recs:
        worker, names = owner(r)
        unit = unit_at(worker, r[3]) if worker else "(no worker: the controller, daemons, this machine)"
        program = r[5] if r[5] not in PYTHONS else f"{r[5]}<{names[1] if len(names) > 1 else 'W'}"
        per_unit[unit][program] += r[4]
        count[unit][program] += 1
    total = sum(sum(c.values()) for c in per_unit.values())
    first = min((rows[0][0] for rows in tests.values() if rows), default=0)
    last = max((rows[-1][1] for rows in tests.values() if rows), default=0)
    print(f"{total:.0f} CPU-s in {len(recs)} processes; tests ran {last - first:.0f} s "
          f"({total / max(last - first, 1):.2f} cores busy on average)")
    print(f"{'CPU-s':>7} {'share':>6}  unit: its programs (CPU-s, processes)")
    for unit, progs in sorted(per_unit.items(), key=lambda kv: -sum(kv[1].values()))[:n_units]:
        s = sum(progs.values())
        top = ", ".join(f"{p} {c:.0f} ({count[unit][p]})" for p, c in progs.most_common(n_programs) if c >= 0.5)
        print(f"{s:7.0f} {100 * s / total:5.1f}%  {unit}: {top}")
    every: collections.Counter = collections.Counter()
    n: collections.Counter = collections.Counter()
    for unit, progs in per_unit.items():
        every.update(progs)
        n.update(count[unit])
    print("\nevery unit, by program: " + ", ".join(f"{p} {c:.0f} ({n[p]})" for p, c in every.most_common(20)))


def tree(acct_log: Path, folder: Path) -> None:
    """The CPU of one pytest run without xdist (its timeline's ``main`` worker) and of every process descending from
    it, by lab box (a box's processes descend from its systemd-nspawn, which the harness starts): what a unit costs
    alone, other work on the machine left out."""
    recs = records(acct_log)
    root = next(iter(timeline(folder)[0]))
    parent = parents(recs)
    cpu: collections.Counter = collections.Counter()
    progs: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for r in recs:
        x, line = r, []
        while x is not None and x[0] != root and len(line) < 80:
            line.append(x)
            x = parent(x)
        if x is None or x[0] != root:
            continue
        box = next((f"the box of systemd-nspawn {y[0]}" for y in line if y[5] == "systemd-nspawn"), None)
        where = box or "pytest and its other descendants (the controller)"
        cpu[where] += r[4]
        progs[where][r[5]] += r[4]
    for where, s in cpu.most_common():
        if s >= 0.5:
            print(f"{s:7.1f}  {where}: " + ", ".join(f"{p} {c:.0f}" for p, c in progs[where].most_common(6)))
    print(f"{sum(cpu.values()):7.1f}  in all (pytest {root} and every process descending from it)")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    on = sub.add_parser("acct-on")
    on.add_argument("log")
    sub.add_parser("acct-off")
    rep = sub.add_parser("report")
    rep.add_argument("log", type=Path)
    rep.add_argument("timeline", type=Path)
    rep.add_argument("--units", type=int, default=25)
    rep.add_argument("--programs", type=int, default=10)
    one = sub.add_parser("tree", help="one pytest run without -n: its CPU and its descendants', by lab box")
    one.add_argument("log", type=Path)
    one.add_argument("timeline", type=Path)
    a = ap.parse_args(argv)
    if a.cmd == "acct-on":
        acct(a.log)
    elif a.cmd == "acct-off":
        acct(None)
    elif a.cmd == "tree":
        tree(a.log, a.timeline)
    else:
        report(a.log, a.timeline, a.units, a.programs)


if __name__ == "__main__":
    main()
