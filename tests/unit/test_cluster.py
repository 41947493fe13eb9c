"""Boxes that train together (tasks/cluster.py): the cluster setting, checked per host and across
hosts before any host changes; the network interface NCCL and Gloo use, from real
``ip -o route get`` outputs (tests/fixtures/facts/cluster.RouteToHead/); /etc/hosts such that the
hostname resolves to the node's address, from recorded lookups (cluster.HostnameLookup/) and checked
with glibc's own getent; the cluster plan by the weakest GPU; the Ray units rendered for a head and
a worker."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tasks import hostdata
from tasks.cluster import HOSTS_MARK, ClusterError, Interface, RayNode, choose_interface, cluster_wanted, hosts_file
from tasks.plan import GpuTarget, cluster_plan, doc_workload, make_plan, weakest_gpu
from tasks.settings import Cluster, SettingsError, check_clusters, load_settings

ROUTES = Path(__file__).resolve().parents[1] / "fixtures" / "facts" / "cluster.RouteToHead"
LOOKUPS = ROUTES.parent / "cluster.HostnameLookup"
P40 = GpuTarget("Tesla P40", "6.1", 24576, 1)
RTX3090 = GpuTarget("NVIDIA GeForce RTX 3090", "8.6", 24576, 1)
T4 = GpuTarget("Tesla T4", "7.5", 15360, 1)
LAB1 = {"name": "lab1", "head": "box1"}


def route_case(name: str) -> tuple[dict, str]:
    case = json.loads((ROUTES / f"{name}.json").read_text())
    return case["fact"], case["arg"]["address"]


# ------------------------------------------------------------------ the interface


@pytest.mark.parametrize("case, name, address, words", [
    ("direct", "eth0", "192.0.2.2", "leaves by eth0 (source"),
    ("via_gateway", "eth0", "192.0.2.2", "via the gateway 192.0.2.1"),
    ("the_head_itself", "eth0", "192.0.2.2", "this box is the head; eth0 holds 192.0.2.2"),
    ("loopback_lab", "lo", "127.0.0.2", "every node is on this machine"),
])
def test_interface_from_the_route_to_the_head(case, name, address, words):
    fact, head = route_case(case)
    chosen = choose_interface(fact["route"], fact["addrs"], head)
    assert (chosen.name, chosen.address) == (name, address) and words in chosen.reason


@pytest.mark.parametrize("case", ["no_route", "nothing"])
def test_no_route_to_the_head_is_refused_with_what_ip_said(case):
    fact, head = route_case(case)
    with pytest.raises(ClusterError, match=f"no route from this box to the head {head}") as exc:
        choose_interface(fact["route"], fact["addrs"], head)
    if case == "no_route":
        assert "Network is unreachable" in str(exc.value)


def test_loopback_is_never_chosen_for_a_head_other_boxes_must_reach():
    fact, _ = route_case("the_head_itself")
    with pytest.raises(ClusterError, match="no network interface holds it"):     # 10.1.1.1: on no interface
        choose_interface("local 10.1.1.1 dev lo src 10.1.1.1 uid 0 \\    cache <local>", fact["addrs"], "10.1.1.1")
    with pytest.raises(ClusterError, match="over the loopback interface"):
        choose_interface("10.1.1.1 dev lo src 127.0.0.1 uid 0", fact["addrs"], "10.1.1.1")
    with pytest.raises(ClusterError, match="no route"):
        choose_interface("unreachable 10.1.1.1 dev eth0", "", "10.1.1.1")


# ------------------------------------------------------------------ the hostname resolving to the node's address


def lookup_case(name: str) -> dict:
    return json.loads((LOOKUPS / f"{name}.json").read_text())["fact"]


def test_a_hostname_that_resolves_to_the_node_address_leaves_etc_hosts_alone():
    assert hosts_file(lookup_case("managed_line"), "10.0.0.5") == (None, "box1 resolves to 10.0.0.5")


def test_debians_127_0_1_1_gets_a_managed_line_first_and_its_own_line_kept_as_a_comment():
    debian = lookup_case("debian_127_0_1_1")
    text, why = hosts_file(debian, "10.0.0.5")
    assert why == "box1 resolved to 127.0.1.1, not the node's address 10.0.0.5"
    lines = text.splitlines()
    assert lines[0] == f"10.0.0.5\tbox1.lab.example box1  {HOSTS_MARK}"        # the FQDN stays the canonical name
    assert f"{HOSTS_MARK}, was: 127.0.1.1\tbox1.lab.example\tbox1" in lines
    others = [line for line in debian["hosts"].splitlines() if "box1" not in line]
    assert [line for line in lines if "box1" not in line] == others              # every other line, as it was
    assert text == lookup_case("managed_line")["hosts"]                         # what the box then had


def test_a_managed_line_with_an_old_address_is_replaced():
    before = lookup_case("managed_line")
    text, _ = hosts_file({**before, "resolves": ["10.0.0.5"]}, "10.0.0.6")
    assert text == before["hosts"].replace("10.0.0.5\t", "10.0.0.6\t")
    assert text.count(HOSTS_MARK) == 2 and text.count("box1.lab.example box1") == 1   # one managed line, one old


def test_only_the_hostnames_names_leave_a_shared_line():
    text, _ = hosts_file({"hostname": "box1", "resolves": ["127.0.0.1"], "hosts": "127.0.0.1 localhost box1\n"},
                         "10.0.0.5")
    assert text == f"10.0.0.5\tbox1  {HOSTS_MARK}\n{HOSTS_MARK}, was: 127.0.0.1 localhost box1\n127.0.0.1\tlocalhost\n"
    # resolved by DNS elsewhere, no line for it: the managed line only
    assert hosts_file({"hostname": "box1", "resolves": ["192.0.2.9"], "hosts": ""}, "10.0.0.5")[0] == \
        f"10.0.0.5\tbox1  {HOSTS_MARK}\n"


def test_a_loopback_node_address_never_touches_etc_hosts():
    text, why = hosts_file(lookup_case("debian_127_0_1_1"), "127.0.0.3")
    assert text is None and "loopback" in why and "one /etc/hosts" in why
    assert hosts_file(lookup_case("nothing"), "10.0.0.5") == (None, "/etc/hosts left as it is: the box's "
                                                                   "hostname could not be read")


def test_a_file_that_maps_the_name_right_but_resolves_wrong_is_refused():
    done = lookup_case("managed_line")
    with pytest.raises(ClusterError, match="hosts line of /etc/nsswitch.conf"):
        hosts_file({**done, "resolves": ["192.0.2.9"]}, "10.0.0.5")


def _getent(hosts: str, name: str) -> list[str]:
    """``getent ahostsv4 name`` with ``hosts`` as /etc/hosts, in a mount namespace of its own
    (this machine's /etc/hosts is never touched)."""
    import shutil
    import subprocess
    import tempfile

    if not shutil.which("unshare") or not shutil.which("getent"):
        pytest.skip("no unshare or getent here")
    with tempfile.NamedTemporaryFile("w", suffix=".hosts") as fh:
        fh.write(hosts)
        fh.flush()
        res = subprocess.run(["unshare", "-m", "sh", "-c", f"mount --bind {fh.name} /etc/hosts && "
                              f"getent ahostsv4 {name} | awk '!seen[$1]++ {{ print $1 }}'"],
                             capture_output=True, text=True)
    if res.returncode != 0:           # not root, or no mount namespaces here (the lookup's own rc is awk's)
        pytest.skip(f"no mount namespace here: {res.stderr.strip()}")
    return res.stdout.split()


@pytest.mark.parametrize("name", ["box1", "box1.lab.example"])
def test_glibc_answers_the_node_address_first_only_once_the_127_0_1_1_line_is_off(name):
    """Why the 127.0.1.1 line becomes a comment: with ``multi on`` (Debian's /etc/host.conf) glibc
    answers every matching line and sorts 127/8 first, even below a first line with the node's address."""
    debian = lookup_case("debian_127_0_1_1")["hosts"]
    assert _getent(debian, name) == ["127.0.1.1"]
    first_only = f"10.0.0.5\tbox1.lab.example box1\n{debian}"
    if Path("/etc/host.conf").exists() and "multi on" in Path("/etc/host.conf").read_text():
        assert _getent(first_only, name)[0] == "127.0.1.1"
    assert _getent(hosts_file(lookup_case("debian_127_0_1_1"), "10.0.0.5")[0], name) == ["10.0.0.5"]


# ------------------------------------------------------------------ the cluster plan


def test_a_p40_and_an_rtx3090_train_in_fp32_with_the_p40s_memory():
    plan = cluster_plan({"p40": P40, "rtx3090": RTX3090}, doc_workload())
    d = plan.to_dict()
    assert (d["train_dtype"], d["rollout"], d["attn_implementation"]) == ("fp32", "hf", "sdpa")
    assert d["gpu"] == {"name": "Tesla P40", "compute_capability": "6.1", "memory_mib": 24576, "count": 1}
    assert "trainer.nnodes=2" in d["overrides"] and "trainer.n_gpus_per_node=1" in d["overrides"]
    why = d["reasons"][0]
    assert why["setting"] == "cluster" and "Tesla P40 on p40, 6.1" in why["why"] and "24576 MiB on p40" in why["why"]
    assert d["predicted_peak_mib"] <= d["budget_mib"]
    # batches and FSDP sharding over both GPUs: less per GPU than the P40 alone
    assert d["predicted_peak_mib"] < make_plan(P40, doc_workload()).to_dict()["predicted_peak_mib"]


def test_memory_and_precision_can_come_from_different_boxes():
    gpu, why = weakest_gpu({"p40": P40, "t4": T4})
    assert (gpu.compute_capability, gpu.memory_mib) == ("6.1", 15360)
    assert gpu.name == "Tesla P40 (with Tesla T4's memory)" and "15360 MiB on t4" in why
    d = cluster_plan({"p40": P40, "t4": T4}, doc_workload()).to_dict()
    assert d["train_dtype"] == "fp32" and d["gpu"]["memory_mib"] == 15360 and d["predicted_peak_mib"] <= d["budget_mib"]


def test_uneven_gpu_counts_plan_the_smallest_count_and_say_so():
    two = GpuTarget("NVIDIA A100-SXM4-80GB", "8.0", 81920, 2)
    d = cluster_plan({"a": two, "b": GpuTarget(two.name, "8.0", 81920, 1)}, doc_workload()).to_dict()
    assert "trainer.n_gpus_per_node=1" in d["overrides"] and "trainer.nnodes=2" in d["overrides"]
    assert "other GPUs stay idle" in d["reasons"][0]["why"] and d["train_dtype"] == "bf16"


# ------------------------------------------------------------------ the setting


def settings(host: str = "box1", **data):
    return load_settings(host, data)


def test_default_every_box_trains_alone():
    s = settings()
    assert s.cluster is None and s.cluster_address is None
    assert check_clusters({"box1": s}) == ({}, [])


@pytest.mark.parametrize("value, key, words", [
    ({"name": "lab1"}, "cluster.head", "missing"),
    ({"head": "box1"}, "cluster.name", "missing"),
    ({"name": "Lab 1", "head": "box1"}, "cluster.name", "not a short lowercase name"),
    ({**LAB1, "port": 80}, "cluster.port", "not a port from 1024 to 65535"),
    ({**LAB1, "heads": "box1"}, "cluster.heads", "not a cluster key"),
    ("lab1", "cluster", "is not a mapping"),
])
def test_bad_cluster_values_name_host_key_and_fix(value, key, words):
    with pytest.raises(SettingsError) as exc:
        settings("box7", cluster=value)
    assert (exc.value.host, exc.value.key) == ("box7", key) and words in exc.value.problem and exc.value.fix


def test_bad_cluster_address():
    with pytest.raises(SettingsError, match="host box2: cluster_address: 'box1.lab' is not an IPv4 address"):
        settings("box2", cluster=LAB1, cluster_address="box1.lab")


def test_a_cluster_with_its_head_address():
    s = {"box1": settings("box1", cluster=LAB1, cluster_address="10.0.0.5"),
         "box2": settings("box2", cluster=LAB1), "alone": settings("alone")}
    clusters, problems = check_clusters(s)
    assert problems == []
    assert clusters == {"lab1": Cluster("lab1", "box1", "10.0.0.5", 6379, ("box1", "box2"))}
    assert clusters["lab1"].role("box2") == "worker" and clusters["lab1"].address == "10.0.0.5:6379"
    # the head's ssh_hostname, where it is an IP literal, is its address too
    s["box1"] = settings("box1", cluster=LAB1, ssh_hostname="10.0.0.9")
    assert check_clusters(s)[0]["lab1"].head_address == "10.0.0.9"


@pytest.mark.parametrize("data, host, key, words", [
    ({"box1": {"cluster": {"name": "lab1", "head": "box9"}, "cluster_address": "10.0.0.5"},
      "box2": {"cluster": {"name": "lab1", "head": "box9"}}}, "box1", "cluster.head",
     "'box9' is not a box of cluster 'lab1' (its boxes: box1, box2)"),
    ({"box1": {"cluster": LAB1, "cluster_address": "10.0.0.5"}, "box2": {"cluster": {**LAB1, "head": "box2"}}},
     "box2", "cluster", "differs from box1's"),
    ({"box1": {"cluster": LAB1, "ssh_hostname": "box1.lab"}, "box2": {"cluster": LAB1}}, "box1", "cluster_address",
     "the head of cluster 'lab1' has no address"),
])
def test_cluster_values_that_disagree_across_hosts(data, host, key, words):
    _, problems = check_clusters({h: settings(h, **d) for h, d in data.items()})
    assert len(problems) == 1 and (problems[0].host, problems[0].key) == (host, key), problems
    assert words in problems[0].problem and problems[0].fix


def test_one_box_in_two_clusters_fails_the_whole_inventory_before_any_host_changes(monkeypatch):
    from pyinfra.api import Inventory

    for name, value in (("_CHECKED", False), ("_CACHE", {}), ("_CLUSTERS", {})):
        monkeypatch.setattr(hostdata, name, value)
    inv = Inventory((["box1", "box2", "box3"], {}),
                    lab1=(["box1", "box2"], {"cluster": {"name": "lab1", "head": "box1"}}),
                    lab2=(["box2", "box3"], {"cluster": {"name": "lab2", "head": "box3"}}))
    with pytest.raises(hostdata.InventoryError) as exc:
        hostdata.check_inventory(list(inv))
    text = str(exc.value)
    assert "nothing was changed on any host" in text
    assert "host box2: cluster: the box is in two clusters (lab1: lab1, lab2: lab2)" in text
    assert "host box1: cluster_address: the head of cluster 'lab1' has no address" in text


# ------------------------------------------------------------------ the units


def node(host: str, role_address: Interface, **data) -> RayNode:
    cluster = Cluster("lab1", "box1", "127.0.0.2", 6380, ("box1", "box2", "box3"))
    s = settings(host, cluster={**LAB1, "port": 6380}, env_backend="venv", **data)
    return RayNode(s, cluster, role_address, 2, {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})


def test_head_and_worker_units_and_their_environment():
    lo = Interface("lo", "127.0.0.2", "the head's address is a loopback address: every node is on this machine")
    head = {w.path: w.content.decode() for w in cluster_wanted(node("box1", lo, cluster_address="127.0.0.2"))
            if w.content is not None}
    worker = {w.path: w.content.decode() for w in cluster_wanted(node("box2", lo, cluster_address="127.0.0.3"))
              if w.content is not None}
    unit = "/etc/systemd/system/verl-lab-ray.service"
    ray = "/opt/verl-lab/envs/verl/bin/ray"
    assert (f"ExecStart={ray} start --head --block --node-ip-address=127.0.0.2 --port=6380 --num-gpus=2 "
            "--temp-dir=/opt/verl-lab/ray/tmp") in head[unit]
    assert "ExecStartPre" not in head[unit] and "User=verl" in head[unit] and f"ExecStop={ray} stop" in head[unit]
    assert (f"ExecStart={ray} start --block --address=127.0.0.2:6380 --node-ip-address=127.0.0.3 "
            "--num-gpus=2") in worker[unit]
    assert f"until timeout 10 {ray} health-check --address 127.0.0.2:6380" in worker[unit] and "-ge 30" in worker[unit]
    assert "TimeoutStartSec=390" in worker[unit]      # systemd's 90 s default would cut the wait short
    assert "$$((n+1))" in worker[unit] and "Restart=on-failure" in worker[unit]   # $$: systemd's escape of $
    env = worker["/opt/verl-lab/train/ray.env"]
    for line in ("NCCL_SOCKET_IFNAME=lo", "GLOO_SOCKET_IFNAME=lo", "RAY_ADDRESS=127.0.0.2:6380",
                 "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True", "HF_ENDPOINT=https://"):
        assert line in env, env
    dropin = head["/etc/systemd/system/verl-lab-train.service.d/cluster.conf"]
    assert "EnvironmentFile=/opt/verl-lab/train/ray.env" in dropin and "ReadWritePaths=/opt/verl-lab/ray" in dropin


def test_the_heads_ray_unit_carries_the_trackers_environment_and_keys(tmp_path):
    """verl's Tracking runs in the TaskRunner, a Ray worker of the head: the head's ray.env has the trackers'
    environment (the training unit's does not reach a Ray worker on a cluster), and an online run's keys come
    from the keys file, the Ray unit's second EnvironmentFile, never ray.env; the workers get neither."""
    from tasks.cluster import head_tracking
    keys = tmp_path / "trackers.env"
    keys.write_text("WANDB_API_KEY=" + "k" * 40 + "\n")
    keys.chmod(0o600)
    lo = Interface("lo", "127.0.0.2", "every node is on this machine")
    data = {"artifact_mode": "direct", "tracking": {"trackers": ["tensorboard", "wandb"], "mode": "online",
                                                    "keys_file": str(keys)}}
    head = node("box1", lo, cluster_address="127.0.0.2", **data)
    head = RayNode(head.settings, head.cluster, lo, 2, head.plan_env, head_tracking(head.settings, "lab1-run-ppo"))
    files = {w.path: w.content.decode() for w in cluster_wanted(head) if w.content is not None}
    env, unit = files["/opt/verl-lab/train/ray.env"], files["/etc/systemd/system/verl-lab-ray.service"]
    for line in ("TENSORBOARD_DIR=/opt/verl-lab/tracking/tensorboard/lab1-run-ppo", "WANDB_MODE=online",
                 "WANDB_DIR=/opt/verl-lab/tracking/wandb"):
        assert line in env.splitlines(), env
    assert "k" * 40 not in env and "EnvironmentFile=-/opt/verl-lab/train/tracking-keys.env" in unit.splitlines()
    digest = env.rsplit("digest ", 1)[1].strip()
    keys.write_text("WANDB_API_KEY=" + "j" * 40 + "\n")          # a new key: ray.env changes, the unit restarts
    again = RayNode(head.settings, head.cluster, lo, 2, head.plan_env, head_tracking(head.settings, "lab1-run-ppo"))
    assert digest not in next(w.content.decode() for w in cluster_wanted(again) if w.path.endswith("ray.env"))
    worker = {w.path: w.content.decode() for w in cluster_wanted(node("box2", lo, cluster_address="127.0.0.3", **data))
              if w.content is not None}
    assert "TENSORBOARD_DIR" not in worker["/opt/verl-lab/train/ray.env"]
    assert "tracking-keys" not in worker["/etc/systemd/system/verl-lab-ray.service"]


# ------------------------------------------------------------------ the check before training (box side)


def test_cluster_check_names_the_node_and_what_differs():
    from verl_lab_box.cluster_check import compare

    same = {"host": "h", "python": "3.10.12", "torch": "2.6.0+cu118", "ray": "2.46.0", "verl": "0.5.0",
            "verl sources": "ab12", "model": "cd34", "data": "ef56"}
    nodes = [{"ip": "10.0.0.5", "gpus": 2, "fingerprint": {**same, "host": "head"}},
             {"ip": "10.0.0.6", "gpus": 2, "fingerprint": {**same, "host": "wk1"}},
             {"ip": "10.0.0.7", "gpus": 1, "fingerprint": {**same, "host": "wk2", "ray": "2.45.0", "model": "00ff"}}]
    assert compare(nodes[:2], "10.0.0.5", 2, 2) == []
    problems = compare(nodes, "10.0.0.5", 3, 2)
    assert problems == ["node 10.0.0.7 (wk2): 1 GPU(s), the plan uses 2 per node",
                        "node 10.0.0.7 (wk2): ray 2.45.0 differs from the head's 2.46.0",
                        "node 10.0.0.7 (wk2): model 00ff differs from the head's cd34"]
    missing = compare(nodes[:2], "10.0.0.5", 3, 2)
    assert missing[0].startswith("2 node(s) joined (10.0.0.5, 10.0.0.6), the plan trains on 3")


def test_cluster_check_names_a_node_whose_hostname_resolves_elsewhere():
    from verl_lab_box.cluster_check import RESOLVES, compare

    nodes = [{"ip": "10.0.0.5", "gpus": 1, "fingerprint": {"host": "head", "python": "3.10.12", RESOLVES: "10.0.0.5"}},
             {"ip": "10.0.0.6", "gpus": 1, "fingerprint": {"host": "wk1", "python": "3.10.12", RESOLVES: "127.0.1.1"}}]
    assert compare(nodes, "10.0.0.5", 2, 1) == ["node 10.0.0.6 (wk1): its hostname resolves to 127.0.1.1, not "
                                                "10.0.0.6: re-run deploy/cluster.py on it"]
    lab = [{**n, "ip": ip} for n, ip in zip(nodes, ("127.0.0.2", "127.0.0.3"), strict=True)]     # every node on one machine
    assert compare(lab, "127.0.0.2", 2, 1) == []


def test_cluster_check_fingerprints_files_and_packages(tmp_path):
    from verl_lab_box.cluster_check import fingerprint

    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    a = fingerprint(["pip"], str(tmp_path / "model"), [str(tmp_path / "nothing.parquet")])
    assert a["pip"] != "not installed" and a["data"] == "missing" and a["model"] != "missing"
    assert a["hostname resolves to"].count(".") == 3 or a["hostname resolves to"] == "nothing"
    (tmp_path / "model" / "config.json").write_text("{ }")
    assert fingerprint(["pip"], str(tmp_path / "model"), [])["model"] != a["model"]


def test_the_launchers_preflight_runs_the_cluster_check_only_for_a_cluster_plan(tmp_path):
    import sys
    from types import SimpleNamespace

    from verl_lab_box import train_launcher

    (tmp_path / "ray.env").write_text("# Ray\nRAY_ADDRESS=10.0.0.5:6379\n")
    (tmp_path / "cluster-check").write_text(
        "import os, sys\nprint('verl-lab cluster check FAILED:')\nprint('  node 10.0.0.7 (wk2): ray 2.45.0 differs "
        "from the head\\'s 2.46.0', os.environ['RAY_ADDRESS'])\nsys.exit(1)\n")
    launch = SimpleNamespace(plan_file=str(tmp_path / "plan.json"), env_python=sys.executable,
                             overrides=["trainer.nnodes=1"])
    preflight = train_launcher.preflight_module()
    rep = preflight.Report()
    preflight.check_cluster(rep, launch)
    assert rep.results == []                       # one box: nothing to check
    launch.overrides = ["trainer.nnodes=3"]
    preflight.check_cluster(rep, launch)
    assert rep.results == [("FAIL", "cluster", "node 10.0.0.7 (wk2): ray 2.45.0 differs from the head's 2.46.0 "
                                                "10.0.0.5:6379")]


def test_plan_cli_for_a_uniform_cluster(capsys):
    from tasks.plan import main

    assert main(["--gpu-name", "Tesla P40", "--compute-capability", "6.1", "--gpu-memory-mib", "24576",
                 "--gpus", "2", "--nodes", "4", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert "trainer.nnodes=4" in d["overrides"] and "trainer.n_gpus_per_node=2" in d["overrides"]
    assert d["gpu"]["count"] == 2 and d["reasons"][0]["value"] == "4 x 2 x Tesla P40"
