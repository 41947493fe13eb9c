"""The GPU harness on several GPUs and on two Ray nodes of one host (issue 27; bench/gpu: ppo_profiles.py,
run_profile.py, ray_nodes.py, ppo_results.py, run_multi.sh), checked here before a two-GPU device call.

Plumbing, with the product's own code: the profiles render the plans deploy/train.py makes for a box of two
cards and for a Ray cluster of two boxes (tasks.plan.cluster_plan), and the cluster stage's units, ray.env
and cluster-check for each node; the harness reads the units' commands as systemd would, refuses a profile the
machine has too few GPUs for, stops a cluster whose preflight fails or whose node ends while it forms (stand-ins
of the preflight and of `ray start`), resumes an export profile without exporting its first run, and sums up
each rank's peak against the per-GPU prediction and the scaling ratios from run records.

Behaviour, with real Ray 2.46 and verl 0.5.0's own classes on CPU: two Ray nodes on 127.0.0.6 and 127.0.0.7 of
this machine, formed by the rendered units' commands (each node with its own CUDA_VISIBLE_DEVICES and one
stand-in GPU resource), pass the launcher's cluster preflight (the real cluster-check), and the real launcher
runs a stand-in of verl's main_ppo (tests/fixtures/standin_main_ppo.py) that places verl's worker group on the
cluster (ResourcePoolManager, RayWorkerGroup): one rank per node, each on its node's GPU id, a Gloo all-reduce
between them over lo; no process is left after.

Not shown here: anything on a GPU (NCCL, the allocator cap with two devices, the memory, the speed): that is
the device calls (docs/training-runs.md, "Pending: issue 27").
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

import pytest

from tests.unit.test_gpu_export_harness import _module

REPO = Path(__file__).resolve().parents[2]
GPU = REPO / "bench" / "gpu"
MULTI = ("p40-1gpu", "p40-2gpu", "gtx1080-1gpu", "gtx1080-2gpu", "p40-2nodes", "p40-2nodes-socket",
         "gtx1080-2gpu-export")



@pytest.fixture(scope="module")
def rendered(tmp_path_factory):
    out = tmp_path_factory.mktemp("profiles")
    _module("ppo_profiles").render(list(MULTI), out, "HEAD")
    return out


def _record(rendered: Path, name: str) -> tuple[dict, dict]:
    return (json.loads((rendered / name / "profile.json").read_text()),
            json.loads((rendered / name / "train" / "plan.json").read_text()))


def _overrides(plan: dict) -> dict[str, str]:
    return dict(o.split("=", 1) for o in plan["overrides"])


# ------------------------------------------------------------------ the profiles


def test_the_multi_profiles_are_the_issues_runs():
    profiles = _module("ppo_profiles")
    by = profiles.BY_NAME
    assert [p.name for p in profiles.MULTI_PROFILES] == list(MULTI)
    for name in MULTI:
        p = by[name]
        assert p.steps == 2 and p.capped and p.code == "current" and p.rollout_engine == "auto"
        # what the issue asks for (2 GPUs, 2 nodes: 2 steps and validation); the one-GPU baselines give prompts/s
        # over step 2, which leaves validation out anyway; the export profile's second run exports and scores
        assert p.validate == (p.gpus * p.nodes == 2 and not p.export)
        if p.compare_with:                       # the baseline: the same card, half the GPUs or one box
            base = by[p.compare_with]
            assert (base.gpu_name, base.memory_mib) == (p.gpu_name, p.memory_mib)
            assert base.gpus * base.nodes in (1, 2) and p.gpus * p.nodes == 2 and base.nodes == 1
    assert (by["p40-2nodes"].gpus, by["p40-2nodes"].nodes) == (1, 2)
    assert dict(by["p40-2nodes-socket"].env)["NCCL_P2P_DISABLE"] == "1" and "NCCL_P2P_DISABLE" not in dict(
        by["p40-2nodes"].env)


@pytest.mark.parametrize("name,gpus,rung,strategy", [("p40-2gpu", 2, "ppo", "fsdp"), ("p40-1gpu", 1, "ppo", "fsdp"),
                                                      ("gtx1080-2gpu", 2, "grpo-cpu-offload", "fsdp2"),
                                                      ("gtx1080-1gpu", 1, "grpo-cpu-offload", "fsdp2")])
def test_a_box_profile_renders_the_plan_for_its_gpu_count(rendered, name, gpus, rung, strategy):
    """The plan of a box of ``gpus`` cards as deploy/train.py makes it: n_gpus_per_node, the per-GPU batch
    (a 2-GPU plan's HF chunk is its half of the step's sequences), the card's cap; 2 steps, validation at the last
    on two GPUs (verl's test_freq), none on the one-GPU baseline (the harness's trainer.test_freq=-1 after the plan's)."""
    profile, plan = _record(rendered, name)
    o = _overrides(plan)
    assert profile["gpus"] == gpus and plan["gpu"]["count"] == gpus and plan["rung"] == rung
    assert (o["trainer.n_gpus_per_node"], o["trainer.nnodes"]) == (str(gpus), "1")
    assert o.get("actor_rollout_ref.actor.strategy", "fsdp") == strategy
    assert o["trainer.total_training_steps"] == "2" and int(o["trainer.test_freq"]) > 0
    assert ("trainer.test_freq=-1" in profile["extra_overrides"]) == (gpus == 1)
    assert "trainer.save_freq=-1" in profile["extra_overrides"]
    assert profile["cap_mib"] == profile["memory_mib"] - _module("ppo_profiles").OUTSIDE_TORCH_MIB
    sequences = int(o["data.train_batch_size"]) * int(o["actor_rollout_ref.rollout.n"])
    assert plan["micro_batches"]["rollout"] <= sequences // gpus
    if gpus == 2:
        assert dict(profile["env"])["NCCL_DEBUG"] == "INFO" and profile["compare_with"] == name.replace("2gpu", "1gpu")


def test_two_cards_predict_less_per_gpu_than_one(rendered):
    one, two = _record(rendered, "p40-1gpu")[1], _record(rendered, "p40-2gpu")[1]
    assert two["predicted_peak_mib"] < one["predicted_peak_mib"]
    assert _overrides(two)["data.train_batch_size"] == _overrides(one)["data.train_batch_size"]   # prompts/s compare


def test_the_cluster_profile_is_the_two_gpu_plan_split_over_two_nodes(rendered):
    """tasks.plan.cluster_plan: make_plan at the cluster's world size, then verl's node split; everything else
    (batches, micro-batches, precision) is the 2-GPU box's plan, so the step times compare."""
    profile, plan = _record(rendered, "p40-2nodes")
    box = _record(rendered, "p40-2gpu")[1]
    o, b = _overrides(plan), _overrides(box)
    assert (o["trainer.n_gpus_per_node"], o["trainer.nnodes"]) == ("1", "2") and plan["gpu"]["count"] == 1
    differ = {k for k in set(o) | set(b) if o.get(k) != b.get(k)}
    # the paths, and the run's name (the tracking setting names a run by its box: tasks/tracking/setting.py)
    assert o["trainer.experiment_name"] != b["trainer.experiment_name"]
    assert {k for k in differ if "/tmp/vl/" not in o.get(k, "") + b.get(k, "")} == {"trainer.n_gpus_per_node",
                                                                                    "trainer.nnodes",
                                                                                    "trainer.experiment_name"}
    assert plan["predicted_peak_mib"] == box["predicted_peak_mib"] and plan["reasons"][0]["setting"] == "cluster"


def test_the_cluster_profile_carries_the_cluster_stages_files_for_each_node(rendered):
    ray_nodes = _module("ray_nodes")
    profile, _ = _record(rendered, "p40-2nodes")
    cluster = profile["cluster"]
    head, worker = cluster["nodes"]
    assert (head["role"], head["address"], head["cuda_visible_devices"]) == ("head", "127.0.0.2", "0")
    assert (worker["role"], worker["address"], worker["cuda_visible_devices"]) == ("worker", "127.0.0.3", "1")
    assert cluster["address"] == "127.0.0.2:6379" and cluster["interface"] == "lo"
    ray = "/tmp/vl/p40-2nodes/env/bin/ray"
    h = ray_nodes.unit_commands((rendered / "p40-2nodes" / head["dir"] / "verl-lab-ray.service").read_text())
    w = ray_nodes.unit_commands((rendered / "p40-2nodes" / worker["dir"] / "verl-lab-ray.service").read_text())
    assert h.pre == [] and h.start == [ray, "start", "--head", "--block", "--node-ip-address=127.0.0.2", "--port=6379",
                                       "--num-gpus=1", "--temp-dir=/tmp/vl/p40-2nodes/ray/tmp", "--include-dashboard=false",
                                       "--disable-usage-stats"]
    assert w.start == [ray, "start", "--block", "--address=127.0.0.2:6379", "--node-ip-address=127.0.0.3", "--num-gpus=1",
                       "--disable-usage-stats"]
    assert w.pre[0][:2] == ["/bin/sh", "-c"] and "n=$((n+1))" in w.pre[0][2]      # systemd's $$ read as $
    assert h.stop == [ray, "stop"] and h.env_file == "/tmp/vl/p40-2nodes/train/ray.env"
    assert h.cwd == "/tmp/vl/p40-2nodes/home"
    for node in (head, worker):
        env = ray_nodes.read_env_file(rendered / "p40-2nodes" / node["dir"] / "ray.env")
        assert (env["NCCL_SOCKET_IFNAME"], env["GLOO_SOCKET_IFNAME"]) == ("lo", "lo")
        assert env["RAY_ADDRESS"] == "127.0.0.2:6379" and env["VERL_LAB_NODE_IP"] == node["address"]
        assert (rendered / "p40-2nodes" / node["dir"] / "cluster-check").read_bytes() == (
            REPO / "verl_lab_box" / "cluster_check.py").read_bytes()


def test_verl_accepts_every_multi_run_as_the_launcher_passes_it(rendered, verl_python, patched_verl_root, tmp_path):
    """verl 0.5.0's own checks (tests/fixtures/verl_plan_check.py: the trainer's _validate_config, the workers'
    batch normalisation on as many gloo ranks as the run has GPUs, the HF rollout's chunking) on each profile's
    overrides as the launcher passes them: the plan's, then the harness's after ``--`` (a resume profile's second
    run: the whole run). A batch that does not split over the GPUs would end the device call here instead."""
    from tests.unit.test_verl_validation import run_plan_check

    items = []
    for name in MULTI:
        profile, plan = _record(rendered, name)
        launched = [o["override"] for o in plan["launch"]["overrides"]]           # what the launcher reads
        items.append({"label": name, "overrides": launched + profile["extra_overrides"],
                      "n_gpus": profile["gpus"] * profile["nodes"], "train_rows": 2048, "val_rows": 64})
    found = run_plan_check(verl_python, patched_verl_root, items, tmp_path)
    for item in items:
        r = found[item["label"]]
        assert "first_error" not in r, r
        o = dict(line.split("=", 1) for line in item["overrides"])       # the last value of a key wins, as in Hydra
        assert r["total_training_steps"] == 2
        assert r["workers"]["actor_mini_per_gpu"] == (int(o["actor_rollout_ref.actor.ppo_mini_batch_size"])
                                                      * int(o["actor_rollout_ref.rollout.n"]) // item["n_gpus"])
        train = r["hf_chunks"]["train"]
        assert sum(train) == int(o["data.train_batch_size"]) * int(o["actor_rollout_ref.rollout.n"]) // item["n_gpus"]


def test_unit_commands_refuse_what_the_harness_cannot_run_as_systemd_would():
    ray_nodes = _module("ray_nodes")
    unit = "[Unit]\nDescription=x\n[Service]\nExecStart=/bin/echo ${HOME}\n"
    with pytest.raises(ray_nodes.NodeError, match="expands an environment variable"):
        ray_nodes.unit_commands(unit)
    with pytest.raises(ray_nodes.NodeError, match="no ExecStart"):
        ray_nodes.unit_commands("[Service]\nExecStop=/bin/true\n")
    got = ray_nodes.unit_commands("[Install]\nExecStart=/bin/false\n[Service]\nExecStart=/bin/echo '$$1 a'\n"
                                  "EnvironmentFile=-/etc/x.env\n")
    assert got.start == ["/bin/echo", "$1 a"] and got.env_file == "/etc/x.env"


def test_the_workers_start_waits_for_its_head_as_the_unit_says(rendered, tmp_path):
    """The worker unit's ExecStartPre, run as the harness runs it, against a stand-in `ray` whose health-check
    fails once: the loop tries again 2 s later and says so at its first try (what the doctor reads)."""
    ray_nodes = _module("ray_nodes")
    profile, _ = _record(rendered, "p40-2nodes")
    text = (rendered / "p40-2nodes" / profile["cluster"]["nodes"][1]["dir"] / "verl-lab-ray.service").read_text()
    stub = tmp_path / "ray"
    stub.write_text(f"#!/bin/sh\necho \"$@\" >> {tmp_path}/calls\n[ -f {tmp_path}/up ] && exit 0\n"
                    f"touch {tmp_path}/up\nexit 1\n")
    stub.chmod(0o755)
    pre = ray_nodes.unit_commands(text.replace("/tmp/vl/p40-2nodes/env/bin/ray", str(stub))).pre[0]
    res = subprocess.run(pre, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and "no Ray head at 127.0.0.2:6379 yet (try 1 of 30)" in res.stderr
    assert (tmp_path / "calls").read_text().splitlines() == ["health-check --address 127.0.0.2:6379"] * 2


# ------------------------------------------------------------------ run_profile's control flow


def test_a_profile_needing_more_gpus_than_the_machine_has_is_refused_before_anything(rendered, tmp_path):
    payload = tmp_path / "payload"
    shutil.copytree(rendered / "p40-2gpu", payload / "profiles" / "p40-2gpu")
    record = payload / "profiles" / "p40-2gpu" / "profile.json"
    record.write_text(json.dumps({**json.loads(record.read_text()), "lab_root": str(tmp_path / "vl" / "p40-2gpu")}))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/bin/sh\n[ \"$1\" = -L ] && echo 'GPU 0: NVIDIA H200 (UUID: GPU-0a1b)'\n")
    smi.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    res = subprocess.run([sys.executable, str(GPU / "run_profile.py"), "p40-2gpu", "--out", str(tmp_path / "runs"),
                          "--payload", str(payload)], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, res.stdout + res.stderr
    run = json.loads((tmp_path / "runs" / "p40-2gpu" / "run.json").read_text())
    assert run["refused"] == "the profile needs 2 GPUs, nvidia-smi lists 1"
    assert not (tmp_path / "vl").exists()                 # no lab_root laid out


def test_an_export_profile_resumed_exports_only_when_its_whole_run_ends(rendered):
    run_profile = _module("run_profile")
    profile, _ = _record(rendered, "gtx1080-2gpu-export")
    assert profile["resume_after"] == 1 and profile["export"] is True and profile["gpus"] == 2
    cmd = run_profile.command(profile, Path("/tmp/vl/gtx1080-2gpu-export"), {})
    first, second = run_profile.resume_runs(cmd, 1, export=True)
    assert first[2:4] == ["--no-preflight", "--no-export"] and first[-2:] == ["trainer.total_training_steps=1",
                                                                               "trainer.save_freq=1"]
    assert second == cmd and "--no-export" not in second and "trainer.save_freq=1" in second   # a save at step 2
    assert run_profile.resume_runs(cmd, 1, export=False)[0][2:4] == ["--no-preflight", "--"]


# ------------------------------------------------------------------ two Ray nodes for real (CPU)


def _free_port() -> int:
    """A port free on every address, below Linux's ephemeral range (32768 up): Ray's GCS listens on all addresses, and
    a port the kernel hands out for other tests' outgoing connections (ssh to the lab's boxes) can be taken again
    between this check and the head's bind."""
    from tests.lab.box import free_port
    return free_port("0.0.0.0", 31999)


@pytest.fixture
def ray_payload(verl_python, patched_verl_root, tmp_path):
    """p40-2nodes rendered with a short lab_root (Ray's socket paths must stay under 107 bytes) and a free port;
    a payload with stand-in data files and model; a verl tree whose main_ppo is the stand-in."""
    base = Path(tempfile.mkdtemp(prefix="vl", dir="/tmp"))
    payload = tmp_path / "payload"
    _render_cluster_profile(payload, base)
    (payload / "data").mkdir()
    for name in ("train.parquet", "test.parquet", "val_small.parquet"):
        (payload / "data" / name).write_text(name)
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    tree = tmp_path / "trees" / "current"
    shutil.copytree(patched_verl_root / "verl", tree / "verl")
    shutil.copy(REPO / "tests" / "fixtures" / "standin_main_ppo.py", tree / "verl" / "trainer" / "main_ppo.py")
    (tmp_path / "site").mkdir()
    yield payload, base
    shutil.rmtree(base, ignore_errors=True)


# loopback addresses of this test's own: CI runs modules side by side, and the e2e cluster's boxes (127.0.0.2-4, the
# profiles' own addresses on the device) and test_cluster_two_disks (127.0.0.8-9) start Ray nodes on this machine too
HEAD_IP, WORKER_IP = "127.0.0.6", "127.0.0.7"
RAY_STARTUP_TIMEOUTS = ("The current node timed out during startup", "Deadline Exceeded",
                        "The node registration may not be complete yet")


def _render_cluster_profile(payload: Path, base: Path) -> None:
    """p40-2nodes rendered into the payload with a free port of its own."""
    shutil.rmtree(payload / "profiles" / "p40-2nodes", ignore_errors=True)
    _module("ppo_profiles").render(["p40-2nodes"], payload / "profiles", "HEAD", lab_base=str(base),
                                   ray_port=_free_port(), node_addresses=(HEAD_IP, WORKER_IP))


def _did_not_form(res: subprocess.CompletedProcess, out: Path) -> bool:
    """Whether a node's own start-up failed: Ray's time ran out, or a node's `ray start` ended (cluster.json says
    the nodes did not form); the harness's later steps (the preflight, the run) are not retried."""
    if any(t in res.stdout for t in RAY_STARTUP_TIMEOUTS):
        return True
    try:
        return json.loads((out / "cluster.json").read_text()).get("refused", "").startswith("the Ray nodes did not form")
    except (OSError, ValueError):
        return False


def _run_cluster_profile(verl_python, tmp_path, payload, base) -> tuple[subprocess.CompletedProcess, Path]:
    """run_profile.py on the Ray-node profile, once more (re-rendered on another port, its first try's Ray fatal lines
    printed) only where a node's own start-up failed: its raylet must register with the GCS within 30 s, which a
    loaded 2-core test machine can miss, and Ray's processes bind ports on every address of a host other tests'
    Ray nodes and connections share."""
    # Ray's own timing knobs (its config from the environment), not the units' commands: no Python workers started
    # ahead per CPU, more time for a raylet to register
    env = {**os.environ, "PATH": f"{Path(verl_python).parent}:{os.environ['PATH']}",
           "RAY_enable_worker_prestart": "0", "RAY_prestart_worker_first_driver": "0",
           "RAY_raylet_start_wait_time_s": "120", "RAY_gcs_server_request_timeout_seconds": "120"}
    for attempt in (1, 2):
        res = subprocess.run([str(verl_python), str(GPU / "run_profile.py"), "p40-2nodes", "--out", str(tmp_path / "runs"),
                              "--payload", str(payload), "--model", str(tmp_path / "model"), "--site",
                              str(tmp_path / "site"), "--verl-trees", str(tmp_path / "trees"), "--timeout", "400"],
                             env=env, capture_output=True, text=True, timeout=600)
        out = tmp_path / "runs" / "p40-2nodes"
        if attempt == 2 or not _did_not_form(res, out):
            return res, out
        print("first try: the Ray nodes did not form; retried on another port\n" + _ray_fatal_lines(base))
        _render_cluster_profile(payload, base)
    raise AssertionError("unreachable")


FATAL = re.compile(r"^\[[^\]]* [CF] \d+ \d+\]|Check failed|Address already in use|bind", re.IGNORECASE)


def _ray_fatal_lines(base: Path) -> str:
    """Every Ray session log's fatal lines (level C/F, a failed check, a port taken) under ``base``, first in a
    failure's message: the stack traces after them fill a CI log's tail."""
    out = []
    for log in sorted(base.glob("**/session_*/logs/*")):
        if log.is_file():
            hits = [line for line in log.read_text(errors="replace").splitlines() if FATAL.search(line)]
            out += [f"{log.relative_to(base)}: {line[:400]}" for line in hits[:5]]
    return "Ray's fatal lines:\n" + ("\n".join(out) or "(none)") + "\n"


def _ray_session_logs(base: Path, lines: int = 15) -> str:
    """The last lines of each node's Ray session logs under ``base`` (raylet, GCS, agents): why a node did not start."""
    out = []
    for log in sorted(base.glob("**/session_latest/logs/*")):
        if log.is_file() and log.name.startswith(("raylet.", "gcs_server.", "dashboard_agent.", "runtime_env_agent.")):
            tail = log.read_text(errors="replace").splitlines()[-lines:]
            if tail:
                out.append(f"\n--- {log.relative_to(base)}\n" + "\n".join(tail))
    return "".join(out)


def _no_process_left(base: Path) -> bool:
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    return str(base) not in ps


def test_two_ray_nodes_form_pass_the_preflight_and_place_one_rank_on_each(verl_python, ray_payload, tmp_path):
    payload, base = ray_payload
    res, out = _run_cluster_profile(verl_python, tmp_path, payload, base)
    assert res.returncode == 0, (_ray_fatal_lines(base) + res.stdout[-3000:] + res.stderr[-3000:]
                                 + _ray_session_logs(base))
    cluster = json.loads((out / "cluster.json").read_text())
    assert sorted(n["ip"] for n in cluster["nodes_alive"]) == [HEAD_IP, WORKER_IP]
    assert all(n["gpus"] == 1 for n in cluster["nodes_alive"])
    assert 0 < cluster["head_up_s"] <= cluster["formed_s"] < 180
    started = {n["role"]: n for n in cluster["nodes_started"]}
    assert started["worker"]["exec_start"].endswith(f"--node-ip-address={WORKER_IP} --num-gpus=1 --disable-usage-stats")
    assert (started["head"]["cuda_visible_devices"], started["worker"]["cuda_visible_devices"]) == ("0", "1")
    assert cluster["preflight"]["rc"] == 0
    [(status, check, detail)] = cluster["preflight"]["results"]
    assert (status, check) == ("ok", "cluster") and detail.startswith("verl-lab cluster check passed: 2 nodes x 1 GPU(s)")
    console = (out / "console.log").read_text()
    result = json.loads(next(line for line in console.splitlines() if line.startswith("RESULT "))[len("RESULT "):])
    ranks = {r["rank"]: r for r in result["ranks"]}
    assert (ranks[0]["node_ip"], ranks[1]["node_ip"]) == (HEAD_IP, WORKER_IP)       # one rank per node
    assert (ranks[0]["cuda_visible_devices"], ranks[1]["cuda_visible_devices"]) == ("0", "1")  # each node's own GPU
    assert all(r["master_addr"] == HEAD_IP and r["gloo_ifname"] == "lo" and r["sum"] == 3.0 for r in ranks.values())
    # the cap, NCCL's INFO level and the probe reach the workers of both nodes (through the nodes' `ray start`
    # environment: verl's runtime env leaves NCCL_DEBUG to the driver's when the driver sets it)
    cap = str(json.loads((payload / "profiles" / "p40-2nodes" / "profile.json").read_text())["cap_mib"])
    assert all((r["cap_mib"], r["nccl_debug"]) == (cap, "INFO") for r in ranks.values())
    assert all(r["probe"] == str(GPU / "probe" / "sitecustomize.py") for r in ranks.values())
    assert json.loads((out / "run.json").read_text())["rc"] == 0
    assert len(cluster["stopped"]) == 2 and _no_process_left(base)


def test_a_cluster_whose_preflight_fails_is_refused_before_training(rendered, tmp_path, monkeypatch):
    """run_profile's control flow with stand-ins for forming and the preflight (the real cluster-check's refusal of a
    node count is tests/unit/test_cluster.py's): the nodes are stopped, cluster.json says why, nothing trains."""
    run_profile = _module("run_profile")
    ray_nodes = run_profile.ray_nodes
    stopped = []
    monkeypatch.setattr(ray_nodes, "form", lambda cluster, src, env, python, out, timeout, nodes: (
        nodes.extend(["head", "worker"]), {"formed_s": 5.0})[1])
    monkeypatch.setattr(ray_nodes, "read_env_file", lambda path: {"RAY_ADDRESS": "127.0.0.2:6379"})
    monkeypatch.setattr(ray_nodes, "preflight", lambda train, env: {"rc": 1, "results": [
        ["FAIL", "cluster", "2 node(s) joined (127.0.0.2, 127.0.0.3), the plan trains on 3"]]})
    monkeypatch.setattr(ray_nodes, "stop", lambda nodes: stopped.append(list(nodes)) or [{"host": n} for n in nodes])
    profile, _ = _record(rendered, "p40-2nodes")
    env: dict = {}
    got = run_profile.form_cluster(profile, rendered / "p40-2nodes", tmp_path / "root", env, tmp_path, 60, [])
    assert got["refused"] == "the cluster preflight failed: 2 node(s) joined (127.0.0.2, 127.0.0.3), the plan trains on 3"
    assert stopped == [["head", "worker"]] and env == {"RAY_ADDRESS": "127.0.0.2:6379"}
    assert json.loads((tmp_path / "cluster.json").read_text())["refused"] == got["refused"]
    monkeypatch.setattr(ray_nodes, "preflight", lambda train, env: {"rc": 0, "results": [["ok", "cluster", "passed"]]})
    passed = run_profile.form_cluster(profile, rendered / "p40-2nodes", tmp_path / "root", {}, tmp_path, 60, [])
    assert "refused" not in passed and len(stopped) == 1          # the nodes stay up for the run


def _stub_cluster(tmp_path: Path, worker_script: str) -> dict:
    """A two-node cluster record whose units start stand-ins of `ray start --block`: the head stays up, the worker
    runs ``worker_script``."""
    nodes = []
    for i, (role, script) in enumerate((("head", "exec sleep 60"), ("worker", worker_script))):
        folder = tmp_path / "cluster" / role
        folder.mkdir(parents=True)
        stub = folder / "ray"
        stub.write_text(f"#!/bin/sh\n{script}\n")
        stub.chmod(0o755)
        (folder / "verl-lab-ray.service").write_text(f"[Service]\nWorkingDirectory={tmp_path}\nExecStart={stub} start\n")
        (folder / "ray.env").write_text("RAY_ADDRESS=127.0.0.2:9\n")
        nodes.append({"host": role, "role": role, "address": f"127.0.0.{2 + i}", "dir": f"cluster/{role}",
                      "cuda_visible_devices": str(i), "num_gpus": 1})
    return {"address": "127.0.0.2:9", "interface": "lo", "nodes": nodes}


@pytest.mark.parametrize("worker_script,words", [("exit 1", "worker worker: `ray start` exited 1"),
                                                 ("sleep 2; echo gone; exit 4", "`ray start` exited 4 while the cluster "
                                                                                "formed (see ray-worker.log: # worker "
                                                                                "worker at 127.0.0.3, "
                                                                                "CUDA_VISIBLE_DEVICES=1 | gone)")])
def test_a_node_that_ends_while_the_cluster_forms_fails_it_at_once(tmp_path, worker_script, words):
    """ray_nodes.form against stand-ins of `ray start`: a node that exits, at once or while the cluster forms, fails
    the formation then (not at its timeout), with its log's last lines; the head started before it is stopped."""
    ray_nodes = _module("ray_nodes")
    started: list = []
    with pytest.raises(ray_nodes.NodeError) as failed:
        ray_nodes.form(_stub_cluster(tmp_path, worker_script), tmp_path, dict(os.environ), sys.executable, tmp_path,
                       120, started)
    record = json.loads(str(failed.value))
    assert words in record["error"] and record["formed_s"] is None
    assert [n["role"] for n in record["nodes_started"]] == ["head", "worker"][:len(started)]
    assert started[0].process.poll() is None                       # the head is still up: the caller stops it
    assert [s["host"] for s in ray_nodes.stop(started)] == [n.host for n in started]
    assert all(n.process.poll() is not None for n in started)


BIND = ("import os, socket, sys, time; d = sys.argv[1]; time.sleep(1.5); "
        "os.makedirs(d + '/session_new/sockets', exist_ok=True); "
        "os.symlink(d + '/session_new', d + '/tmp_latest'); os.replace(d + '/tmp_latest', d + '/session_latest'); "
        "time.sleep(1); open(d + '/bound_at', 'w').write(str(time.time())); "
        "[socket.socket(socket.AF_UNIX).bind(d + '/session_new/sockets/' + n) for n in ('raylet', 'plasma_store')]")


def test_a_worker_starts_once_the_head_bound_its_sockets_not_on_an_old_sessions(tmp_path):
    """On one host the nodes share the head's session folder and Ray names a node's sockets by the first free name:
    ray_nodes.start holds a worker back until the head's raylet bound ``raylet`` and ``plasma_store`` in the session
    the head made (an earlier session's socket files, left behind, do not count). Stand-ins of `ray start`: the head
    makes its session 1.5 s after its start, binds its sockets 1 s later; the worker records when it started."""
    ray_nodes = _module("ray_nodes")
    temp = Path(tempfile.mkdtemp(prefix="vlr"))                    # short: a socket's path is at most 107 bytes
    (temp / "session_old" / "sockets").mkdir(parents=True)
    for name in ("raylet", "plasma_store"):                         # an earlier session's, its processes gone
        socket.socket(socket.AF_UNIX).bind(str(temp / "session_old" / "sockets" / name))
    (temp / "session_latest").symlink_to(temp / "session_old")
    cluster = _stub_cluster(tmp_path, f"date +%s.%N > {tmp_path}/worker_at; exec sleep 60")
    head = tmp_path / "cluster" / "head"
    (head / "ray").write_text(f"#!/bin/sh\n{sys.executable} -c \"{BIND}\" {temp}\nexec sleep 60\n")
    (head / "verl-lab-ray.service").write_text(f"[Service]\nWorkingDirectory={tmp_path}\n"
                                              f"ExecStart={head / 'ray'} start --head --temp-dir={temp}\n")
    started: list = []
    try:
        ray_nodes.start(cluster, tmp_path, dict(os.environ), tmp_path, time.monotonic(), started)
        assert [n.role for n in started] == ["head", "worker"]
        deadline = time.monotonic() + 30
        while not (tmp_path / "worker_at").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert float((tmp_path / "worker_at").read_text()) >= float((temp / "bound_at").read_text())
    finally:
        ray_nodes.stop(started)
        shutil.rmtree(temp)


def test_a_head_that_ends_before_binding_its_sockets_fails_the_start_without_the_worker(tmp_path):
    ray_nodes = _module("ray_nodes")
    cluster = _stub_cluster(tmp_path, f"touch {tmp_path}/worker_ran; exec sleep 60")
    head = tmp_path / "cluster" / "head"
    (head / "ray").write_text("#!/bin/sh\nsleep 1.5; exit 3\n")
    (head / "verl-lab-ray.service").write_text(f"[Service]\nWorkingDirectory={tmp_path}\n"
                                              f"ExecStart={head / 'ray'} start --head --temp-dir={tmp_path}/t\n")
    started: list = []
    with pytest.raises(ray_nodes.NodeError, match="head head: `ray start` exited 3 before its raylet bound its sockets"):
        ray_nodes.start(cluster, tmp_path, dict(os.environ), tmp_path, time.monotonic(), started)
    ray_nodes.stop(started)
    assert [n.role for n in started] == ["head"] and not (tmp_path / "worker_ran").exists()


# ------------------------------------------------------------------ the probe: each worker's own GPU


def test_the_probe_finds_its_process_on_the_gpu_nvml_lists_it_on(monkeypatch):
    """Ray gives a worker CUDA_VISIBLE_DEVICES=1: torch calls that GPU device 0, NVML index 1. The probe looks
    for its process on every GPU NVML lists (a stand-in pynvml with NVML's calls), so the second worker's outside-
    torch memory and GPU are read, not missed on NVML's GPU 0."""
    me = os.getpid()
    procs = {0: [types.SimpleNamespace(pid=me + 1, usedGpuMemory=9 << 30)],
             1: [types.SimpleNamespace(pid=me, usedGpuMemory=20 << 30)]}
    nvml = types.SimpleNamespace(nvmlInit=lambda: None, nvmlDeviceGetCount=lambda: 2,
                                 nvmlDeviceGetHandleByIndex=lambda i: i,
                                 nvmlDeviceGetComputeRunningProcesses=lambda h: procs[h],
                                 nvmlDeviceGetUUID=lambda h: f"GPU-{h}".encode())
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    monkeypatch.setenv("RANK", "1")
    spec = importlib.util.spec_from_file_location("probe_under_test", GPU / "probe" / "sitecustomize.py")
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    here = probe.nvml_process()
    assert here == {"gpu": 1, "gpu_uuid": "GPU-1", "used_bytes": 20 << 30}
    torch = types.SimpleNamespace(cuda=types.SimpleNamespace(memory_reserved=lambda: 18 << 30, is_available=lambda: False,
                                                             is_initialized=lambda: False, device_count=lambda: 1))
    assert probe._outside_torch_mib(torch, here) == 2048.0
    record = probe.device_record(torch, here)
    assert (record["rank"], record["cuda_visible_devices"], record["gpu"], record["gpu_uuid"]) == ("1", "1", 1, "GPU-1")
    procs[1] = []
    assert probe.nvml_process() is None and probe._outside_torch_mib(torch, None) is None


# ------------------------------------------------------------------ the results


def _steps(seconds: list[float], testing: float = 9.0) -> str:
    lines = [f"(TaskRunner pid=7) step:{i} - timing_s/gen:10.0 - response_length/mean:256.0 - timing_s/step:{s}"
             + (f" - timing_s/testing:{testing}" if i == len(seconds) else "") for i, s in enumerate(seconds, 1)]
    return "\n".join(lines) + "\n"


def _phase(pid, rank, gpu, phase, alloc, reserved, t, seconds=5.0, outside=1300.0):
    return {"pid": pid, "t": t, "event": "phase", "role": "ActorRolloutRefWorker", "phase": phase, "call": 1,
            "seconds": seconds, "rank": str(rank), "peak_allocated_mib": alloc, "peak_reserved_mib": reserved,
            "outside_torch_mib": outside, "gpu": gpu}


def _run_dir(rendered: Path, runs: Path, name: str, console: str, probe: list[dict], cluster: dict | None = None) -> Path:
    run = runs / name
    (run / "probe").mkdir(parents=True)
    shutil.copy(rendered / name / "profile.json", run / "profile.json")
    shutil.copy(rendered / name / "train" / "plan.json", run / "plan.json")
    (run / "console.log").write_text(console)
    (run / "run.json").write_text(json.dumps({"name": name, "rc": 0, "timed_out": False, "seconds": 200.0}))
    by_pid: dict[int, list] = {}
    for r in probe:
        by_pid.setdefault(r["pid"], []).append(r)
    for pid, records in by_pid.items():
        (run / "probe" / f"probe-{pid}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    if cluster:
        (run / "cluster.json").write_text(json.dumps(cluster))
    return run


def test_results_read_each_rank_against_the_per_gpu_plan_and_the_scaling(rendered, tmp_path):
    results = _module("ppo_results")
    runs = tmp_path / "runs"
    plan2 = _record(rendered, "p40-2gpu")[1]
    pred = plan2["predicted_peak_mib"]
    cap = _record(rendered, "p40-2gpu")[0]["cap_mib"]
    one = [_phase(11, 0, 0, "update_actor", 21000.0, 23000.0, 100.0)]
    two = [{"pid": 21, "t": 50.0, "event": "device", "rank": "0", "gpu": 0, "gpu_uuid": "GPU-a", "cuda_visible_devices": "0",
            "node_ip": "127.0.0.2"},
           {"pid": 22, "t": 50.0, "event": "device", "rank": "1", "gpu": 1, "gpu_uuid": "GPU-b", "cuda_visible_devices": "1",
            "node_ip": "127.0.0.2"},
           _phase(21, 0, 0, "update_actor", round(0.97 * pred - 1300, 1), cap - 10, 100.0),
           _phase(22, 1, 1, "update_actor", round(1.12 * pred - 1300, 1), cap + 5, 100.0),
           _phase(22, 1, 1, "init_model", 99999.0, 99999.0, 40.0)]            # not a training phase
    nccl = ("(WorkerDict pid=21) vm:21:90 [0] NCCL INFO Bootstrap : Using lo:127.0.0.2<0>\n"
            "(WorkerDict pid=21) vm:21:90 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM/read\n"
            "(WorkerDict pid=22) vm:22:91 [1] NCCL INFO Channel 00/0 : 1[1] -> 0[0] via P2P/CUMEM/read\n")
    _run_dir(rendered, runs, "p40-1gpu", _steps([50.0, 45.0]), one)
    _run_dir(rendered, runs, "p40-2gpu", nccl + _steps([30.0, 25.0]), two)
    cluster = {"formed_s": 6.2, "head_up_s": 4.1, "nodes_alive": [{"ip": "127.0.0.2", "gpus": 1.0}],
               "preflight": {"rc": 0, "seconds": 3.3, "results": [["ok", "cluster", "verl-lab cluster check passed"]]}}
    # NCCL 2.23 and later: "Bootstrap: Using" (src/bootstrap.cc, under NCCL_DEBUG_SUBSYS=BOOTSTRAP); the net
    # transport's lines as src/transport/net.cc prints them, each side of a connection
    sock = ("(WorkerDict pid=31) vm:31:95 [0] NCCL INFO Bootstrap: Using lo:127.0.0.2<0>\n"
            "(WorkerDict pid=31) vm:31:95 [0] NCCL INFO NET/Socket : Using [0]lo:127.0.0.2<0>\n"
            "(WorkerDict pid=32) vm:32:96 [0] NCCL INFO NET/Socket : Using [0]lo:127.0.0.3<0>\n"
            "(WorkerDict pid=31) vm:31:95 [0] NCCL INFO Channel 00/0 : 1[0] -> 0[0] [receive] via NET/Socket/0\n"
            "(WorkerDict pid=32) vm:32:96 [0] NCCL INFO Channel 00/0 : 1[0] -> 0[0] [send] via NET/Socket/0\n")
    _run_dir(rendered, runs, "p40-2nodes", sock + _steps([40.0, 32.0]), [
        {"pid": 31, "t": 50.0, "event": "device", "rank": "0", "gpu": 0, "node_ip": "127.0.0.2"},
        {"pid": 32, "t": 50.0, "event": "device", "rank": "1", "gpu": 0, "node_ip": "127.0.0.3"},   # a shared GPU
        _phase(31, 0, 0, "update_actor", 15000.0, 16000.0, 100.0), _phase(32, 1, 0, "update_actor", 15000.0, 16000.0, 99.0)],
        cluster)
    rows = [results.summarise(runs / n) for n in ("p40-1gpu", "p40-2gpu", "p40-2nodes")]
    by = {r["profile"]: r for r in rows}
    two_gpu = by["p40-2gpu"]
    assert two_gpu["predicted_peak_mib"] == pred            # the memory model at the run's world size, as the plan
    g0, g1 = two_gpu["per_gpu"]
    assert (g0["rank"], g0["gpu"], g1["rank"], g1["gpu"]) == ("0", 0, "1", 1)
    assert g0["within_10pct"] and not g1["within_10pct"] and g1["ratio"] == pytest.approx(1.12, abs=0.002)
    assert g0["under_cap"] and not g1["under_cap"] and g1["peak_allocated_mib"] < 99999.0
    assert two_gpu["own_gpu_each"] is True and two_gpu["per_gpu_within_10pct"] is False
    assert two_gpu["per_gpu_under_cap"] is False
    assert two_gpu["nccl"] == {"transports": {"P2P/CUMEM/read": 2}, "using": {"Bootstrap": ["lo:127.0.0.2<0>"]},
                               "families": ["P2P"]}
    assert by["p40-1gpu"]["per_gpu"] is None and by["p40-1gpu"]["nccl"] is None
    assert by["p40-2nodes"]["own_gpu_each"] is False and by["p40-2nodes"]["nccl"] == {
        "transports": {"NET/Socket/0": 2}, "families": ["NET/Socket"],
        "using": {"Bootstrap": ["lo:127.0.0.2<0>"], "NET/Socket": ["[0]lo:127.0.0.2<0>", "[0]lo:127.0.0.3<0>"]}}
    assert by["p40-2nodes"]["cluster"]["formed_s"] == 6.2 and by["p40-2nodes"]["cluster"]["preflight_ok"]
    scale = {c["profile"]: c for c in results.scaling(rows)}
    assert set(scale) == {"p40-2gpu", "p40-2nodes"}
    # step 2 of each, less its validation (9 s): 256 prompts in 36 s on one GPU, 16 s on two, 23 s on two nodes
    assert scale["p40-2gpu"]["ratio"] == pytest.approx(36 / 16, abs=0.002)
    assert scale["p40-2nodes"]["base"] == "p40-2gpu" and scale["p40-2nodes"]["formed_s"] == 6.2
    assert scale["p40-2nodes"]["ratio"] == pytest.approx(16 / 23, abs=0.002)
    table = results.scaling_markdown(rows)
    assert "| p40-2gpu | p40-1gpu | 2 (1) |" in table and "**2.25**" in table and "(outside 10%)" in table
    lines = results.scaling_lines(runs, ["p40-2gpu", "p40-2nodes"])
    assert "p40-2gpu / p40-1gpu = 2.25 (prompts/s)" in lines and "p40-2nodes / p40-2gpu = 0.70" in lines
    assert "cluster formed in 6.2 s (head up 4.1 s), preflight passed in 3.3 s" in lines
    # each device call comes back as its own folder: the cluster's call after the p40 one, read together
    call2 = tmp_path / "call2"
    call2.mkdir()
    shutil.move(str(runs / "p40-2nodes"), call2 / "p40-2nodes")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert results.main([str(runs), str(call2), "--multi"]) == 0
    assert "| p40-2nodes | p40-2gpu | 2 (2) |" in printed.getvalue() and "**0.696**" in printed.getvalue()
    with pytest.raises(SystemExit):
        results.main([str(runs), str(call2), "--scaling", "p40-2nodes"])


# ------------------------------------------------------------------ the one command


COLD_SETUP_S = 80       # install.sh and the random model on a fresh device machine (GPU calls 1-13: 40-80 s)
CALL_BUDGET_S = 560     # run_multi.sh's -d default: the device call's 600 s less packing and the summary


def test_run_multi_runs_the_multi_profiles_and_refuses_before_any_setup(tmp_path):
    """bench/gpu/run_multi.sh: its time limits name exactly the multi profiles and its calls cover them, the 2-GPU
    run first; every run the issue asks for gets its whole limit in a cold call; an unknown call, a profile not
    rendered, or a machine with fewer than 2 GPUs stops it before run_ppo.sh (no setup, no run)."""
    import re

    script = (GPU / "run_multi.sh").read_text()
    limits = {k: int(v) for k, v in re.findall(r"\[([a-z0-9-]+)\]=(\d+)", script)}
    assert set(limits) == set(MULTI) and f"budget={CALL_BUDGET_S}" in (GPU / "limited_runs.sh").read_text()
    calls = dict(re.findall(r"^\s+(\w+)\) set -- ([a-z0-9 -]+) ;;", script, re.M))
    assert set(calls) == {"p40", "gtx1080", "cluster", "checkpoint", "socket"}
    assert sorted(n for names in calls.values() for n in names.split()) == sorted(MULTI)
    assert calls["p40"].split() == ["p40-2gpu", "p40-1gpu"] and calls["gtx1080"].split() == ["gtx1080-2gpu", "gtx1080-1gpu"]
    for call, names in calls.items():
        first, *rest = names.split()
        assert COLD_SETUP_S + limits[first] <= CALL_BUDGET_S, call
        if call != "gtx1080":        # its baseline takes what is left (docs/training-runs.md, "Pending: issue 27")
            assert COLD_SETUP_S + sum(limits[n] for n in names.split()) <= CALL_BUDGET_S, call
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H200 (UUID: GPU-0a1b)'\n")
    (bin_dir / "nvidia-smi").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "OUT": str(tmp_path / "out")}

    def run(*args):
        return subprocess.run(["bash", str(GPU / "run_multi.sh"), *args], cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=60)

    assert run("sideways").returncode == 2 and "CALL is one of" in run("sideways").stderr
    assert run().returncode == 2 and "got ''" in run().stderr
    missing = run("p40")
    assert missing.returncode == 2 and "p40-2gpu is not rendered" in missing.stderr
    alone = run("gtx1080-1gpu")                 # a profile by name
    assert alone.returncode == 2 and "gtx1080-1gpu is not rendered" in alone.stderr
    for name in calls["p40"].split():
        (tmp_path / ".gpu" / "profiles" / name).mkdir(parents=True)
        (tmp_path / ".gpu" / "profiles" / name / "profile.json").write_text("{}")
    one_gpu = run("p40")
    assert one_gpu.returncode == 2 and "need 2 GPUs (nvidia-h200-x2), nvidia-smi lists 1" in one_gpu.stderr
    assert not (tmp_path / "out").exists()
