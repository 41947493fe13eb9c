"""A Ray cluster of three lab boxes (issue 17): deploy/cluster.py makes a real Ray head and two
workers, each box on its own address (127.0.0.2-4: the boxes share the test machine's network,
so every address of 127/8 reaches them all), with real systemd units run by the train user.

Ray here: the real Ray 2.46.0 (verl 0.5.0's pin range) installed from the cached PyPI wheels
(tests/fixtures/standins/env.py's wheelhouse) into a plain venv at the env's prefix on each
box by this test's setup, not by the env stage (building three full envs takes too long here);
the units run ``<env_prefix>/bin/ray`` as they would in a real env. GPUs: the stand-in
nvidia-smi's count (1, 1 and 2), given to Ray as ``--num-gpus`` from the GPU fact.

Proven here: the cluster forms with 3 nodes and the declared GPUs; the environment NCCL/Gloo
and the launcher read (interface from the route to the head, RAY_ADDRESS); a second deploy
changes nothing; the head's unit restarted -> both workers rejoin; a stopped unit leaves no Ray
process; the boxes' /etc/hosts is left as it is (loopback node addresses); with the head stopped,
deploy/doctor.py on a worker names cluster-not-joined from its Ray unit's journal; a cluster run's last save, each
box holding its own ranks' shards, is gathered whole on the head by the launcher's after-run path (issue 34). Not proven
here: training across nodes (NCCL needs GPUs; the CPU torch stand-in is not in these venvs), the export and score after
the gather (tests/unit/test_cluster_two_disks.py runs them on two Ray nodes with their own disks), a real multi-host
network.
"""

from __future__ import annotations

import json
import time

import pytest

from tests.lab import BoxSpec
from tests.lab.box import free_port
from tests.lab.env_venv import ENV, install_env

HEAD, WK1, WK2 = "head", "wk1", "wk2"
ADDRESS = {HEAD: "127.0.0.2", WK1: "127.0.0.3", WK2: "127.0.0.4"}
GPUS = {"127.0.0.2": 1.0, "127.0.0.3": 1.0, "127.0.0.4": 2.0}
UNIT = "verl-lab-ray.service"
NODES = ("import json, ray; ray.init(address={addr!r}, _node_ip_address='127.0.0.2', log_to_driver=False); "
         "print(json.dumps([{{'ip': n['NodeManagerAddress'], 'gpus': n['Resources'].get('GPU', 0)}} "
         "for n in ray.nodes() if n['Alive']]))")


@pytest.fixture(scope="module")
def lab(lab_factory):
    lab = lab_factory([BoxSpec(HEAD, gpu="t4"), BoxSpec(WK1, gpu="p40"), BoxSpec(WK2, gpu="rtx3090", gpu_count=2)])
    install_env([lab.box(b) for b in (HEAD, WK1, WK2)], "ray==2.46.0")
    lab.cluster_port = free_port()
    return lab


def deploy(lab, deploy_file="deploy/cluster.py"):
    return lab.deploy(deploy_file, data={"cluster": {"name": "lab1", "head": HEAD, "port": lab.cluster_port}},
                      per_host={name: {"cluster_address": address} for name, address in ADDRESS.items()}, timeout=900)


