"""Two real Ray nodes on this machine whose disks are their own (tests/unit/test_cluster_two_disks.py,
tests/unit/test_gather_once.py): each started as the cluster stage's units start them (``ray start --head
--block ...`` / ``ray start --block --address=...``) inside a mount namespace of its own, where the lab's
checkpoint folder and Ray's temp folder are that node's own folders bind-mounted at the same paths. As on two
boxes, a node's raylet, its workers and what they write see that node's disk only (root only; nothing outside
the test's folder is mounted over). Each node is a session of its own: ``pause`` stops every process of one
(its raylet and workers: a node that hangs), ``resume`` lets it go on.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

# Ray's settings for nodes on one small machine: no prestarted workers, patient start-up under load
RAY_ENV = {"RAY_enable_worker_prestart": "0", "RAY_prestart_worker_first_driver": "0",
           "RAY_raylet_start_wait_time_s": "120", "RAY_gcs_server_request_timeout_seconds": "120",
           "RAY_USAGE_STATS_ENABLED": "0", "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1",
           "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def layout(prefix: str):
    """A folder under /tmp (short: Ray's socket paths) holding the lab as the nodes see it (``lab/train/checkpoints``,
    ``lab/ray/tmp``, ``lab/work``) and each node's own disk (``disk/head``, ``disk/worker``: ``checkpoints``,
    ``ray-tmp``, bind-mounted over the lab's in that node's namespace). Returns (base, lab, train, disks)."""
    import tempfile

    base = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    lab, train = base / "lab", base / "lab" / "train"
    for path in (train / "checkpoints", lab / "ray" / "tmp", lab / "work"):
        path.mkdir(parents=True)
    disks = {role: base / "disk" / role for role in ("head", "worker")}
    for disk in disks.values():
        (disk / "checkpoints").mkdir(parents=True)
        (disk / "ray-tmp").mkdir()
    return base, lab, train, disks


def place_gather(train: Path, head_ip: str, port: int) -> None:
    """The head's train folder as the stages place it for a cluster: ``ray.env`` (the head's address), and
    ``cluster-gather`` (tasks/cluster.py) with ``verl_lab_checkpoints.py`` (tasks/train.py) beside it."""
    import shutil

    repo = Path(__file__).resolve().parents[2] / "verl_lab_box"
    (train / "ray.env").write_text(f"RAY_ADDRESS={head_ip}:{port}\nVERL_LAB_NODE_IP={head_ip}\nGLOO_SOCKET_IFNAME=lo\n")
    shutil.copy(repo / "cluster_gather.py", train / "cluster-gather")
    shutil.copy(repo / "checkpoints.py", train / "verl_lab_checkpoints.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Nodes:
    """The two nodes' processes (each `ray start --block` in its own mount namespace and session)."""

    def __init__(self, base: Path, env: dict, ray: str):
        self.base, self.env, self.ray, self.procs = base, env, ray, {}

    def start(self, role: str, disk: Path, args: list[str]) -> None:
        lab = self.base / "lab"
        binds = (f"mount --bind {disk / 'checkpoints'} {lab / 'train' / 'checkpoints'} && "
                 f"mount --bind {disk / 'ray-tmp'} {lab / 'ray' / 'tmp'} && ")
        log = open(self.base / f"ray-{role}.log", "w")
        self.procs[role] = subprocess.Popen(
            ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c",
             binds + "exec " + " ".join([self.ray, "start", "--block", *args])],
            env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def start_pair(self, disks: dict, head_ip: str, worker_ip: str, port: int, cpus: int, python: str,
                   timeout: float = 240) -> None:
        """The head, then the worker; returns once Ray lists both alive (else fails with the worker's log)."""
        lab = self.base / "lab"
        self.start("head", disks["head"], ["--head", f"--node-ip-address={head_ip}", f"--port={port}", "--num-gpus=1",
                                           f"--num-cpus={cpus}", f"--temp-dir={lab / 'ray' / 'tmp'}",
                                           "--include-dashboard=false", "--disable-usage-stats"])
        time.sleep(3)
        self.start("worker", disks["worker"], [f"--address={head_ip}:{port}", f"--node-ip-address={worker_ip}",
                                               "--num-gpus=1", f"--num-cpus={cpus}", "--disable-usage-stats"])
        ask = (f"import json, ray; ray.init(address='{head_ip}:{port}', _node_ip_address='{head_ip}', "
               "log_to_driver=False); print(json.dumps(sorted(n['NodeManagerAddress'] for n in ray.nodes() if n['Alive'])))")
        deadline, alive = time.monotonic() + timeout, []
        while time.monotonic() < deadline:
            res = self.in_head([python, "-c", ask], timeout=120)
            alive = json.loads(res.stdout.strip().splitlines()[-1]) if res.returncode == 0 and res.stdout.strip() else []
            if alive == sorted([head_ip, worker_ip]):
                return
            time.sleep(2)
        raise AssertionError(f"Ray lists {alive} alive, not both nodes:\n"
                             + (self.base / "ray-worker.log").read_text()[-3000:])

    def in_head(self, cmd: list[str], env: dict | None = None, timeout: float = 900) -> subprocess.CompletedProcess:
        """``cmd`` in the head's mount namespace (the head box's view of its disk)."""
        return subprocess.run(self.head_command(cmd), env=env or self.env, capture_output=True, text=True,
                              timeout=timeout)

    def head_command(self, cmd: list[str]) -> list[str]:
        return ["nsenter", "-t", str(self.procs["head"].pid), "-m", "--", *cmd]

    def pause(self, role: str) -> None:
        os.killpg(self.procs[role].pid, signal.SIGSTOP)

    def resume(self, role: str) -> None:
        os.killpg(self.procs[role].pid, signal.SIGCONT)

    def stop(self) -> None:
        for proc in self.procs.values():
            try:
                os.killpg(proc.pid, signal.SIGCONT)
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for proc in self.procs.values():
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
            try:
                os.killpg(proc.pid, signal.SIGKILL)      # what is left of its session (raylet, workers)
            except ProcessLookupError:
                pass
            proc.wait()


def left(base: Path) -> list[str]:
    """Processes still running with ``base`` in their command line."""
    ps = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    return [line for line in ps.splitlines() if str(base) in line]
