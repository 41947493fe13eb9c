"""config.py gives pyinfra's scp client (the relay's transfers) more time for each reply of the box's scp than
pyinfra's 10 s: a plumbing check (the client pyinfra's SSH connector makes, after pyinfra loaded config.py the
way its CLI does), run in a child Python so the hooks stay out of this test process."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

CHILD = """
import inspect, runpy
import pyinfra.connectors.ssh as ssh
from pyinfra.connectors.scp.client import SCPClient
before = inspect.signature(SCPClient.__init__).parameters["socket_timeout"].default
runpy.run_path("config.py")
client = ssh.SCPClient(None)              # what get_file_transfer_connection makes with scp
print(before, type(client).__name__, client.socket_timeout)
"""


def test_pyinfras_scp_client_waits_longer_for_the_box_after_config_py():
    res = subprocess.run([sys.executable, "-c", CHILD], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    before, kind, timeout = res.stdout.split()
    assert float(before) == 10.0, "pyinfra's own default changed: see whether config.py still needs to set it"
    assert kind == "SCPClient" and float(timeout) == 300
