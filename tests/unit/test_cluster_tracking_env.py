"""Why the head's ray.env carries verl's tracker environment (tasks/cluster.py ``head_tracking``), shown with
real Ray 2.46 and verl 0.5.0's own runtime env: on a cluster, a Ray worker (verl's TaskRunner, where its
``Tracking`` is made) has the environment its node's ``ray start`` had, and of the driver's (the training
unit's, train.env) only what the job's runtime env forwards: verl's ``get_ppo_ray_runtime_env`` names a few
variables of its own, no tracker's.

One Ray head on 127.0.0.10 (an address no other test uses), started with the tracker lines of the ray.env
the cluster stage renders for a head; a driver with other values for the same variables connects with verl's
runtime env; an actor reports what it sees.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

from tasks.cluster import Interface, RayNode, cluster_wanted, head_tracking
from tests.unit.test_cluster import node

HEAD_IP = "127.0.0.10"
DRIVER = """
import json, os, sys
import ray
from verl.trainer.constants_ppo import get_ppo_ray_runtime_env
ray.init(address=sys.argv[1], _node_ip_address=sys.argv[2], runtime_env=get_ppo_ray_runtime_env(),
         log_to_driver=False)

@ray.remote(num_cpus=0)
class TaskRunnerLike:
    def env(self):
        return {k: v for k, v in os.environ.items() if k.startswith(("TENSORBOARD_", "WANDB_", "TOKENIZERS_"))}

runner = TaskRunnerLike.remote()          # held: an actor whose handle is dropped is cancelled
print("SEEN " + json.dumps(ray.get(runner.env.remote())), flush=True)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_ray_worker_sees_its_nodes_ray_env_not_the_training_units(verl_python, patched_verl_root, tmp_path):
    lo = Interface("lo", HEAD_IP, "every node is on this machine")
    keys = tmp_path / "trackers.env"          # the controller's, for its sync of the offline run
    keys.write_text("WANDB_API_KEY=" + "k" * 40 + "\n")
    keys.chmod(0o600)
    head = node("box1", lo, cluster_address=HEAD_IP, artifact_mode="relay",
                tracking={"trackers": ["tensorboard", "wandb"], "keys_file": str(keys)})
    head = RayNode(head.settings, head.cluster, lo, 1, {}, head_tracking(head.settings, "lab1-run-ppo"))
    ray_env = next(w.content.decode() for w in cluster_wanted(head) if w.path.endswith("/ray.env"))
    tracker_lines = dict(line.split("=", 1) for line in ray_env.splitlines()
                         if line.startswith(("TENSORBOARD_DIR=", "WANDB_")))
    assert tracker_lines["TENSORBOARD_DIR"] == "/opt/verl-lab/tracking/tensorboard/lab1-run-ppo"
    assert tracker_lines["WANDB_MODE"] == "offline"          # relay: no internet, the controller syncs

    ray = Path(verl_python).parent / "ray"
    temp = Path(tempfile.mkdtemp(prefix="vlt", dir="/tmp"))      # Ray's socket paths must stay short
    port = _free_port()
    base = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_enable_worker_prestart": "0"}
    base.pop("RAY_ADDRESS", None)
    # a session of its own: Ray's processes (GCS, raylet, workers) keep its process group, which the end stops
    # (``ray stop`` would end every Ray process of the machine, other tests' too)
    start = subprocess.Popen([str(ray), "start", "--head", f"--node-ip-address={HEAD_IP}", f"--port={port}",
                              f"--temp-dir={temp}", "--num-cpus=1", "--include-dashboard=false",
                              "--disable-usage-stats"], env={**base, **tracker_lines}, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, start_new_session=True)
    started = start.communicate(timeout=180)[0]
    try:
        assert start.returncode == 0, started[-3000:]
        # the training unit's environment (train.env) has the same names with other values: not what the worker sees
        driver_env = {**base, "PYTHONPATH": str(patched_verl_root), "TENSORBOARD_DIR": "/driver/tensorboard",
                      "WANDB_MODE": "online", "WANDB_DIR": "/driver/wandb"}
        res = subprocess.run([str(verl_python), "-c", DRIVER, f"{HEAD_IP}:{port}", HEAD_IP], env=driver_env,
                             capture_output=True, text=True, timeout=300)
        seen = next((json.loads(line[5:]) for line in res.stdout.splitlines() if line.startswith("SEEN ")), None)
        assert seen is not None, res.stdout[-2000:] + res.stderr[-3000:]
        assert {k: seen.get(k) for k in tracker_lines} == tracker_lines, seen
        assert "/driver" not in json.dumps(seen), "the training unit's values never reach the worker"
        assert seen["TOKENIZERS_PARALLELISM"] == "true", "verl's runtime env reaches the worker: it forwards its own"
    finally:
        _stop_group(start.pid)
        shutil.rmtree(temp, ignore_errors=True)


def _stop_group(pgid: int) -> None:
    """End the process group of the head this test started: SIGTERM, then SIGKILL what is left."""
    import signal
    import time
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        time.sleep(3)
