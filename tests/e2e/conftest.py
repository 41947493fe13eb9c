"""End-to-end fixtures: labs of lab-in-a-box hosts (tests/lab), torn down even when a test fails.

    def test_x(lab_factory):
        lab = lab_factory(["p40", "t4"])          # a started Lab with these boxes booted
        lab.deploy("deploy/full.py").assert_ok()

    def test_y(fleet_lab):                        # the converged fleet, shared (below)
        fleet_lab.box("t4").ssh("id verl")

Labs made by one ``lab_factory`` live until the end of the test module (boxes are cheap to boot
but a module's tests usually build on one converge). A converge of deploy/full.py is not cheap
(each box builds a Python env), so the modules that only read a converged box, or change it and
put it back, share one: ``fleet_lab``, booted and converged once per test run (``SHARED_LABS``;
tests/conftest.py sends every test that uses it to one pytest-xdist worker). A module whose test
needs a box nobody converged, or breaks one on purpose, boots its own.

Every lab is torn down at the end of its scope, on a failure, and on SIGTERM (made an interrupt,
after which pytest runs the fixture finalizers). Every test here is skipped, with the reason, only
when the machine cannot run boxes at all (not root, or systemd-nspawn / debootstrap / ssh missing);
CI installs them (see .ci/run).
"""

from __future__ import annotations

import secrets
import signal
import sys
from contextlib import ExitStack, contextmanager
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from tests.e2e.shared_labs import (  # noqa: E402
    ENV_BOX,
    FLEET_BOXES,
    FLEET_FRESH,
    FLEET_SETTINGS,
    SHARED_LABS,
    Fleet,
    converge_sampling_argv,
    shared_lab_of,
)
from tests.fixtures.standins import env as env_standins  # noqa: E402
from tests.fixtures.standins import fleet as standins  # noqa: E402
from tests.fixtures.zygote import PYINFRA_PRELOAD, Served  # noqa: E402
from tests.lab import BoxSpec, Lab, requirements_missing  # noqa: E402


def pytest_collection_modifyitems(config, items):
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.e2e)
        shared = shared_lab_of(item.nodeid)
        for lab in SHARED_LABS:
            if lab in getattr(item, "fixturenames", ()) and (shared is None or shared[0] != lab):
                raise pytest.UsageError(f"{item.nodeid} uses the shared lab {lab}: add its module (or class) to "
                                        f"{lab}'s users in tests/e2e/shared_labs.py SHARED_LABS (one pytest-xdist "
                                        "work unit per lab)")


# shared lab -> what closes it (its boxes, its stand-ins); closed after the lab's last test
_OPEN: dict[str, ExitStack] = {}


def pytest_runtest_teardown(item, nextitem):
    """A shared lab is session-scoped (its users are several modules) but its users run one after
    another (tests/conftest.py): close it when the next test is none of them, so its boxes and
    their disk are freed for the rest of the run, not kept until the worker ends."""
    shared = shared_lab_of(item.nodeid)
    if shared is None or shared[0] not in _OPEN:
        return
    after = shared_lab_of(nextitem.nodeid) if nextitem is not None else None
    if after is None or after[0] != shared[0]:
        _OPEN.pop(shared[0]).close()


@contextmanager
def _shared(name: str):
    with ExitStack() as stack:
        _OPEN[name] = stack
        try:
            yield stack
        finally:
            _OPEN.pop(name, None)


# pyinfra's runs (``Lab.deploy``) served by a preloaded interpreter (tests/fixtures/zygote.py; docs/testing.md
# "Heavy processes"): a fresh `python -m pyinfra` spent ~0.4 CPU-s importing pyinfra, paramiko and gevent, in each
# of some 200 deploys a run. One pool a worker, for every lab it makes; a run whose environment is not the pool's
# (a test's own ``env``, past two) starts fresh. The drills that stop or kill pyinfra by its PID run it themselves.
_PYINFRA: Served | None = None


