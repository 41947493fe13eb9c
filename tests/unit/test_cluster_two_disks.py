"""A cluster run's end on two Ray nodes whose disks are their own (issue 34), on CPU.

Two real Ray 2.46 nodes on 127.0.0.8 (head) and 127.0.0.9 (worker) of this machine, each started as the
cluster stage's units start them (``ray start --head --block ...`` / ``ray start --block --address=...``) inside
a mount namespace of its own, where the lab's checkpoint folder and Ray's temp folder are that node's own
folders bind-mounted at the same paths: as on two boxes, a node's raylet, its workers and what they write
see that node's disk only (root only; nothing outside the test's folder is mounted over).

The real launcher (verl_lab_box/train_launcher.py), in the head's namespace with a plan for
``trainer.nnodes=2``, runs a stand-in of verl's main_ppo (tests/fixtures/standin_cluster_main_ppo.py) that
calls the patched verl 0.5.0 ``run_ppo`` (patch 0010 places the TaskRunner) with a stand-in TaskRunner whose
worker group (verl's RayWorkerGroup, one rank per node) trains a tiny Qwen2 on gloo and saves through verl's
own FSDPCheckpointManager, with verl's own ``RayPPOTrainer._save_checkpoint`` writing ``data.pt`` and the
tracker. The head is busy with an idle actor holding half its CPUs first, so Ray's default placement would
put the TaskRunner on the worker. Then the launcher's after-run, all real: ``cluster-gather`` copies rank 1's
shard from the worker over Ray, ``export.py`` merges with verl's model merger and proves, ``gsm8k_score.py``
scores the base model and the export on the head (HF engine, CPU).

Shown: the TaskRunner, the tracker and ``data.pt`` on the head's disk (none on the worker's); each node's
disk holds its own rank's shards (patch 0006 keeping 2 saves on each); the head ends with the proven export
and both scores, the worker's disk unchanged by them; a second after-run (``--export``) copies nothing
again; a worker whose shard is gone fails the after-run with exit 70 naming the rank, the node and what
each node holds. Not shown: NCCL, GPUs, two machines' network (both nodes are 127/8 on one host).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.fixtures.standins.hf_endpoint import tiny_gsm8k_parquet, write_tiny_model
from tests.lab.ray_nodes import RAY_ENV, Nodes, free_port, layout, left, place_gather

REPO = Path(__file__).resolve().parents[2]
LAUNCHER = REPO / "verl_lab_box" / "train_launcher.py"
# addresses of their own: the e2e cluster (127.0.0.2-4), the GPU harness test (127.0.0.6-7) and the gather test
# (127.0.0.11-12) start Ray heads too, and CI runs modules side by side
HEAD_IP, WORKER_IP = "127.0.0.8", "127.0.0.9"
STEPS, KEEP = 3, 2
# Ray's logical CPUs per node (the units give none: Ray counts the box's); 4 on this 2-core machine, so the head holds
# the idle actor's 2 (half: "busy", Ray's default placement then prefers the other node), the TaskRunner's 1 and its
# rank's bundle's 1 (verl's resource pool asks a CPU with each GPU)
CPUS, HEAD_LOAD = 4, 2

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None or shutil.which("nsenter") is None,
                                reason="each node's own disk is a mount namespace: root, unshare and nsenter")


@pytest.fixture(scope="module")
def cluster(verl_python, patched_verl_root, tmp_path_factory):
    """Two nodes with their own disks, a train dir on the head as the stages place it (plan.json for two
    nodes, ray.env, cluster-gather), a tiny model and GSM8K test file; yields a namespace of helpers."""
    from types import SimpleNamespace

    base, lab, train, disks = layout("vlc")
    (base / "tmp").mkdir()                      # the nodes' TMPDIR: short (socket paths), removed with base
    tmp = tmp_path_factory.mktemp("two-disks")
    tree = tmp / "verl"
    shutil.copytree(patched_verl_root / "verl", tree / "verl")
    shutil.copy(tree / "verl" / "trainer" / "main_ppo.py", tree / "verl" / "trainer" / "verl_main_ppo.py")
    shutil.copy(REPO / "tests" / "fixtures" / "standin_cluster_main_ppo.py", tree / "verl" / "trainer" / "main_ppo.py")
    model = write_tiny_model(tmp / "model")
    data = tiny_gsm8k_parquet(verl_python, tmp)
    port = free_port()
    ckpt = str(train / "checkpoints")
    overrides = [f"actor_rollout_ref.model.path={model}", "trainer.nnodes=2", "trainer.n_gpus_per_node=1",
                 f"trainer.default_local_dir={ckpt}", f"trainer.total_training_steps={STEPS}", "trainer.save_freq=1",
                 f"trainer.max_actor_ckpt_to_keep={KEEP}"]
    plan = {"overrides": overrides, "launch": {
        "host": "head", "plan_source": "test", "gpu": {"name": "CPU stand-in", "count": 1, "memory_mib": 1024},
        "predicted_peak_mib": 1, "overrides": [{"override": o, "why": "test"} for o in overrides],
        "paths": {"train_dir": str(train), "work_dir": str(lab / "work"), "checkpoint_dir": ckpt,
                  "env_file": str(train / "train.env"), "env_python": str(verl_python), "env_marker": "-",
                  "data_marker": "-", "data_files": [str(data / "test.parquet")], "model_dir": str(model)},
        "evaluation": {"test_file": str(data / "test.parquet"), "engine": "hf", "dtype": "float32", "batch": 4,
                       "prompt_len": 128, "max_new_tokens": 8, "tensor_parallel_size": 1}}}
    (train / "plan.json").write_text(json.dumps(plan))
    (train / "train.env").write_text("")
    place_gather(train, HEAD_IP, port)          # ray.env, cluster-gather and verl_lab_checkpoints.py
    env = {**os.environ, **RAY_ENV, "PATH": f"{Path(verl_python).parent}:{os.environ['PATH']}",
           "PYTHONPATH": str(tree), "HOME": str(tmp), "TMPDIR": str(base / "tmp")}   # verl's checkpoint locks
    nodes = Nodes(base, env, str(Path(verl_python).parent / "ray"))
    try:
        nodes.start_pair(disks, HEAD_IP, WORKER_IP, port, CPUS, str(verl_python))

        def launcher(*args, extra_env=None):
            # as the unit runs it: the system's Python, ray.env in its environment (the cluster drop-in)
            run_env = {**env, "RAY_ADDRESS": f"{HEAD_IP}:{port}", "VERL_LAB_NODE_IP": HEAD_IP, **(extra_env or {})}
            return nodes.in_head([sys.executable, str(LAUNCHER), "--plan", str(train / "plan.json"), *args], env=run_env)

        yield SimpleNamespace(base=base, disks=disks, ckpt=Path(ckpt), launcher=launcher, nodes=nodes, model=model)
    finally:
        nodes.stop()
        running = left(base)
        shutil.rmtree(base, ignore_errors=True)
        assert not running, running


def _files(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())


@pytest.fixture(scope="module")
def finished(cluster):
    """The launcher's run: verl's stand-in trains and saves, then the after-run on the head."""
    started = time.monotonic()
    res = cluster.launcher("--no-preflight", extra_env={"VERL_LAB_TEST_HEAD_LOAD": str(HEAD_LOAD)})
    print(f"launcher: {time.monotonic() - started:.1f} s")
    assert res.returncode == 0, res.stdout[-6000:] + res.stderr[-6000:]
    lines = [line for line in res.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, res.stdout[-6000:] + res.stderr[-3000:]          # the stand-in's own line: verl ran to its end
    result = json.loads(lines[-1][len("RESULT "):])
    return res, result


def test_the_taskrunner_and_its_tracker_are_on_the_head(cluster, finished):
    res, result = finished
    assert f"the driver's node {HEAD_IP} holds {HEAD_LOAD:.1f} CPU(s) of other work" in res.stdout
    assert result["taskrunner"]["node_ip"] == HEAD_IP, result
    assert sorted(r["node_ip"] for r in result["ranks"]) == [HEAD_IP, WORKER_IP]       # one rank per node
    head, worker = cluster.disks["head"] / "checkpoints", cluster.disks["worker"] / "checkpoints"
    assert (head / "latest_checkpointed_iteration.txt").read_text() == str(STEPS)
    assert (head / f"global_step_{STEPS}" / "data.pt").is_file()
    assert not (worker / "latest_checkpointed_iteration.txt").exists()
    assert not list(worker.glob("global_step_*/data.pt"))


def test_each_node_keeps_its_own_ranks_saves(cluster, finished):
    _, result = finished
    rank_of = {r["node_ip"]: r["rank"] for r in result["ranks"]}
    for role, ip in (("head", HEAD_IP), ("worker", WORKER_IP)):
        ckpt = cluster.disks[role] / "checkpoints"
        steps = sorted(int(p.name.split("_")[-1]) for p in ckpt.glob("global_step_*") if (p / "actor").is_dir())
        assert steps == list(range(STEPS - KEEP + 1, STEPS + 1)), (role, steps)        # patch 0006 on each disk
        own = f"model_world_size_2_rank_{rank_of[ip]}.pt"
        assert (ckpt / f"global_step_{STEPS}" / "actor" / own).is_file()
        assert (ckpt / f"global_step_{STEPS}" / "actor" / f"optim_world_size_2_rank_{rank_of[ip]}.pt").is_file()
    other = 1 - rank_of[WORKER_IP]
    assert not (cluster.disks["worker"] / "checkpoints" / f"global_step_{STEPS}" / "actor" /
                f"model_world_size_2_rank_{other}.pt").exists()


def test_the_head_gathers_exports_proves_and_scores_the_last_step(cluster, finished):
    res, result = finished
    rank_of = {r["node_ip"]: r["rank"] for r in result["ranks"]}
    head_actor = cluster.disks["head"] / "checkpoints" / f"global_step_{STEPS}" / "actor"
    worker_actor = cluster.disks["worker"] / "checkpoints" / f"global_step_{STEPS}" / "actor"
    shard = f"model_world_size_2_rank_{rank_of[WORKER_IP]}.pt"
    gathered = json.loads((head_actor / "verl-lab-gathered.json").read_text())
    copied = {c["name"]: c for c in gathered["copied"]}
    assert shard in copied and copied[shard]["from"] == WORKER_IP and gathered["head"] == HEAD_IP
    assert (head_actor / shard).read_bytes() == (worker_actor / shard).read_bytes()
    assert (head_actor / shard).stat().st_mtime_ns == (worker_actor / shard).stat().st_mtime_ns
    assert not any(n.startswith("optim_") for n in copied)            # the export reads the model shards only
    if rank_of[WORKER_IP] == 0:                                        # rank 0's side files came with it
        assert {"fsdp_config.json", "huggingface/config.json"} <= set(copied)
    step = head_actor.parent
    proof = json.loads((step / "hf.proof.json").read_text())
    assert proof["ok"] and proof["final"] and proof["world_size"] == 2 and proof["step"] == STEPS
    trained = json.loads((step / "hf.gsm8k.json").read_text())
    base = json.loads((cluster.disks["head"] / "checkpoints" / "gsm8k-base.json").read_text())
    assert (trained["rows"], trained["final"], base["label"]) == (12, True, "base")
    assert f"GSM8K {base['accuracy']:.4f} (base) -> {trained['accuracy']:.4f} (step {STEPS}) on 12 test prompts" in res.stdout
    assert json.loads((cluster.disks["head"] / "checkpoints" / "run-finished.json").read_text())["step"] == STEPS
    worker_files = _files(cluster.disks["worker"] / "checkpoints")
    assert not [f for f in worker_files if "/hf" in f or "gsm8k" in f or "gathered" in f], worker_files


def test_status_reads_the_model_and_score_on_the_heads_row(cluster, finished):
    """The status fact's own command and parser (tasks.facts.export.RunExports) on the head's disk, then the
    row's GSM8K words: the head's row carries the cluster's export and score; the worker's disk has none."""
    from tasks.facts.export import RunExports
    from tasks.status import gsm8k_summary, gsm8k_words

    fact = RunExports()
    read = cluster.nodes.in_head(["sh", "-c", fact.command(str(cluster.ckpt))])
    found = fact.process(read.stdout.splitlines())
    assert found["latest_step"] == STEPS and found["finished_step"] == STEPS
    summary = gsm8k_summary(found)
    assert summary["step"] == STEPS and summary["final"] is True and summary["trained"] is not None
    assert gsm8k_words(summary).endswith(f"@{STEPS}")
    worker = fact.process(subprocess.run(["sh", "-c", fact.command(str(cluster.disks["worker"] / "checkpoints"))],
                                         capture_output=True, text=True).stdout.splitlines())
    assert worker["latest_step"] is None and worker["exports"] == []


def test_a_second_after_run_copies_nothing_again(cluster, finished):
    res = cluster.launcher("--export", "--no-score")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "0 file(s), 0 bytes copied from 0 node(s) of 2" in res.stdout
    assert "already proven" in res.stdout


def test_a_worker_that_lost_its_shard_fails_the_after_run_by_name(cluster, finished):
    _, result = finished
    rank = {r["node_ip"]: r["rank"] for r in result["ranks"]}[WORKER_IP]
    shard = f"model_world_size_2_rank_{rank}.pt"
    for root in (cluster.disks["worker"], cluster.disks["head"]):
        actor = root / "checkpoints" / f"global_step_{STEPS}" / "actor"
        (actor / shard).rename(actor / (shard + ".moved"))
    try:
        res = cluster.launcher("--export", "--no-score")
    finally:
        for root in (cluster.disks["worker"], cluster.disks["head"]):
            actor = root / "checkpoints" / f"global_step_{STEPS}" / "actor"
            (actor / (shard + ".moved")).rename(actor / shard)
    assert res.returncode == 70, res.stdout[-3000:] + res.stderr[-3000:]
    assert f"{shard} of step {STEPS} is on no node (node {HEAD_IP} (" in res.stdout
    assert f"node {WORKER_IP} (" in res.stdout and "cannot be gathered on this head" in res.stderr
