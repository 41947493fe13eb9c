"""One gather per step (issue 41), on two real Ray 2.46 nodes whose disks are their own, on CPU.

The nodes (tests/lab/ray_nodes.py) are 127.0.0.11 (head) and 127.0.0.12 (worker): addresses no other module uses
(docs/testing.md). A two-rank checkpoint made on CPU by verl's own FSDPCheckpointManager
(tests/fixtures/tiny_checkpoint.py) is laid out as a cluster run leaves it: rank 0, ``fsdp_config.json``,
``huggingface/`` and the tracker on the head's disk, rank 1 on the worker's. The real launcher
(verl_lab_box/train_launcher.py ``--export --no-score``, deploy/export.py's command) runs in the head's mount
namespace with a plan for ``trainer.nnodes=2``: its after-run runs ``cluster-gather`` (placed beside the plan with
``verl_lab_checkpoints.py``, as the stages place them), then ``export.py`` (verl's model merger and the proof).

Shown: two after-runs of the step started together leave one whole, proven export: the second one's gather waits
on the first one's lock, then copies nothing; one merge. A worker that hangs (every process of its node stopped;
the head's GCS told to keep counting it alive, as Ray does for a while with a node cut off) ends the after-run with
exit 70 and the doctor's reason (cluster-node-hung, naming the node) within the gather's timeout
(plan.json launch.gather_timeout_s); once the node is back, the next after-run goes on and exports.
Not shown: GPUs, NCCL, two machines' network.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.fixtures.standins import env as standin
from tests.fixtures.standins.hf_endpoint import write_tiny_model
from tests.lab.ray_nodes import RAY_ENV, Nodes, free_port, layout, left, place_gather

REPO = Path(__file__).resolve().parents[2]
LAUNCHER = REPO / "verl_lab_box" / "train_launcher.py"
CHECKPOINT = REPO / "tests" / "fixtures" / "tiny_checkpoint.py"
HEAD_IP, WORKER_IP = "127.0.0.11", "127.0.0.12"          # no other module's (docs/testing.md)
STEP, CPUS = 2, 2
GATHER_TIMEOUT_S = 40                                     # plan.json launch.gather_timeout_s
RANK1 = "model_world_size_2_rank_1.pt"

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None or shutil.which("nsenter") is None,
                                reason="each node's own disk is a mount namespace: root, unshare and nsenter")


@pytest.fixture(scope="module")
def cluster(verl_python, tmp_path_factory):
    from types import SimpleNamespace

    base, lab, train, disks = layout("vlg")
    tmp = tmp_path_factory.mktemp("gather-once")
    root = standin.patched_verl_tree(tmp / "verl")
    model = write_tiny_model(tmp / "model")
    env = {**os.environ, **RAY_ENV, "PATH": f"{Path(verl_python).parent}:{os.environ['PATH']}",
           "PYTHONPATH": str(root), "HOME": str(tmp),
           # the head's GCS keeps a stopped node alive for ~a day, as it does for a while with a node cut off: what
           # ends the gather's wait is then its own timeout, not Ray's health check
           "RAY_health_check_failure_threshold": "30000"}
    made = subprocess.run([str(verl_python), str(CHECKPOINT), "--model", str(model), "--out", str(tmp / "ckpt"),
                           "--world-size", "2", "--steps", str(STEP)], env=env, capture_output=True, text=True,
                          timeout=900)
    assert made.returncode == 0, made.stdout[-2000:] + made.stderr[-4000:]
    # as a cluster run leaves it: the head holds rank 0 and rank 0's files and the tracker, the worker rank 1
    shutil.copytree(tmp / "ckpt", disks["head"] / "checkpoints", dirs_exist_ok=True)
    head_actor = disks["head"] / "checkpoints" / f"global_step_{STEP}" / "actor"
    worker_actor = disks["worker"] / "checkpoints" / f"global_step_{STEP}" / "actor"
    worker_actor.mkdir(parents=True)
    for name in os.listdir(head_actor):
        if name.endswith("_rank_1.pt"):
            shutil.move(head_actor / name, worker_actor / name)
    ckpt = str(train / "checkpoints")
    overrides = [f"actor_rollout_ref.model.path={model}", "trainer.nnodes=2", "trainer.n_gpus_per_node=1",
                 f"trainer.default_local_dir={ckpt}", "trainer.save_freq=1"]
    plan = {"overrides": overrides, "launch": {
        "host": "head", "plan_source": "test", "gpu": {"name": "CPU stand-in", "count": 1, "memory_mib": 1024},
        "predicted_peak_mib": 1, "overrides": [{"override": o, "why": "test"} for o in overrides],
        "paths": {"train_dir": str(train), "work_dir": str(lab / "work"), "checkpoint_dir": ckpt,
                  "env_file": str(train / "train.env"), "env_python": str(verl_python), "env_marker": "-",
                  "data_marker": "-", "data_files": [], "model_dir": str(model)},
        "gather_timeout_s": GATHER_TIMEOUT_S}}
    (train / "plan.json").write_text(json.dumps(plan))
    (train / "train.env").write_text("")
    port = free_port()
    place_gather(train, HEAD_IP, port)          # ray.env, cluster-gather and verl_lab_checkpoints.py
    nodes = Nodes(base, env, str(Path(verl_python).parent / "ray"))
    run_env = {**env, "RAY_ADDRESS": f"{HEAD_IP}:{port}", "VERL_LAB_NODE_IP": HEAD_IP}

    def export() -> subprocess.Popen:
        """deploy/export.py's command on the head (the system's Python, as the unit runs the launcher)."""
        return subprocess.Popen(nodes.head_command([sys.executable, str(LAUNCHER), "--plan", str(train / "plan.json"),
                                                    "--export", "--no-score"]),
                                env=run_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)     # its own group: a run past its limit is ended whole

    try:
        nodes.start_pair(disks, HEAD_IP, WORKER_IP, port, CPUS, str(verl_python))
        yield SimpleNamespace(base=base, disks=disks, nodes=nodes, export=export, head_actor=head_actor,
                              worker_actor=worker_actor, step=head_actor.parent)
    finally:
        nodes.stop()
        running = left(base)
        shutil.rmtree(base, ignore_errors=True)
        assert not running, running


def _finish(proc: subprocess.Popen, timeout: float = 900) -> str:
    try:
        return proc.communicate(timeout=timeout)[0]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)      # the launcher and its children (the gather)
            proc.wait()


def _parts(root: Path) -> list[str]:
    return sorted(str(p) for p in root.rglob("*") if ".gather-part" in p.name or p.name.endswith(".part"))


def test_two_gathers_of_one_step_at_once_leave_one_whole_proven_export(cluster):
    """Mutation tried: no step lock in cluster-gather (its ``main`` calling ``gather`` bare): the second
    after-run's gather does not wait, and the test fails on the waiting line."""
    lock = cluster.step / ".export.lock"
    first = cluster.export()
    try:
        deadline = time.monotonic() + 300
        while "cluster gather of step" not in (lock.read_text() if lock.exists() else ""):   # the first holds the lock
            assert first.poll() is None and time.monotonic() < deadline, "the first after-run ended before it gathered"
            time.sleep(0.05)
        second = cluster.export()
        out_second = _finish(second)
        out_first = _finish(first)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
    assert first.returncode == 0 and second.returncode == 0, out_first[-4000:] + "\n-----\n" + out_second[-4000:]
    assert "waiting until pid" in out_second and f"cluster gather of step {STEP} is done" in out_second, out_second
    copied = [line for line in (out_first + out_second).splitlines() if f"step {STEP} whole on the head" in line]
    assert len(copied) == 2 and sum(" 1 file(s)" in line for line in copied) == 1, copied   # one copy, one no-op
    assert (out_first + out_second).count("verl.model_merger merge") == 1                     # one export made
    assert "already proven" in out_first + out_second
    proof = json.loads((cluster.step / "hf.proof.json").read_text())
    assert proof["ok"] and proof["world_size"] == 2 and proof["step"] == STEP
    assert (cluster.head_actor / RANK1).read_bytes() == (cluster.worker_actor / RANK1).read_bytes()
    record = json.loads((cluster.head_actor / "verl-lab-gathered.json").read_text())
    assert record["complete"] is True and [c["name"] for c in record["copied"]] == [RANK1]
    assert _parts(cluster.disks["head"]) == [] and _parts(cluster.disks["worker"]) == []


