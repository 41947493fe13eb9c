"""How a test run shares its work among pytest-xdist workers (the README's test command, in
.ci/run, runs ``python -m pytest -q -n 4 tests``).

- Work units: a test module is one unit, sent whole to one worker (its module-scoped fixtures,
  e.g. a lab of booted boxes, are made once, and its tests run in their order: most e2e modules
  build on one converge); the tests that share a session-wide lab (``tests/e2e/shared_labs.py``:
  ``SHARED_LABS``, modules or a module's class) form one unit per lab, so that lab is booted and
  converged once, in one worker, and closed after its last test (tests/e2e/conftest.py). ``LabScheduling`` below is xdist's own LoadScopeScheduling with
  these units; it takes over from xdist's default (``--dist load``, one test at a time), which
  would split a module's tests among workers.
- Order: units are handed out in collection order, and the collection is sorted longest first:
  the units in ``LONGEST_FIRST``'s order (the e2e labs and the unit modules that train on CPU),
  then the other e2e modules, then the other unit tests, which fill the workers at the end.
- Teardown: the controller passes a SIGTERM on to its workers, each of which tears its labs down
  (``tests/e2e/conftest.py``), and at the end stops whatever labs a dead worker left
  (``tests.lab.lab.cleanup_stale``: by recorded PID, only labs whose owner is gone).

Without ``-n`` (one module while working on it) only the order applies.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

# One compute thread per process for every program the tests start (torch's intra-op pool, OpenMP, BLAS): the
# suite runs four workers on two cores, and a two-thread OpenMP region whose second thread is descheduled spins at
# its barrier. Measured here with the machine loaded (load 4-5): tests/unit/test_burnin_learning.py took 310 s with
# its runs on two threads, 65 s on one (docs/testing.md, "Threads"). A value set by the caller is kept.
for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

# work units, longest first (docs/testing.md: a fresh-clone run's profile); the others follow,
# e2e before unit tests, which fill the workers at the end
LONGEST_FIRST = ("lab:fleet_lab", "lab:env_lab", "tests/e2e/test_readme_path.py", "tests/e2e/test_drills.py",
                 "tests/e2e/test_cluster.py", "tests/e2e/test_driver.py", "tests/e2e/test_refusals.py",
                 "tests/unit/test_fsdp2_gather.py", "tests/unit/test_burnin_learning.py", "tests/unit/test_export.py",
                 "tests/unit/test_cluster_two_disks.py", "tests/unit/test_gather_once.py",
                 "tests/unit/test_gsm8k_score.py", "tests/unit/test_hf_rollout.py", "tests/unit/test_gpu_probe.py",
                 "tests/e2e/test_rollout_setting.py", "tests/e2e/test_cuda.py", "tests/e2e/test_data.py")
TEARDOWN_GRACE_S = 120


def work_unit(nodeid: str) -> str:
    """A test's unit of work: ``lab:<fixture>`` for the tests that share that lab, else its module."""
    from tests.e2e.shared_labs import shared_lab_of
    shared = shared_lab_of(nodeid)
    return f"lab:{shared[0]}" if shared else nodeid.partition("::")[0]


def _rank(unit: str) -> tuple[int, int]:
    if unit in LONGEST_FIRST:
        return 0, LONGEST_FIRST.index(unit)
    return (1 if unit.startswith(("lab:", "tests/e2e/")) else 2), 0


def _order(item) -> tuple[int, int, int]:
    from tests.e2e.shared_labs import shared_lab_of
    shared = shared_lab_of(item.nodeid)
    return (*_rank(work_unit(item.nodeid)), shared[1] if shared else 0)


def pytest_collection_modifyitems(config, items):
    # a stable sort: within a unit, tests keep their order (a module's tests build on each other),
    # and the users of a shared lab run in SHARED_LABS' order
    items.sort(key=_order)


def _controller(config) -> bool:
    return getattr(config.option, "dist", "no") != "no" and not hasattr(config, "workerinput")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") not in ("load", "loadscope"):
        return None                    # another --dist asked for by name: xdist's own
    from xdist.scheduler import LoadScopeScheduling

    class LabScheduling(LoadScopeScheduling):
        """xdist's LoadScopeScheduling with this suite's work units, in the collection's order."""

        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

        def _reschedule(self, node) -> None:
            # A worker holds its last test back until it knows the next one (pytest's nextitem):
            # send the next unit when only that one is left, never behind a test still running
            # (xdist's own threshold, 2, queues a unit behind a lab test of many minutes).
            if node.shutting_down:
                return
            if not self.workqueue:
                node.shutdown()
                return
            if self._pending_of(self.assigned_work[node]) <= 1:
                self._assign_work_unit(node)

    config.option.loadscopereorder = False      # not by test count: the collection is sorted
    return LabScheduling(config, log)


def pytest_configure(config):
    if _controller(config) and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _pass_sigterm_on)


def _workers() -> list[int]:
    """This process's children: the controller starts nothing but its workers."""
    me, found = os.getpid(), []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == me:
                found.append(int(entry.name))
    return found


def _labs_of(pids: list[int]) -> list[Path]:
    from tests.lab.lab import read_state, work_base
    base = work_base()
    if not base.is_dir():
        return []
    # a closed lab's folder is renamed .deleting-* and removed in the background: not a lab
    return [d for d in base.iterdir()
            if not d.name.startswith(".") and (read_state(d) or {}).get("owner_pid") in pids]


def _pass_sigterm_on(signum, frame):
    """Each worker turns the SIGTERM into an interrupt and tears its labs down; wait for that
    (xdist kills a worker 10 s after the run stops), then stop the run here."""
    workers = _workers()
    for pid in workers:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + TEARDOWN_GRACE_S
    while time.monotonic() < deadline and _labs_of(workers):
        time.sleep(0.5)
    raise KeyboardInterrupt(f"signal {signum}")


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session):
    """After the workers are gone: stop the labs any of them left (a crash, a kill)."""
    if _controller(session.config):
        from tests.lab.lab import REPO_ROOT, cleanup_stale
        cleanup_stale(REPO_ROOT)
