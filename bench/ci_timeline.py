"""A pytest plugin for bench/ci_cpu.py: each worker writes when each of its tests started (S) and ended (F), and its
own PID (P), to ``$CI_TIMELINE/<worker>.tsv`` (default /tmp/ci-timeline). Load it with
``PYTHONPATH=bench PYTEST_ADDOPTS="-p ci_timeline"``; it changes nothing of the run."""

from __future__ import annotations

import os
import time
from pathlib import Path

_out = None


def _file():
    global _out
    if _out is None:
        folder = Path(os.environ.get("CI_TIMELINE", "/tmp/ci-timeline"))
        folder.mkdir(parents=True, exist_ok=True)
        _out = open(folder / f"{os.environ.get('PYTEST_XDIST_WORKER', 'main')}.tsv", "a", buffering=1)
        _out.write(f"P\t{time.time():.2f}\t{os.getpid()}\n")
    return _out


def pytest_runtest_logstart(nodeid, location):
    _file().write(f"S\t{time.time():.2f}\t{nodeid}\n")


def pytest_runtest_logfinish(nodeid, location):
    _file().write(f"F\t{time.time():.2f}\t{nodeid}\n")