def test_a_node_that_hangs_ends_the_gather_with_70_and_the_doctors_reason_in_time(cluster):
    """Mutation tried: ray.wait/ray.get without a timeout (the gather before issue 41): the after-run is still
    waiting when the test's limit (the gather's timeout + 30 s) ends it."""
    from tasks.doctor import diagnose

    for name in ("hf", "hf.proof.json"):                     # a step to export again, rank 1 to copy again
        path = cluster.step / name
        shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
    (cluster.head_actor / RANK1).unlink(missing_ok=True)
    cluster.nodes.pause("worker")
    try:
        started = time.monotonic()
        hung = cluster.export()
        out = _finish(hung, timeout=GATHER_TIMEOUT_S + 30)
        took = time.monotonic() - started
    finally:
        cluster.nodes.resume("worker")
    assert hung.returncode == 70, out[-4000:]
    assert took < GATHER_TIMEOUT_S + 20, took
    assert f"node {WORKER_IP} did not answer within {GATHER_TIMEOUT_S} s" in out, out[-3000:]
    found = diagnose("head", {"verl-lab-train.service": out}, None, failed=True)
    hits = [f for f in found.findings if f.rule == "cluster-node-hung"]
    assert hits and any(WORKER_IP in line for line in hits[0].evidence), found.to_json()
    print(f"a hung node ended the after-run in {took:.1f} s (gather timeout {GATHER_TIMEOUT_S} s)")
    again = cluster.export()                                 # the node is back: the next after-run goes on
    out_again = _finish(again)
    assert again.returncode == 0, out_again[-4000:]
    assert f"{RANK1} from node {WORKER_IP}" in out_again and json.loads((cluster.step / "hf.proof.json").read_text())["ok"]
    assert _parts(cluster.disks["head"]) == []
