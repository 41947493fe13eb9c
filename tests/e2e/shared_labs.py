"""The labs that e2e modules share (tests/e2e/conftest.py makes them; tests/conftest.py sends
every test that uses one to one pytest-xdist worker, so each is booted and converged once a run).

A converge of deploy/full.py is not cheap (each box builds a Python env), so the modules that only
read a converged box, or change it and put it back, share one: ``fleet_lab``. A module whose test
needs a box nobody converged, or breaks one on purpose, boots its own (``lab_factory``).
"""

from __future__ import annotations

import subprocess
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.lab import DeployResult, Lab

# session-wide labs: fixture name (tests/e2e/conftest.py) -> the modules (or ``module::Class``)
# that use it, in the order they run: one pytest-xdist work unit (tests/conftest.py), the lab
# closed when its last test is done; a test elsewhere that asks for one stops the run
SHARED_LABS = {
    # the converge verified (the T4's env with vLLM and xformers among it), then read, then a checkpoint exported on
    # its P40 box, then deploy/full.py's undo on its T4
    "fleet_lab": ("tests/e2e/test_foundation.py", "tests/e2e/test_security.py", "tests/e2e/test_export.py",
                  "tests/e2e/test_full_undo.py"),
    # the env stage's converge and rebuilds on a P40 box, then drill 5 breaks that env four ways (a box that gets
    # vLLM and xformers is fleet_lab's T4: test_foundation.py reads the env deploy/full.py built there)
    "env_lab": ("tests/e2e/test_env.py", "tests/e2e/test_drills.py::TestEnvDrill"),
}


def shared_lab_of(nodeid: str) -> tuple[str, int] | None:
    """The shared lab a test belongs to, and its place among the lab's users; None if none."""
    for lab, members in SHARED_LABS.items():
        for place, member in enumerate(members):
            if nodeid == member or nodeid.startswith(member + "::"):
                return lab, place
    return None

# ------------------------------------------------------------------ the env stage's boxes: env_lab

ENV_BOX = "envbox"          # a P40 (no vLLM, no xformers)

# ------------------------------------------------------------------ the converged fleet: fleet_lab

# box (its GPU) -> artifact_mode: a box of each mode, one without vLLM (HF rollout, fp32) and one with vLLM and the
# cu118 xformers. The fleet had an RTX 3090 (direct) too until issue 45 (its converge, about 80 CPU-s of the CI's
# ~2500, proved nothing the two do not: an Ampere box's plan is tests/unit's, its cheap stages in direct mode are
# tests/e2e/test_drills.py's test_bad_boxes_fail_alone_with_their_reason, and its env differs from the T4's only by
# xformers, which the env stage's unit tests render)
FLEET_BOXES = {"p40": "relay", "t4": "direct"}
# each box's settings beside its artifact_mode: the P40 scores its exports with HF generate on the CPU
# (tests/e2e/test_export.py: the base model, step 3, step 5; 12 rows each), whose answers run to the workload's
# max_response_length (the tiny model never stops early): 256 tokens took about 24 CPU-s a score, most of it the
# 151,936-word vocabulary's logits; 32 keep the same programs and checks at an eighth of the tokens
FLEET_SETTINGS = {"p40": {"workload": {"max_response_length": 32}}}
FLEET_FRESH = "fresh"          # a V100 box in the same lab that no deploy may change


@dataclass
class Fleet:
    """The shared lab and how it was converged: every later deploy of it passes the same data."""

    lab: Lab
    data: dict[str, Any]                    # host data of every deploy: stand-ins, token file
    per_host: dict[str, dict[str, Any]]     # each box's artifact_mode
    token: str                              # the HF token the endpoint requires
    token_file: Path
    converge: DeployResult | None = None    # the first deploy/full.py, on never-converged boxes
    argv_hits: list[str] = field(default_factory=list)   # process argv lines with the token, sampled

    def box(self, name: str):
        return self.lab.box(name)

    def deploy(self, deploy_file: str = "deploy/full.py", hosts=None, per_host=None, data=None,
               **kw) -> DeployResult:
        """A deploy of the fleet's boxes (default: the converged ones) with the converge's data
        (and ``data`` on top of it)."""
        per_host = {**{h: dict(v) for h, v in self.per_host.items()}, **(per_host or {})}
        names = list(hosts) if hosts is not None else list(FLEET_BOXES)
        return self.lab.deploy(deploy_file, data={**self.data, **(data or {})}, hosts=names,
                               per_host={h: v for h, v in per_host.items() if h in names}, **kw)


def converge_sampling_argv(fleet: Fleet) -> None:
    """deploy/full.py on the fleet while every process's argv on this machine (the controller's
    and, through nspawn, the boxes') is sampled for the token."""
    done = threading.Event()

    def sample():
        while not done.is_set():
            out = subprocess.run(["ps", "-eww", "-o", "args="], capture_output=True, text=True).stdout
            fleet.argv_hits.extend(line for line in out.splitlines() if fleet.token in line)
            done.wait(0.25)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        fleet.converge = fleet.deploy(timeout=1500)
    finally:
        done.set()
        sampler.join()
