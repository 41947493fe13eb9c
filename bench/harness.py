"""What every bench script shares: statistics, tables, results files, interleaved timing, and the
stand-in pipeline (every stage's stand-ins published into one lab, with the host data to drive
the stages against them).

The pure parts (``summary``, ``ratio``, ``render_table``, ``interleave``, ``count_commands``)
are unit-tested in tests/unit/test_bench_harness.py; the rest needs a lab in a box (root).
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

RESULTS = REPO / "bench" / "results"

# Stage deploy files, by the stages they run (each one converges alone with the stand-ins).
STAGE_DEPLOYS = {
    "full": "deploy/full.py",                 # base, cuda, env, data, train
    "nonenv": "bench/deploy_without_env.py",   # base, cuda, data, train (env made by the bench)
}


# ------------------------------------------------------------------ statistics and tables

def summary(samples: Sequence[float]) -> dict[str, float]:
    """median / min / max / n of a list of timings (seconds)."""
    if not samples:
        raise ValueError("no samples")
    return {"median": statistics.median(samples), "min": min(samples), "max": max(samples), "n": len(samples)}


def ratio(value: float, baseline: float) -> float:
    if baseline <= 0:
        raise ValueError(f"baseline must be > 0, got {baseline}")
    return value / baseline


def render_table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A plain-text table; floats get 2 decimals (3 below 1), everything else str()."""
    def cell(v):
        if isinstance(v, float):
            return f"{v:.3f}" if abs(v) < 1 else f"{v:.2f}"
        return str(v)
    body = [[cell(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in body)) if body else len(h) for i, h in enumerate(headers)]
    line = lambda cells: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True)))
    out = [line(list(headers)), "  ".join("-" * w for w in widths)]
    out += [line(r) for r in body]
    return "\n".join(out)


def interleave(arms: Mapping[str, Callable[[], Any]], repeat: int,
               clock: Callable[[], float] = time.monotonic, rotate: bool = False) -> dict[str, list[float]]:
    """Run each arm once per round, ``repeat`` rounds (a b a b ...), timing each call.

    An arm may return a dict with ``"seconds"`` to report its own timing (e.g. a transfer
    measured without its setup); else the wall time of the call counts. ``rotate``: each round
    starts one arm later (a b c, b c a, c a b, ...), so an arm that slows whichever arm runs
    after it (a big file written, the page cache filled) does not always hit the same one.
    """
    names = list(arms)
    times: dict[str, list[float]] = {name: [] for name in arms}
    for round_ in range(repeat):
        shift = round_ % len(names) if rotate and names else 0
        for name in names[shift:] + names[:shift]:
            fn = arms[name]
            started = clock()
            got = fn()
            took = clock() - started
            if isinstance(got, dict) and "seconds" in got:
                took = got["seconds"]
            times[name].append(took)
    return times


def free_page_reporting(sys_root: Path | None = None) -> int | None:
    """This VM's free page reporting order (``bench.vm_pages.page_reporting_order``), or None.
    Memory so reported is dropped by the host and faults in again when next used: page-cache
    writes of big files get slower and noisier (docs/benchmarks.md, "Download"), so every
    result records it."""
    from bench.vm_pages import page_reporting_order
    return page_reporting_order(sys_root)


@contextlib.contextmanager
def free_page_reporting_off(sys_root: Path | None = None):
    """Stop this VM reporting free memory to its host for the duration (root): the reporting
    order is raised above the largest buddy order, so no free block qualifies; the order found
    is put back afterwards. Yields the order found (None: nothing to stop)."""
    from bench.vm_pages import MAX_BUDDY_ORDER, PAGE_REPORTING_ORDER, SYS
    found = free_page_reporting(sys_root)
    if found is None:
        yield None
        return
    param = (sys_root or SYS) / PAGE_REPORTING_ORDER
    param.write_text(f"{MAX_BUDDY_ORDER + 1}\n")
    try:
        yield found
    finally:
        param.write_text(f"{found}\n")