def nodes(lab) -> list[dict]:
    code = NODES.format(addr=f"127.0.0.2:{lab.cluster_port}")
    res = lab.box(HEAD).ssh(f"cd /opt/verl-lab/home && {ENV}/bin/python -c \"{code}\"", user="verl", check=False,
                            timeout=120)
    try:
        return json.loads(res.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        return []


def wait_for_nodes(lab, timeout: float = 240) -> dict[str, float]:
    deadline, seen = time.monotonic() + timeout, {}
    while time.monotonic() < deadline:
        seen = {n["ip"]: n["gpus"] for n in nodes(lab)}
        if seen == GPUS:
            return seen
        time.sleep(3)
    journals = {b: lab.box(b).ssh(f"journalctl -u {UNIT} -n 30 --no-pager", check=False).stdout for b in ADDRESS}
    raise AssertionError(f"cluster nodes {seen} != {GPUS}:\n" + "\n".join(f"--- {b}\n{j}" for b, j in journals.items()))


@pytest.fixture(scope="module")
def converged(lab):
    res = deploy(lab)
    res.assert_ok()
    return res


def test_three_boxes_form_a_ray_cluster_with_their_gpus(lab, converged):
    started = time.monotonic()
    assert wait_for_nodes(lab) == GPUS
    print(f"cluster formed {time.monotonic() - started:.1f}s after the deploy")
    deadline = time.monotonic() + 60       # `ray status` is the autoscaler's view: it follows within seconds
    while True:
        status = lab.box(HEAD).ssh(f"{ENV}/bin/ray status --address 127.0.0.2:{lab.cluster_port}", user="verl").stdout
        if "0.0/4.0 GPU" in status or time.monotonic() > deadline:
            break
        time.sleep(3)
    assert "0.0/4.0 GPU" in status and status.split("Pending:")[0].count(" node_") == 3, status


def test_units_run_as_the_train_user_with_the_route_to_the_head(lab, converged):
    for name, address in ADDRESS.items():
        box = lab.box(name)
        unit = box.read_text(f"/etc/systemd/system/{UNIT}")
        assert f"--node-ip-address={address}" in unit and "User=verl" in unit
        assert ("--head" in unit) == (name == HEAD)
        env = box.read_text("/opt/verl-lab/train/ray.env")
        for line in ("NCCL_SOCKET_IFNAME=lo", "GLOO_SOCKET_IFNAME=lo", f"RAY_ADDRESS=127.0.0.2:{lab.cluster_port}"):
            assert line in env, env
        owners = box.ssh("ps -o user= -C raylet", check=False).stdout.split()
        assert owners == ["verl"], owners
        assert box.exists("/etc/systemd/system/verl-lab-train.service.d/cluster.conf")
        hosts = box.read_text("/etc/hosts")     # a loopback node: /etc/hosts as the box had it
        assert "verl-lab cluster" not in hosts and f"127.0.1.1\t{box.hostname} {name}" in hosts, hosts


def test_a_second_deploy_changes_nothing(lab, converged):
    res = deploy(lab)
    assert res.rc == 0 and res.changed == 0, res


def test_the_head_restarted_the_workers_rejoin(lab, converged):
    wait_for_nodes(lab)
    raylets = {name: lab.box(name).ssh("ps -o pid= -C raylet").stdout.split() for name in (WK1, WK2)}
    lab.box(HEAD).ssh(f"systemctl restart {UNIT}")
    started = time.monotonic()
    assert wait_for_nodes(lab, timeout=300) == GPUS
    print(f"workers rejoined {time.monotonic() - started:.1f}s after the head's restart")
    for name in ADDRESS:       # one raylet per box: the old sessions are gone
        assert len(lab.box(name).ssh("ps -o pid= -C raylet", check=False).stdout.split()) == 1
    for name in (WK1, WK2):    # the workers' raylets are new ones: they joined the new head
        assert lab.box(name).ssh("ps -o pid= -C raylet").stdout.split() != raylets[name]


def test_a_stopped_unit_leaves_no_ray_process(lab, converged):
    box = lab.box(WK2)
    box.ssh(f"systemctl stop {UNIT}")
    assert box.ssh("ps -u verl -o pid=,args=", check=False).stdout.strip() == ""
    box.ssh(f"systemctl start {UNIT}")
    assert wait_for_nodes(lab) == GPUS


def test_the_training_stage_plans_for_the_cluster(lab, converged):
    res = deploy(lab, "deploy/train.py")
    res.assert_ok()
    plans = {name: json.loads(lab.box(name).read_text("/opt/verl-lab/train/plan.json")) for name in ADDRESS}
    assert len({json.dumps(p["overrides"]) for p in plans.values()}) == 1       # one plan on every node
    plan = plans[HEAD]
    assert "trainer.nnodes=3" in plan["overrides"] and "trainer.n_gpus_per_node=1" in plan["overrides"]
    assert plan["train_dtype"] == "fp32" and plan["rollout"] == "hf"          # the P40 on wk1 decides
    assert plan["gpu"]["memory_mib"] == 15360                                  # the T4's memory on the head
    assert plan["reasons"][0]["setting"] == "cluster" and "other GPUs stay idle" in plan["reasons"][0]["why"]
    enabled = {name: lab.box(name).ssh("systemctl is-enabled verl-lab-train.service", check=False).stdout.strip()
               for name in ADDRESS}
    assert enabled == {HEAD: "enabled", WK1: "disabled", WK2: "disabled"}      # only the head's unit trains
    env_files = lab.box(HEAD).ssh("systemctl show -p EnvironmentFiles verl-lab-train.service").stdout
    assert "/opt/verl-lab/train/ray.env" in env_files, env_files


CHECK = ("set -a; . /opt/verl-lab/train/ray.env; set +a; cd /opt/verl-lab/home; "
         f"exec {ENV}/bin/python /opt/verl-lab/train/cluster-check --plan /opt/verl-lab/train/plan.json")

LAUNCHER_CHECK = "runuser -u verl -- /usr/bin/python3 /opt/verl-lab/train/train-launcher --check"


def test_the_cluster_check_passes_then_refuses_a_node_with_another_env(lab, converged):
    wait_for_nodes(lab)
    head = lab.box(HEAD)
    ok = head.ssh(CHECK, user="verl", check=False, timeout=300)
    assert ok.returncode == 0 and "verl-lab cluster check passed: 3 nodes x 1 GPU(s)" in ok.stdout, ok
    launcher = head.ssh(LAUNCHER_CHECK, check=False, timeout=300).stdout     # the launcher's preflight runs it too
    assert "  ok    cluster: verl-lab cluster check passed: 3 nodes" in launcher, launcher
    assert "  FAIL  gpu:" not in launcher, launcher       # the plan is for the weakest GPU, not this box's T4
    # wk1's env gets another verl (a package of that name where the others have none)
    site = lab.box(WK1).ssh(f"{ENV}/bin/python -c 'import sysconfig; print(sysconfig.get_paths()[\"purelib\"])'"
                            ).stdout.strip()
    lab.box(WK1).ssh(f"mkdir -p {site}/verl && echo 'PATCHED = 1' > {site}/verl/__init__.py")
    try:
        bad = head.ssh(CHECK, user="verl", check=False, timeout=300)
        refused = head.ssh(LAUNCHER_CHECK, check=False, timeout=300)
    finally:
        lab.box(WK1).ssh(f"rm -rf {site}/verl")
    assert bad.returncode == 1 and "verl-lab cluster check FAILED" in bad.stdout, bad
    lines = [line for line in bad.stdout.splitlines() if line.startswith("  node ")]
    assert lines and all(line.startswith(f"  node {ADDRESS[WK1]} ({lab.box(WK1).hostname})") for line in lines), lines
    assert any("verl sources" in line for line in lines), lines
    assert refused.returncode == 1 and f"  FAIL  cluster: node {ADDRESS[WK1]} (" in refused.stdout, refused.stdout


STEP_DIR = "/opt/verl-lab/train/checkpoints/global_step_2"
LISTING_EXPORTER = """import os, sys
args = dict(zip(sys.argv[1::2], sys.argv[2::2]))
actor = os.path.join(args["--checkpoint-dir"], "global_step_" + args["--step"], "actor")
print("EXPORTER SEES " + " ".join(sorted(os.path.relpath(os.path.join(r, n), actor) for r, _, f in os.walk(actor) for n in f)))
"""


def _sha256s(box, names) -> dict[str, str]:
    out = box.ssh(f"cd {STEP_DIR}/actor && sha256sum {' '.join(names)}", user="verl").stdout
    return {line.split()[1]: line.split()[0] for line in out.splitlines()}


def test_a_finished_cluster_runs_last_save_is_gathered_on_the_head(lab, converged):
    """Issue 34: each box keeps its own ranks' shards on its own disk (here rank 0 with fsdp_config.json and
    huggingface/ on wk1, as when the head's address is not the lowest; one shard larger than the gather's 64 MiB
    reads); the head's launcher (`train-launcher --export`, the after-run's path, as the train user) runs the
    placed cluster-gather, which copies what the head lacks over the boxes' Ray, byte-identical, the optimizer
    shards left where they are, then hands the whole folder to the exporter (a stand-in that lists it: the real
    export needs torch, not in these venvs; it runs on the head of tests/unit/test_cluster_two_disks.py). A worker
    whose shard is gone: exit 70, the file and what every node holds named."""
    wait_for_nodes(lab)
    head = lab.box(HEAD)
    big = (64 << 20) + 12345
    saves = {WK1: {"model_world_size_3_rank_0.pt": 3 << 20, "optim_world_size_3_rank_0.pt": 1 << 20,
                   "fsdp_config.json": 40, "huggingface/config.json": 700, "huggingface/tokenizer.json": 9000},
             HEAD: {"model_world_size_3_rank_1.pt": 3 << 20, "optim_world_size_3_rank_1.pt": 1 << 20},
             WK2: {"model_world_size_3_rank_2.pt": big, "optim_world_size_3_rank_2.pt": 1 << 20}}
    for name, files in saves.items():
        lab.box(name).ssh(f"rm -rf {STEP_DIR} && mkdir -p {STEP_DIR}/actor/huggingface && cd {STEP_DIR}/actor && "
                          + " && ".join(f"head -c {size} /dev/urandom > {f}" for f, size in files.items()), user="verl")
    head.ssh(f"echo 2 > {STEP_DIR}/../latest_checkpointed_iteration.txt", user="verl")
    exporter = "/opt/verl-lab/train/verl_lab_export.py"
    head.ssh(f"cp -p {exporter} {exporter}.real")
    head.write_text(exporter, LISTING_EXPORTER, mode="644")
    launcher = "runuser -u verl -- /usr/bin/python3 /opt/verl-lab/train/train-launcher --export --no-score"
    try:
        started = time.monotonic()
        res = head.ssh(launcher, check=False, timeout=600)
        seconds = time.monotonic() - started
        copied = {n: _sha256s(lab.box(name), [n])[n] for name, files in saves.items() if name != HEAD
                  for n in files if not n.startswith("optim_")}
        on_head = _sha256s(head, sorted(copied))
        lab.box(WK2).ssh(f"mv {STEP_DIR}/actor/model_world_size_3_rank_2.pt /tmp/r2")
        head.ssh(f"rm {STEP_DIR}/actor/model_world_size_3_rank_2.pt")
        lost = head.ssh(launcher, check=False, timeout=600)
        lab.box(WK2).ssh(f"mv /tmp/r2 {STEP_DIR}/actor/model_world_size_3_rank_2.pt")
    finally:
        head.ssh(f"mv {exporter}.real {exporter}")
    print(f"gathered in {seconds:.1f} s:\n{res.stdout[-2000:]}")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert on_head == copied                                                       # byte-identical on the head
    listed = next(line for line in res.stdout.splitlines() if line.startswith("EXPORTER SEES ")).split()[2:]
    assert [n for n in listed if n.startswith("model_")] == [f"model_world_size_3_rank_{r}.pt" for r in range(3)]
    assert {"fsdp_config.json", "huggingface/config.json", "huggingface/tokenizer.json",
            "verl-lab-gathered.json"} <= set(listed)
    assert not {"optim_world_size_3_rank_0.pt", "optim_world_size_3_rank_2.pt"} & set(listed)
    record = json.loads(head.read_text(f"{STEP_DIR}/actor/verl-lab-gathered.json"))
    assert {c["name"]: c["from"] for c in record["copied"]} == {
        "model_world_size_3_rank_0.pt": ADDRESS[WK1], "fsdp_config.json": ADDRESS[WK1],
        "huggingface/config.json": ADDRESS[WK1], "huggingface/tokenizer.json": ADDRESS[WK1],
        "model_world_size_3_rank_2.pt": ADDRESS[WK2]}
    assert record["bytes"] == (3 << 20) + 40 + 700 + 9000 + big and record["head"] == ADDRESS[HEAD]
    assert lost.returncode == 70, lost.stdout[-3000:] + lost.stderr[-3000:]
    assert (f"verl-lab cluster gather FAILED (step 2, head {ADDRESS[HEAD]}): model_world_size_3_rank_2.pt of step 2 "
            f"is on no node (node {ADDRESS[HEAD]} (") in lost.stdout
    assert f"node {ADDRESS[WK2]} ({lab.box(WK2).hostname}): ranks none" in lost.stdout
    assert "EXPORTER SEES" not in lost.stdout and "cannot be gathered on this head" in lost.stderr


def test_the_doctor_names_a_worker_that_lost_its_head_from_its_ray_journal(lab, converged, tmp_path):
    """The head's unit stopped: wk1's raylet gives up (20 s), its unit starts again and says it has
    no head at its first try; deploy/doctor.py on wk1 reads that unit's journal (since it was last
    active) and names cluster-not-joined, seen in that unit."""
    wait_for_nodes(lab)
    from tasks.facts.logs import BoxLogs

    head, worker = lab.box(HEAD), lab.box(WK1)
    logs = BoxLogs().command("/opt/verl-lab/logs/*.log", [UNIT])         # what the doctor reads
    head.ssh(f"systemctl stop {UNIT}")
    try:
        started, deadline, journal = time.monotonic(), time.monotonic() + 180, ""
        while "verl-lab: no Ray head at" not in journal and time.monotonic() < deadline:
            time.sleep(3)
            journal = worker.ssh(logs, check=False).stdout
        print(f"wk1 said it has no head {time.monotonic() - started:.1f}s after the head stopped:\n{journal}")
        path = tmp_path / "lab.json"
        res = lab.deploy("deploy/doctor.py", data={"doctor_json": str(path)}, hosts=[WK1], mode="text")
    finally:
        head.ssh(f"systemctl start {UNIT}")
    assert res.rc == 0 and res.changed == 0, res.tail()
    (report,) = json.loads(path.read_text())["hosts"]
    found = {f["rule"]: f for f in report["findings"]}
    assert report["failed"] and "cluster-not-joined" in found, report
    assert found["cluster-not-joined"]["source"] == UNIT
    assert f"seen ({UNIT}): verl-lab: no Ray head at 127.0.0.2:{lab.cluster_port} " in res.output, res.output
