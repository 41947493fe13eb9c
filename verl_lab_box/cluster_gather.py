"""verl-lab: a cluster run's last actor save, brought whole to the head (placed as
``<train_dir>/cluster-gather``).

Run on the head by the training launcher when a cluster run (``trainer.nnodes > 1``) ends, or by
``train-launcher --export``, as the train user, in the env's Python, with the Ray environment
(``<train_dir>/ray.env``: RAY_ADDRESS, VERL_LAB_NODE_IP)::

    python cluster-gather --plan plan.json --step N [--timeout 600]

Each node of a verl cluster saves its own ranks' shards on its own disk
(``<checkpoint_dir>/global_step_N/actor/model_world_size_W_rank_r.pt``), and rank 0 (on the node
with the lowest address, not necessarily the head) adds ``fsdp_config.json`` and ``huggingface/``.
The export (verl's model merger, then the proof) needs them all in one folder. This program asks
every alive node of the Ray cluster (one task pinned to each, the way ``cluster-check`` asks them)
which of these files it holds, decides what the head lacks (``plan_fetch``: every rank of one world
size, the config and ``huggingface/config.json``, no two copies of a file that differ), and copies
each missing file from its node over Ray's own connections (tasks pinned to that node read it in
chunks, a few in flight; the head writes ``<name>.gather-part.<pid>``, syncs it, hashes the file on its
disk and compares that sha256 with the one the node computes from its own file, keeps the node's mtime
and renames it into place). The optimizer and extra-state shards stay where they are: the export needs
the model shards only. What it copied is recorded in ``global_step_N/actor/verl-lab-gathered.json``
after each file (``complete`` once the step is whole), so a gather that failed half-way leaves what it
copied on record and the next one goes on from there (a copy on record yields to the node's file,
which is copied again where it changed since); verl's retention removes the gathered files with the
save. A re-run copies nothing that is there already (same bytes and mtime).

One gather or export of a step at a time: the gather holds the step folder's lock (``.export.lock``,
verl_lab_box/checkpoints.py ``step_lock``, placed beside it as ``verl_lab_checkpoints.py``), the one the
export and the score take, from before it asks Ray until its record is written; a second gather of the
step (the unit's after-run and ``deploy/export.py``) waits, then finds the step whole and copies
nothing. Part files left by a gather that died are removed under the lock. Every call to a node has
the time left of ``--timeout`` (its listing, each chunk, its sha256): a node that hangs ends the gather
with a line naming it; a call Ray gives no timeout (connecting, the node list) is bounded by a watchdog
that ends the process ``WATCHDOG_S`` after the timeout.

Why Ray: the cluster's nodes already reach each other on Ray's port as the train user; no SSH keys
between boxes, no other port, and the same pinned-task pattern the cluster check proves.

Exit 0 when the head holds the whole step; 1 when it cannot (the launcher's after-run then exits 70) (a line ``verl-lab cluster gather FAILED
(step N, head IP): ...`` per problem, naming the file and what each node holds; the doctor's rules in
files/doctor/cluster.toml read them); 2 for a bad plan or arguments.
Standard library only at module level (``ray`` is imported in ``main``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys
import threading
import time
from pathlib import Path

CHUNK = 64 << 20                 # bytes a pinned read returns (through Ray's object store)
IN_FLIGHT = 4                    # reads outstanding per file
SHARD = re.compile(r"^model_world_size_(\d+)_rank_(\d+)\.pt$")
CONFIG, HF_CONFIG = "fsdp_config.json", "huggingface/config.json"
RECORD = "verl-lab-gathered.json"
PART = ".gather-part"             # <name>.gather-part.<pid>: one writer's copy until it is whole
WATCHDOG_S = 30                  # past --timeout, a call Ray gives no timeout (ray.init, ray.nodes) ends the process
FAILED = "verl-lab cluster gather FAILED"
PASSED = "verl-lab cluster gather"


def wanted(name: str) -> bool:
    """A file of an actor save that the export reads."""
    return bool(SHARD.match(name)) or name == CONFIG or (name.startswith("huggingface/") and PART not in name)


def listing(actor_dir: str) -> dict:
    """What one node holds of the save (runs on each node): its host and ``{relative name: [bytes,
    mtime_ns]}`` of the files the export reads; ``files`` is None where the folder is missing."""
    import socket

    root = Path(actor_dir)
    if not root.is_dir():
        return {"host": socket.gethostname(), "files": None}
    files = {}
    for path in sorted(root.rglob("*")):
        name = path.relative_to(root).as_posix()
        if path.is_file() and wanted(name):
            st = path.stat()
            files[name] = [st.st_size, st.st_mtime_ns]
    return {"host": socket.gethostname(), "files": files}


def read_chunk(path: str, offset: int, size: int) -> bytes:
    """``size`` bytes of ``path`` from ``offset`` (runs on the node that holds it)."""
    with open(path, "rb") as fh:
        fh.seek(offset)
        return fh.read(size)


def file_sha256(path: str) -> str:
    """sha256 of ``path`` (runs on the node that holds it)."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _who(ip: str, nodes: dict) -> str:
    return f"node {ip} ({nodes[ip].get('host', '?')})"


