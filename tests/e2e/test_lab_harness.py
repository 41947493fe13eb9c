"""The lab harness's own promises: leftovers of a crashed run are found and stopped by
recorded PID; boxes of a live run are never touched; bin/lab up/down round-trips."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.lab import Lab, requirements_missing
from tests.lab.box import alive
from tests.lab.lab import REPO_ROOT, cleanup_stale, read_state

pytestmark = pytest.mark.skipif(bool(requirements_missing()), reason=f"lab unavailable: {requirements_missing()}")

CHILD = """
import sys, time
sys.path.insert(0, {repo!r})
from tests.lab import Lab
lab = Lab().start()
lab.boot(["t4"])
print(lab.dir, flush=True)
time.sleep(600)
"""


def _mounted(path: Path) -> bool:
    return any(line.split()[4] == str(path) for line in Path("/proc/self/mountinfo").read_text().splitlines())


def test_crashed_run_is_cleaned_by_the_next_one():
    child = subprocess.Popen([sys.executable, "-c", CHILD.format(repo=str(REPO_ROOT))],
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        work = Path(child.stdout.readline().strip())
        state = read_state(work)
        rec = state["boxes"]["t4"]
        assert alive(rec["pid"], rec["pid_start"])
    finally:
        child.send_signal(signal.SIGKILL)      # a crash: no teardown ran
        child.wait()
    assert alive(rec["pid"], rec["pid_start"]), "the box outlives its crashed owner"
    live = Lab().start()                       # a live lab of the same repo: must be left alone
    try:
        live.boot(["p40"])
        cleanup_stale(REPO_ROOT, log=lambda m: None)
        assert not alive(rec["pid"], rec["pid_start"])
        assert not work.exists() and not _mounted(Path(rec["root"]))
        assert live.box("p40").ssh("true").returncode == 0
    finally:
        live.close()


def test_bin_lab_up_status_down(tmp_path):
    env = {**os.environ, "VERL_LAB_DIR": str(tmp_path / "lab")}
    lab = [sys.executable, str(REPO_ROOT / "bin/lab")]
    up = subprocess.run([*lab, "up", "--gpus", "p40,t4"], capture_output=True, text=True, env=env, timeout=300)
    try:
        assert up.returncode == 0, up.stderr
        assert "Inventory: " in up.stdout and "pyinfra -y" in up.stdout
        inv = tmp_path / "lab" / "inventory.py"
        assert inv.is_file() and "p40 = [" in inv.read_text()
        st = subprocess.run([*lab, "status"], capture_output=True, text=True, env=env)
        assert st.stdout.count(" up") >= 3, st.stdout          # mirror + 2 boxes
        out = subprocess.run([*lab, "ssh", "t4", "nvidia-smi", "-L"], capture_output=True, text=True, env=env)
        assert out.stdout.startswith("GPU 0: Tesla T4"), out
        state = json.loads((tmp_path / "lab" / "state.json").read_text())
    finally:
        down = subprocess.run([*lab, "down"], capture_output=True, text=True, env=env, timeout=120)
    assert down.returncode == 0 and "stopped p40, t4" in down.stdout, down
    for rec in state["boxes"].values():
        assert not alive(rec["pid"], rec["pid_start"])
    m = state["mirror"]
    time.sleep(0.5)
    assert not alive(m["pid"], m["pid_start"])
    assert not (tmp_path / "lab").exists()
