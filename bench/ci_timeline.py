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
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        # the run is root's: a folder another user made (a link planted in it) is not written through
        if folder.is_symlink() or folder.stat().st_uid != os.geteuid():
            raise RuntimeError(f"CI_TIMELINE {folder}: not a folder of this user; give a new one")
        name = folder / f"{os.environ.get('PYTEST_XDIST_WORKER', 'main')}.tsv"
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o600)
        _out = os.fdopen(fd, "a", buffering=1)
        _out.write(f"P\t{time.time():.2f}\t{os.getpid()}\n")
    return _out


def pytest_runtest_logstart(nodeid, location):
    _file().write(f"S\t{time.time():.2f}\t{nodeid}\n")


def pytest_runtest_logfinish(nodeid, location):
    _file().write(f"F\t{time.time():.2f}\t{nodeid}\n")