def plan_fetch(head: str, nodes: dict, step: int, nnodes: int, gathered=()) -> tuple[list[dict], list[str]]:
    """What the head must copy, and the problems that stop the export (pure).

    ``nodes``: ``{ip: listing(...)}`` of every alive node, the head's (``head``) among them. Every
    rank ``0..W-1`` of one world size W must be on some node, and ``fsdp_config.json`` and
    ``huggingface/config.json``; a file held by several nodes must be the same there (bytes and mtime:
    a rank placed on another node by a later run leaves a stale copy). ``gathered``: the names an
    earlier gather copied to the head (its record): such a copy yields to the node's file, and is
    copied again where that file changed since (the step saved again). Returns ([{"name", "from",
    "bytes", "mtime_ns"}] for each file the head lacks, problems)."""
    if head not in nodes:
        return [], [f"the head {head} is not among the cluster's nodes ({', '.join(sorted(nodes)) or 'none'})"]
    holders: dict[str, dict[str, tuple]] = {}
    for ip in sorted(nodes):
        for name, ident in (nodes[ip].get("files") or {}).items():
            holders.setdefault(name, {})[ip] = tuple(ident)
    for name in gathered:
        if len(holders.get(name, {})) > 1:      # the head's copy and the node's own: the node's decides
            held = holders[name]
            mine = held.pop(head, None)
            if mine is not None and len(set(held.values())) == 1 and mine == next(iter(held.values())):
                held[head] = mine                 # the same file: nothing to copy
    where = "; ".join(f"{_who(ip, nodes)}: " + (
        f"no global_step_{step}/actor" if nodes[ip].get("files") is None else
        "ranks " + (", ".join(str(int(SHARD.match(n).group(2))) for n in sorted(nodes[ip]["files"], key=_rank_key)
                             if SHARD.match(n)) or "none")) for ip in sorted(nodes))
    problems = []
    worlds = sorted({int(SHARD.match(n).group(1)) for n in holders if SHARD.match(n)})
    if len(worlds) > 1:
        problems.append(f"step {step} has shards of {len(worlds)} world sizes ({', '.join(map(str, worlds))}): "
                        f"saves of two runs with other GPU counts ({where})")
    elif not worlds:
        problems.append(f"no node holds a model shard of step {step} ({where})")
    required = [f"model_world_size_{worlds[0]}_rank_{r}.pt" for r in range(worlds[0])] if len(worlds) == 1 else []
    down = (f"; {len(nodes)} of the plan's {nnodes} nodes answered: a node that is down or has left the cluster "
            "holds it (journalctl -u verl-lab-ray.service there)") if len(nodes) < nnodes else ""
    for name in required + [CONFIG, HF_CONFIG]:
        if name not in holders:
            problems.append(f"{name} of step {step} is on no node ({where}){down}")
    fetch = []
    for name in sorted(holders, key=_rank_key):
        held = holders[name]
        if len(set(held.values())) > 1:
            problems.append(f"{name} of step {step} differs between nodes: " + ", ".join(
                f"{_who(ip, nodes)} {b} bytes, mtime {m}" for ip, (b, m) in sorted(held.items()))
                + ": a stale copy from a run whose ranks were placed otherwise; remove it there")
        elif head not in held and (name in required or not SHARD.match(name)):
            ip = sorted(held)[0]
            fetch.append({"name": name, "from": ip, "bytes": held[ip][0], "mtime_ns": held[ip][1]})
    return fetch, problems


