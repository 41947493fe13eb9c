"""The CPU a unit module's run costs, this checkout against another revision's, in one run (issue 45).

    python bench/unit_cpu.py [--base REV] [--repeat 1] tests/unit/test_x.py [...]

For each module, ``--repeat`` interleaved rounds (the arms' order rotating) of ``pytest -q MODULE`` (no -n) run by this checkout's venv
(.venv/bin/python) in this checkout (``after``) and in a detached worktree of ``--base`` (``before``, removed at the
end). A run's CPU is its user + system time with every subprocess it reaped (``os.wait4``'s rusage of pytest: the
verl runs, exports and ranks the tests start); the wall beside it ranks the two only roughly on a shared machine.
Prints the medians and the ratios against ``before``; writes bench/results/unit_cpu.json. No root needed but where
a module needs it (test_gather_once.py, test_verl_patches.py's retention). docs/testing.md "Heavy processes".
A module whose programs the zygote serves (tests/fixtures/zygote.py: the unit tests' ``served`` fixture, the e2e
labs' pyinfra runs) needs ``--machine``: those programs are the server's grandchildren, reaped by the kernel, not in
pytest's rusage; so do the e2e modules, whose boxes' processes are not pytest's children either. ``--machine``
counts the whole machine's CPU (/proc/stat: user, nice, system, irq, softirq) over each run instead: keep the
machine otherwise idle. docs/testing.md, "Heavy processes".
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.harness import REPO, interleave, log, ratio, render_table, summary, write_result  # noqa: E402


def machine_cpu_s() -> float:
    """CPU seconds the whole machine has spent busy since it started (/proc/stat's first line)."""
    with open("/proc/stat") as fh:
        fields = [int(x) for x in fh.readline().split()[1:8]]
    user, nice, system, _idle, _iowait, irq, softirq = fields
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def one_run(checkout: Path, module: str, machine: bool = False) -> dict:
    """One ``pytest -q MODULE`` in ``checkout``: its CPU seconds (its reaped children's included, or the machine's)
    and wall."""
    start, busy = time.monotonic(), machine_cpu_s()
    proc = subprocess.Popen([str(REPO / ".venv" / "bin" / "python"), "-m", "pytest", "-q", "-p", "no:cacheprovider",
                             module], cwd=checkout, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.monotonic() - start
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{module} failed in {checkout}: run it there to see why")
    return {"cpu_s": machine_cpu_s() - busy if machine else usage.ru_utime + usage.ru_stime, "wall_s": wall}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("modules", nargs="+")
    ap.add_argument("--base", default="main")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--machine", action="store_true", help="count the whole machine's CPU (served programs, boxes)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="unit-cpu-") as tmp:
        base = Path(tmp) / "base"
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(base), args.base], check=True,
                       capture_output=True)
        try:
            arms = {"before": base, "after": REPO}
            rows, result = [], {"base": args.base, "machine": args.machine, "modules": {}}
            for module in args.modules:
                walls: dict[str, list[float]] = {arm: [] for arm in arms}

                def arm_run(arm: str, module: str = module, walls: dict = walls) -> dict:
                    log(f"{module}: {arm}")
                    got = one_run(arms[arm], module, machine=args.machine)
                    walls[arm].append(got["wall_s"])
                    return {"seconds": got["cpu_s"]}          # what interleave records: the CPU

                cpus = interleave({arm: (lambda arm=arm: arm_run(arm)) for arm in arms}, args.repeat, rotate=True)
                cpu = {arm: summary(samples) for arm, samples in cpus.items()}
                wall = {arm: summary(samples) for arm, samples in walls.items()}
                result["modules"][module] = {"cpu_s": cpus, "wall_s": walls, "cpu": cpu, "wall": wall}
                rows.append([module, f"{cpu['before']['median']:.1f}", f"{cpu['after']['median']:.1f}",
                             ratio(cpu["after"]["median"], cpu["before"]["median"]),
                             f"{wall['before']['median']:.0f}", f"{wall['after']['median']:.0f}"])
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(base)], check=False,
                           capture_output=True)
    print(render_table(["module", "CPU-s before", "CPU-s after", "after/before", "wall before", "wall after"], rows))
    write_result("unit_cpu", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