def touch_free_memory(keep_mib: int = 2048, meminfo: Path = Path("/proc/meminfo")) -> int:
    """Write every page of this machine's free memory but ``keep_mib`` once, then free it; returns
    MiB touched. With free page reporting off, memory the host had taken back is backed again
    after this, so the next page-cache writes do not fault it in (the first touch ran at
    ~200 MiB/s on the VM these benches were written on)."""
    free_kib = next(int(line.split()[1]) for line in meminfo.read_text().splitlines()
                    if line.startswith("MemFree:"))
    mib = max(0, free_kib // 1024 - keep_mib)
    block = bytes(1 << 20)
    with mmap.mmap(-1, max(mib, 1) << 20) as mem:
        for _ in range(mib):
            mem.write(block)
    return mib


def machine() -> dict[str, Any]:
    return {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
            "mem_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
            "free_page_reporting_order": free_page_reporting(),
            "boxes": "systemd-nspawn containers on this machine, ssh over 127.0.0.1 (loopback)"}


def write_result(name: str, doc: Mapping[str, Any]) -> Path:
    """bench/results/<name>-<UTC stamp>.json plus bench/results/<name>.json (the latest)."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    full = {"bench": name, "date": stamp, "machine": machine(), **doc}
    text = json.dumps(full, indent=1, sort_keys=False, default=str) + "\n"
    path = RESULTS / f"{name}-{stamp}.json"
    path.write_text(text)
    (RESULTS / f"{name}.json").write_text(text)
    return path


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------ command counting

@dataclass
class CommandLog:
    """What a counted pyinfra run sent to each host (see bench/counted_pyinfra.py)."""
    commands: dict[str, list[dict]] = field(default_factory=dict)     # host -> [{kind, stage, fact, command}]

    @classmethod
    def read(cls, path: Path) -> CommandLog:
        out = cls()
        if not Path(path).exists():
            return out
        for line in Path(path).read_text().splitlines():
            if line.strip():
                rec = json.loads(line)
                out.commands.setdefault(rec["host"], []).append(rec)
        return out


def count_commands(log_: CommandLog, slow: int = 8) -> dict[str, dict[str, Any]]:
    """Per host: total remote commands, uploads, commands per stage and per fact, the slowest,
    and the facts asked more than once with the very same command (``repeated_facts``)."""
    result = {}
    for host, recs in sorted(log_.commands.items()):
        by_stage: dict[str, int] = {}
        by_fact: dict[str, int] = {}
        shells = uploads = 0
        shell_s = upload_s = 0.0
        for r in recs:
            if r["kind"] == "upload":
                uploads += 1
                upload_s += r.get("seconds", 0.0)
                continue
            shells += 1
            shell_s += r.get("seconds", 0.0)
            by_stage[r.get("stage") or "?"] = by_stage.get(r.get("stage") or "?", 0) + 1
            if r.get("fact"):
                by_fact[r["fact"]] = by_fact.get(r["fact"], 0) + 1
        seen: dict[str, int] = {}
        for r in recs:
            if r["kind"] == "fact":
                key = f"{r.get('fact')}: {r.get('command')}"
                seen[key] = seen.get(key, 0) + 1
        repeated = {k: n for k, n in seen.items() if n > 1}
        slowest = sorted((r for r in recs if r["kind"] != "upload"), key=lambda r: -r.get("seconds", 0.0))[:slow]
        result[host] = {"commands": shells, "uploads": uploads, "by_stage": by_stage, "by_fact": by_fact,
                        "command_seconds": round(shell_s, 4), "upload_seconds": round(upload_s, 4),
                        "repeated_facts": repeated,
                        "slowest": [{k: r.get(k) for k in ("seconds", "stage", "fact", "command")} for r in slowest]}
    return result


# ------------------------------------------------------------------ the stand-in pipeline

class Pipeline:
    """Every stage's stand-ins, published into ``lab``'s mirror, and the host data to use them.

    ``stages``: "full" (deploy/full.py: the env stage builds a venv from the controller's
    wheelhouse) or "nonenv" (bench/deploy_without_env.py: base, cuda, data, train; each box gets
    the small venv the data stage needs, installed offline by ``prepare_box``).
    """

    def __init__(self, lab, stages: str = "full"):
        if stages not in STAGE_DEPLOYS:
            raise ValueError(f"stages is one of {', '.join(STAGE_DEPLOYS)}")
        from tests.fixtures.standins import cuda as cuda_standin
        from tests.fixtures.standins import hf_endpoint
        self.lab, self.stages = lab, stages
        self.deploy_file = STAGE_DEPLOYS[stages]
        overrides = dict(cuda_standin.publish(lab.mirror.root, step_seconds=0.0))
        self.endpoint = hf_endpoint.standard_endpoint().start()
        overrides.update(hf_endpoint.catalog_overrides(self.endpoint))
        urls = {**lab.mirror_urls, "huggingface": self.endpoint.url}
        data: dict[str, Any] = {"env_backend": "venv", "venv_python": "python3"}
        if stages == "full":
            from tests.fixtures.standins import env as env_standin
            overrides.update(env_standin.publish(lab.mirror.root))
            urls["pypi"] = env_standin.pypi_base(lab.mirror_url)
        self.data = {**data, "mirror_urls": urls, "catalog_overrides": overrides}

    def close(self) -> None:
        self.endpoint.stop()

    def prepare_box(self, name: str) -> None:
        """For the nonenv stages: the venv (pyarrow, huggingface_hub) the data stage runs in."""
        if self.stages != "nonenv":
            return
        from tests.fixtures.standins.fleet import data_wheelhouse
        house = data_wheelhouse()
        box = self.lab.box(name)
        dest = box.root / "var/tmp/wheels"
        subprocess.run(["cp", "-a", "--reflink=auto", f"{house}/.", str(dest)], check=True) if dest.exists() else \
            subprocess.run(["cp", "-a", "--reflink=auto", str(house), str(dest)], check=True)
        box.ssh("python3 -m venv /opt/verl-lab/envs/verl && /opt/verl-lab/envs/verl/bin/pip install -q "
                "--no-index --find-links /var/tmp/wheels pyarrow huggingface_hub", timeout=600)

    def deploy(self, hosts=None, **kw):
        return self.lab.deploy(self.deploy_file, data=self.data, hosts=hosts, timeout=kw.pop("timeout", 1800), **kw)


# ------------------------------------------------------------------ running pyinfra

@dataclass
class Run:
    seconds: float
    result: Any                      # tests.lab.DeployResult
    commands: dict[str, dict] | None = None    # count_commands(...) when counted
    log: CommandLog | None = None            # the raw records when counted


def run_pyinfra(lab, args: Sequence[str], data: Mapping[str, Any] | None = None, hosts=None,
                count: bool = False, timeout: float = 1800, tag: str = "run", profile: Path | None = None) -> Run:
    """``python -m pyinfra -y --json INV *args`` (or bench/counted_pyinfra.py with ``count``)
    against the lab's boxes with the same inventory lab.deploy writes; timed end to end.
    ``profile``: run it under cProfile, stats written there (the controller's own CPU)."""
    from tests.lab.results import parse
    names = list(hosts) if hosts is not None else list(lab.boxes)
    stamp = f"{tag}-{time.monotonic_ns()}"
    inv = lab.write_inventory(data, None, names, path=lab.dir / f"inventory-{stamp}.py")
    entry = [str(REPO / "bench" / "counted_pyinfra.py")] if count else ["-m", "pyinfra"]
    if profile is not None:
        entry = ["-m", "cProfile", "-o", str(profile), *entry]
    cmd = [sys.executable, *entry, "-y", "--json", str(inv), *args]
    env = {**os.environ, "PYINFRA_PROGRESS": "off", "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO)}
    cmd_log = lab.dir / f"commands-{stamp}.jsonl"
    if count:
        env["VERL_LAB_COMMAND_LOG"] = str(cmd_log)
    started = time.monotonic()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout, env=env)
    took = time.monotonic() - started
    (lab.dir / f"{stamp}.log").write_text(f"$ {' '.join(cmd)}\n# rc {proc.returncode} {took:.2f}s\n"
                                          f"--- stderr\n{proc.stderr}\n--- stdout\n{proc.stdout}\n")
    res = parse(cmd, proc.returncode, proc.stdout, proc.stderr, names, mode="json")
    records = CommandLog.read(cmd_log) if count else None
    return Run(took, res, count_commands(records) if count else None, records)


def floor_args() -> list[str]:
    """pyinfra itself: connect to every host and read one trivial fact."""
    return ["fact", "server.Hostname"]