def _rank_key(name: str):
    m = SHARD.match(name)
    return (0, int(m.group(1)), int(m.group(2)), name) if m else (1, 0, 0, name)


class Deadline:
    """The time a gather has left (``--timeout`` from its start): every call to a node waits at most that."""

    def __init__(self, seconds: float, clock=time.monotonic):
        self.seconds, self.clock = seconds, clock
        self.end = clock() + seconds

    def left(self) -> float:
        return max(0.0, self.end - self.clock())


def copy_file(ray, item: dict, path: str, read, digest, deadline: Deadline) -> dict:
    """One file from its node to the same ``path`` on this one: pinned chunk reads (``read``), each with the
    time ``deadline`` leaves; written to a part file of this process's own, synced, then hashed as it is on
    this disk against the sha256 ``digest`` computes on the node."""
    start = time.monotonic()
    src = dest = path
    want = digest.remote(src)
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    part, size = f"{dest}{PART}.{os.getpid()}", item["bytes"]
    offsets = list(range(0, size, CHUNK))
    pending = [read.remote(src, off, CHUNK) for off in offsets[:IN_FLIGHT]]
    try:
        with open(part, "wb") as fh:
            for i in range(len(offsets)):
                data = ray.get(pending.pop(0), timeout=deadline.left())
                if i + IN_FLIGHT < len(offsets):
                    pending.append(read.remote(src, offsets[i + IN_FLIGHT], CHUNK))
                fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        done, mine = os.path.getsize(part), file_sha256(part)      # what the disk holds, not what came
        theirs = ray.get(want, timeout=deadline.left())
        if done != size or mine != theirs:
            raise OSError(f"{item['name']} from node {item['from']}: {done} bytes, sha256 {mine[:16]} on this disk, the "
                          f"node's file {size} bytes, sha256 {theirs[:16]}: changed while copied?")
        os.utime(part, ns=(item["mtime_ns"], item["mtime_ns"]))
        os.replace(part, dest)
    except BaseException:
        if os.path.exists(part):
            os.remove(part)
        raise
    return {**item, "sha256": theirs, "seconds": round(time.monotonic() - start, 2)}


def remove_parts(actor_dir: str) -> list[str]:
    """Part files under ``actor_dir`` (run under the step's lock: their writers are gone), removed."""
    gone = []
    for root, _, files in os.walk(actor_dir):
        for name in files:
            if PART in name:
                os.remove(os.path.join(root, name))
                gone.append(os.path.relpath(os.path.join(root, name), actor_dir))
    return sorted(gone)


def write_record(actor_dir: str, record: dict) -> None:
    """``verl-lab-gathered.json``, whole or not at all (a part file renamed over it)."""
    path = os.path.join(actor_dir, RECORD)
    part = f"{path}.part.{os.getpid()}"
    with open(part, "w") as fh:
        json.dump(record, fh, indent=2, sort_keys=True)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(part, path)


def _merged(before: list, now: list) -> list:
    """The record's copied files: this gather's, and the earlier ones it left in place."""
    names = {c["name"] for c in now}
    return [c for c in before if c.get("name") not in names] + now


def _read_json(path: str):
    try:
        with open(path) as fh:
            found = json.load(fh)
        return found if isinstance(found, dict) else None
    except (OSError, ValueError):
        return None


