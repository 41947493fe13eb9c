"""verl-lab's check of a Ray cluster before training (placed as ``<train_dir>/cluster-check``).

Run on the head, by the train user, in the env's Python, with the Ray environment
(``<train_dir>/ray.env``: RAY_ADDRESS, VERL_LAB_NODE_IP)::

    python cluster-check [--plan plan.json] [--timeout 120]

It reads the plan (``trainer.nnodes``, ``trainer.n_gpus_per_node``, the rollout, the model and
data paths), runs one task on every alive node of the cluster (pinned there) that takes the
node's fingerprint: Python, the versions of torch, Ray, verl (and vLLM where the plan's rollout
is vLLM), a hash of verl's installed sources (the patches), and the sha256 of the model's and
the data's files. Every node must match the head's; the nodes and the GPUs per node must be
what the plan says; a node's hostname must resolve to its address (NCCL, Gloo and Ray look it up;
not checked where the address is a loopback one: every node on one machine). Otherwise it prints ``verl-lab cluster check FAILED`` with a line per node
that differs, naming the node and what differs, and exits 1.

Standard library only at module level (``ray`` is imported in ``main``).
"""

from __future__ import annotations

import argparse
import hashlib
import ipaddress
import json
import os
import sys
from pathlib import Path

PACKAGES = ("torch", "ray", "verl")
RESOLVES = "hostname resolves to"        # per node: not compared with the head's
FAILED = "verl-lab cluster check FAILED"
PASSED = "verl-lab cluster check passed"


def _tree_sha256(paths) -> str:
    """sha256 over every file under ``paths`` (relative name and bytes), or 'missing'."""
    h, seen = hashlib.sha256(), False
    for root in paths:
        root = Path(root)
        files = sorted(p for p in root.rglob("*") if p.is_file()) if root.is_dir() else [root] if root.is_file() else []
        for f in files:
            seen = True
            h.update(f.name.encode() + b"\0")
            with open(f, "rb") as fh:
                for chunk in iter(lambda: fh.read(1 << 20), b""):
                    h.update(chunk)
    return h.hexdigest() if seen else "missing"


def fingerprint(packages, model_dir: str, data_files) -> dict:
    """What must be equal on every node (runs on each node, in the env's Python)."""
    import importlib.metadata as md
    import importlib.util
    import platform
    import socket

    found = {"host": socket.gethostname(), "python": platform.python_version()}
    try:
        found[RESOLVES] = socket.getaddrinfo(found["host"], None, socket.AF_INET)[0][4][0]
    except OSError:
        found[RESOLVES] = "nothing"
    for name in packages:
        try:
            found[name] = md.version(name)
        except md.PackageNotFoundError:
            found[name] = "not installed"
    spec = importlib.util.find_spec("verl")
    src = [Path(p) for p in (spec.submodule_search_locations or [])] if spec else []
    found["verl sources"] = _tree_sha256(src)
    found["model"] = _tree_sha256([model_dir])
    found["data"] = _tree_sha256(data_files)
    return found


def compare(nodes: list[dict], head_ip: str, nnodes: int, gpus_per_node: int) -> list[str]:
    """Problems, one a line, each naming the node (address and host) and what differs; ``nodes``:
    ``{"ip", "gpus", "fingerprint"}`` of every alive node."""
    problems = []
    if len(nodes) != nnodes:
        problems.append(f"{len(nodes)} node(s) joined ({', '.join(sorted(n['ip'] for n in nodes))}), the plan "
                        f"trains on {nnodes}: see the workers' journalctl -u verl-lab-ray.service")
    head = next((n for n in nodes if n["ip"] == head_ip), None)
    if head is None:
        return problems + [f"the head {head_ip} is not among the cluster's nodes"]
    for n in sorted(nodes, key=lambda n: n["ip"]):
        who = f"node {n['ip']} ({n['fingerprint'].get('host', '?')})"
        if n["gpus"] < gpus_per_node:
            problems.append(f"{who}: {n['gpus']:g} GPU(s), the plan uses {gpus_per_node} per node")
        resolves = n["fingerprint"].get(RESOLVES, n["ip"])
        if resolves != n["ip"] and not ipaddress.ip_address(n["ip"]).is_loopback:
            problems.append(f"{who}: its {RESOLVES} {resolves}, not {n['ip']}: re-run deploy/cluster.py on it")
        for key, want in head["fingerprint"].items():
            have = n["fingerprint"].get(key)
            if key not in ("host", RESOLVES) and have != want:
                problems.append(f"{who}: {key} {have} differs from the head's {want}")
    return problems


def _plan_values(plan: dict) -> tuple[int, int, list[str], str, list[str]]:
    launch = plan["launch"]
    values = dict(o["override"].split("=", 1) for o in launch["overrides"])
    packages = list(PACKAGES) + (["vllm"] if values.get("actor_rollout_ref.rollout.name") == "vllm" else [])
    return (int(values.get("trainer.nnodes", 1)), int(values.get("trainer.n_gpus_per_node", 1)), packages,
            launch["paths"]["model_dir"], launch["paths"]["data_files"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="cluster-check", description=__doc__.split("\n\n")[0])
    ap.add_argument("--plan", default=str(Path(__file__).resolve().parent / "plan.json"))
    ap.add_argument("--timeout", type=float, default=120)
    args = ap.parse_args(argv)
    nnodes, gpus_per_node, packages, model_dir, data_files = _plan_values(json.loads(Path(args.plan).read_text()))
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    head_ip = os.environ.get("VERL_LAB_NODE_IP")
    ray.init(address=os.environ.get("RAY_ADDRESS"), _node_ip_address=head_ip, log_to_driver=False)
    head_ip = head_ip or ray.util.get_node_ip_address()
    alive = [n for n in ray.nodes() if n["Alive"]]
    remote = ray.remote(num_cpus=0)(fingerprint)
    refs = [remote.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False))
            .remote(packages, model_dir, data_files) for n in alive]
    prints = ray.get(refs, timeout=args.timeout)
    nodes = [{"ip": n["NodeManagerAddress"], "gpus": n["Resources"].get("GPU", 0), "fingerprint": fp}
             for n, fp in zip(alive, prints)]
    problems = compare(nodes, head_ip, nnodes, gpus_per_node)
    if problems:
        print(FAILED + ":\n  " + "\n  ".join(problems))
        return 1
    print(f"{PASSED}: {len(nodes)} nodes x {gpus_per_node} GPU(s), the same env, model and data on each "
          f"({', '.join(f'{k} {v}' for k, v in nodes[0]['fingerprint'].items() if k in packages or k == 'python')})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