@pytest.fixture(scope="session", autouse=True)
def _pyinfra_served(tmp_path_factory):
    """The worker's pool (its servers started by the labs, none before); its folders under pytest's base folder, which
    pytest's own rotation removes where a killed worker could not."""
    global _PYINFRA
    _PYINFRA = Served(sys.executable, max_servers=2, preload=PYINFRA_PRELOAD, timeout_s=60,
                      parent=str(tmp_path_factory.getbasetemp()))
    yield _PYINFRA
    _PYINFRA.stop()
    _PYINFRA = None


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


@contextmanager
def labs():
    """``make(boxes, **lab_kwargs)`` starts a Lab and boots ``boxes``; every lab it made is closed
    on the way out, whatever happened."""
    why = requirements_missing()
    if why:
        pytest.skip(f"lab in a box unavailable: {why}")
    made: list[Lab] = []
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        # a SIGTERM (CI timeout, `kill`, the xdist controller passing one on) must still tear
        # the boxes down: make it an interrupt, after which pytest runs the fixture finalizers
        signal.signal(signal.SIGTERM, _interrupt)

    def make(boxes=(), **lab_kwargs) -> Lab:
        lab = Lab(**lab_kwargs)
        made.append(lab)
        lab.start()
        lab.served = _PYINFRA
        if lab.served is not None:
            # its server started here, in the main thread: a deploy may run in a thread, and a server ends with
            # the thread that started it
            lab.served.python(lab.pyinfra_env())
        if boxes:
            lab.boot([BoxSpec.of(b) for b in boxes])
        return lab

    try:
        yield make
    finally:
        errors = []
        for lab in reversed(made):
            try:
                lab.close()
            except Exception as exc:   # noqa: BLE001 - report every lab's teardown problem
                errors.append(str(exc))
        if errors:
            raise RuntimeError("; ".join(errors))


@pytest.fixture(scope="module")
def lab_factory():
    with labs() as make:
        yield make


# ------------------------------------------------------------------ shared labs (tests/e2e/shared_labs.py)

@pytest.fixture(scope="session")
def fleet_lab(tmp_path_factory):
    """Two boxes (a P40 in relay mode, a T4 in direct mode: tests/e2e/shared_labs.py) converged once by
    deploy/full.py with every stage's stand-ins and an HF token the endpoint stand-in requires
    (``hf_token_file``), and a fresh V100 box nothing converges. Users, in this order:
    tests/e2e/test_foundation.py (the converge, verify, the T4's env with vLLM and xformers,
    idempotence, drift put back, a bad inventory), test_security.py (the unit's user, file modes, the token nowhere), test_export.py
    (a checkpoint on the P40 box exported, proven and scored), test_full_undo.py (deploy/full.py undoes
    on the T4 box what its settings no longer ask for). A test that changes a box puts it back and
    proves the fleet converged again (a re-run changes nothing)."""
    token = "hf_" + secrets.token_urlsafe(24)
    token_file = tmp_path_factory.mktemp("secret") / "hf_token"
    token_file.write_text(token + "\n")
    token_file.chmod(0o600)
    with _shared("fleet_lab") as stack:
        make = stack.enter_context(labs())
        lab = make([*FLEET_BOXES, BoxSpec(FLEET_FRESH, gpu="v100")])
        data = stack.enter_context(standins.published(lab, token=token))
        fleet = Fleet(lab, {**data, "hf_token_file": str(token_file)},
                      {name: {"artifact_mode": mode, **FLEET_SETTINGS.get(name, {})} for name, mode in FLEET_BOXES.items()},
                      token, token_file)
        converge_sampling_argv(fleet)
        yield fleet


@pytest.fixture(scope="session")
def env_lab():
    """A P40 box with the env stage's stand-ins published (``lab.pyenv_overrides``), nothing
    deployed. Users, in this order: tests/e2e/test_env.py (the converge, proofs, idempotence,
    rebuilds), test_drills.py's TestEnvDrill (drill 5 breaks its env four ways and rebuilds it
    with deploy/rebuild.py). The env of a box that gets vLLM and xformers (a T4) is the fleet's
    (``fleet_lab``): tests/e2e/test_foundation.py reads it."""
    with _shared("env_lab") as stack:
        make = stack.enter_context(labs())
        lab = make([BoxSpec(ENV_BOX, gpu="p40")])
        lab.pyenv_overrides = env_standins.publish(lab.mirror.root)
        yield lab