def _plan_values(plan: dict) -> tuple[str, int]:
    launch = plan["launch"]
    values = dict(o["override"].split("=", 1) for o in launch["overrides"])
    return launch["paths"]["checkpoint_dir"], int(values.get("trainer.nnodes", 1))


def copy_fetched(ray, fetch: list[dict], actor: str, pinned, deadline: Deadline, record: dict, nodes: dict):
    """Each file of ``fetch`` copied from its node (``copy_file``), the record written after each one
    (``record``: the gather's so far, its ``copied`` the earlier gathers' too). Returns (this gather's
    copies, None), or what stopped it as the line's words (a node that hangs: ``deadline`` ran out)."""
    earlier, copied = list(record["copied"]), []
    for item in fetch:
        try:
            got = copy_file(ray, item, os.path.join(actor, item["name"]), pinned(read_chunk, item["from"]),
                            pinned(file_sha256, item["from"]), deadline)
        except ray.exceptions.GetTimeoutError:
            return copied, (f"node {item['from']} did not answer within {deadline.seconds:g} s (copying {item['name']}): "
                            "it hangs or is cut off (journalctl -u verl-lab-ray.service there); what was copied is on "
                            "record, the next gather goes on from there")
        except (OSError, ray.exceptions.RayError) as exc:
            return copied, f"copying failed: {type(exc).__name__}: {exc}"
        print(f"{PASSED}: {item['name']} from {_who(item['from'], nodes)}: {got['bytes']} bytes in "
              f"{got['seconds']:.1f} s, sha256 {got['sha256'][:16]} on both", flush=True)
        copied.append(got)
        record.update(copied=_merged(earlier, copied), bytes=sum(c["bytes"] for c in copied))
        write_record(actor, record)         # after each file: a gather that fails later leaves it on record
    return copied, None


def _checkpoints():
    """verl_lab_box/checkpoints.py (the step lock): placed beside this program as ``verl_lab_checkpoints.py``
    (the folder of a program run by path is the first on its import path), else the repository's."""
    try:
        import verl_lab_checkpoints as checkpoints
    except ImportError:
        from verl_lab_box import checkpoints
    return checkpoints


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="cluster-gather", description=__doc__.split("\n\n")[0])
    ap.add_argument("--plan", default=str(Path(__file__).resolve().parent / "plan.json"))
    ap.add_argument("--step", type=int, required=True)
    ap.add_argument("--timeout", type=float, default=600,
                    help="seconds the gather may take once it holds the step's lock (every call to a node included)")
    args = ap.parse_args(argv)
    try:
        checkpoint_dir, nnodes = _plan_values(json.loads(Path(args.plan).read_text()))
        checkpoints = _checkpoints()
    except (OSError, ValueError, KeyError, TypeError, ImportError) as exc:
        print(f"{FAILED}: the plan {args.plan} or verl_lab_checkpoints.py beside it cannot be read "
              f"({type(exc).__name__}: {exc}): re-run deploy/train.py", flush=True)
        return 2
    step_dir = os.path.join(checkpoint_dir, f"global_step_{args.step}")
    os.makedirs(step_dir, exist_ok=True)            # the head may hold none of the step's files yet
    with checkpoints.step_lock(step_dir, f"cluster gather of step {args.step}",
                               say=lambda words: print(f"{PASSED}: {words}", flush=True)):
        watchdog = threading.Timer(args.timeout + WATCHDOG_S, _give_up, args=(args.step, args.timeout))
        watchdog.daemon = True
        watchdog.start()
        try:
            return gather(args.step, checkpoint_dir, nnodes, args.timeout)
        finally:
            watchdog.cancel()


def _give_up(step: int, seconds: float) -> None:
    print(f"{FAILED} (step {step}, head {os.environ.get('VERL_LAB_NODE_IP')}): the gather did not end within its "
          f"timeout ({seconds:g} s + {WATCHDOG_S} s): a call to Ray that has no timeout of its own hung (connecting to "
          f"the cluster at {os.environ.get('RAY_ADDRESS')}, or asking it for its nodes): is the head's "
          "verl-lab-ray.service running?", flush=True)
    os._exit(1)


def gather(step: int, checkpoint_dir: str, nnodes: int, timeout: float) -> int:
    """The gather of ``step`` under its lock: ``timeout`` seconds from now for all of it."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    started, deadline = time.monotonic(), Deadline(timeout)
    head_ip = os.environ.get("VERL_LAB_NODE_IP")
    try:
        ray.init(address=os.environ.get("RAY_ADDRESS"), _node_ip_address=head_ip, log_to_driver=False)
    except Exception as exc:  # noqa: BLE001 - Ray raises several kinds; each is this one failure
        print(f"{FAILED} (step {step}, head {head_ip}): no Ray cluster at {os.environ.get('RAY_ADDRESS')} "
              f"({type(exc).__name__}: {exc}): is verl-lab-ray.service running on the head?", flush=True)
        return 1
    if __name__ != "__main__":             # imported (tests): the tasks travel by value, as from the script
        import ray.cloudpickle as cloudpickle

        cloudpickle.register_pickle_by_value(sys.modules[__name__])
    here = ray.get_runtime_context().get_node_id()
    alive = {n["NodeManagerAddress"]: n["NodeID"] for n in ray.nodes() if n["Alive"]}
    head = next(ip for ip, nid in alive.items() if nid == here)
    actor = os.path.join(checkpoint_dir, f"global_step_{step}", "actor")
    failed = f"{FAILED} (step {step}, head {head})"
    left = remove_parts(actor) if os.path.isdir(actor) else []
    if left:
        print(f"{PASSED}: removed {len(left)} part file(s) a gather that died left ({', '.join(left[:3])})", flush=True)

    def pinned(fn, ip):
        return ray.remote(num_cpus=0)(fn).options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(alive[ip], soft=False))

    ips = sorted(alive)
    refs = [pinned(listing, ip).remote(actor) for ip in ips]
    try:
        _, waiting = ray.wait(refs, num_returns=len(refs), timeout=deadline.left())
        if waiting:
            hung = [ip for ip, ref in zip(ips, refs) if ref in waiting]
            print("\n".join(f"{failed}: node {ip} did not answer within {timeout:g} s (its listing of "
                            f"global_step_{step}/actor): it hangs or is cut off (journalctl -u verl-lab-ray.service "
                            "there)" for ip in hung), flush=True)
            return 1
        found = ray.get(refs, timeout=deadline.left())
    except ray.exceptions.RayError as exc:
        print(f"{failed}: the nodes {', '.join(ips)} did not all answer ({type(exc).__name__}: {exc})", flush=True)
        return 1
    nodes = dict(zip(ips, found))
    before = _read_json(os.path.join(actor, RECORD)) or {}
    fetch, problems = plan_fetch(head, nodes, step, nnodes, [c["name"] for c in before.get("copied") or []])
    if problems:                            # a line each: the doctor reads them (files/doctor/cluster.toml)
        print("\n".join(f"{failed}: {p}" for p in problems), flush=True)
        return 1
    record = {"step": step, "head": head, "nodes": {ip: {"host": n["host"], "files": n["files"]} for ip, n in nodes.items()},
              "copied": before.get("copied") or [], "bytes": 0, "complete": False}
    copied, problem = copy_fetched(ray, fetch, actor, pinned, deadline, record, nodes)
    if problem:
        print(f"{failed}: {problem}", flush=True)
        return 1
    seconds = round(time.monotonic() - started, 2)
    os.makedirs(actor, exist_ok=True)
    write_record(actor, {**record, "complete": True, "seconds": seconds})
    print(f"{PASSED}: step {step} whole on the head {head}: {len(copied)} file(s), {record['bytes']} bytes "
          f"copied from {len({c['from'] for c in copied})} node(s) of {len(nodes)} in {seconds:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
