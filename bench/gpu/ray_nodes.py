"""Ray nodes on one host, started with the commands the product's Ray units run (standard library only).

A profile with ``nodes > 1`` (bench/gpu/ppo_profiles.py) holds, per node, what the cluster stage places on a
box (``cluster/<host>/``: the rendered ``verl-lab-ray.service``, ``ray.env``, the training unit's drop-in and
``cluster-check``), each node on its own loopback address of the one host. bench/gpu/run_profile.py forms the
cluster with this module before the run and stops it afterwards:

* ``start``: each node's unit as systemd would run it: its ``ExecStartPre`` lines (a worker waits for the
  head with ``ray health-check``), then its ``ExecStart`` (``ray start --head|--address ... --block``) in a
  session of its own, in the unit's ``WorkingDirectory``, with the harness's environment, then the node's
  ``ray.env`` (the unit's ``EnvironmentFile``) over it, and ``CUDA_VISIBLE_DEVICES`` of the node's own GPUs
  (on separate boxes each would see only its own). A node after the head starts once every node before it has
  bound its raylet and object-store sockets: on one host the nodes share the head's session folder, and Ray
  names a node's sockets by the first name free there (``raylet``, ``raylet.1``, ...), so a worker started
  before the head's raylet bound its own took the same name and its raylet died with "bind: Address already in
  use" (seen on a loaded 2-core CI machine). On separate boxes each node has its own session folder. ``User=`` and the sandboxing lines are not applied: the
  device runs everything as root.
* ``wait``: a driver in the env's Python (started before the head, so its start-up is not counted) connects
  to the head as ``cluster-check`` does and reports when every node is alive with its GPUs: the formation time.
* ``preflight``: the training launcher's own cluster step (``check_cluster`` of its preflight part,
  ``train/verl_lab_preflight.py``: ``cluster-check`` in the env's Python with ``ray.env`` beside the plan), as
  its preflight runs it on the head.
* ``stop``: every node's session ended (SIGTERM, then SIGKILL), by the process ids this module started; the
  units' ``ExecStop`` (``ray stop``) would end every Ray process of the host, other runs' too.

    python3 bench/gpu/ray_nodes.py wait --address HOST:PORT --node-ip IP --nodes N --gpus G [--timeout S]
    python3 bench/gpu/ray_nodes.py preflight TRAIN_DIR
"""

from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import json
import os
import re
import shlex
import signal
import socket
import stat
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

START_TIMEOUT_S = 420        # the worker unit's TimeoutStartSec (30 tries of its head wait) and some room
SOCKETS = ("raylet", "plasma_store")    # the sockets each node's raylet binds in the session's sockets/ folder


class NodeError(RuntimeError):
    """A node did not start, or the cluster did not form: the message says which and why."""


@dataclass(frozen=True)
class UnitCommands:
    """What systemd runs for a unit: its ExecStartPre lines, ExecStart, ExecStop (argv lists), its
    EnvironmentFile and WorkingDirectory."""

    pre: list[list[str]]
    start: list[str]
    stop: list[str]
    env_file: str | None
    cwd: str | None


def _argv(line: str, key: str) -> list[str]:
    """An Exec line's command as systemd reads it: ``$$`` is a literal ``$``; a variable (``$X``, ``${X}``)
    would be expanded from the unit's environment, which the rendered units never ask for: refused here."""
    if re.search(r"\$[{\w]", line.replace("$$", "")):
        raise NodeError(f"{key} expands an environment variable, which this harness does not do: {line}")
    return shlex.split(line.replace("$$", "$"))


def unit_commands(text: str) -> UnitCommands:
    """The [Service] section's commands of a rendered unit file."""
    section, pre, values = None, [], {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
            continue
        key, sep, value = line.partition("=")
        if section != "Service" or not sep:
            continue
        if key == "ExecStartPre":
            pre.append(_argv(value, key))
        elif key in ("ExecStart", "ExecStop"):
            values[key] = _argv(value, key)
        elif key in ("EnvironmentFile", "WorkingDirectory"):
            values[key] = value.lstrip("-")
    if "ExecStart" not in values:
        raise NodeError("the unit has no ExecStart")
    return UnitCommands(pre, values["ExecStart"], values.get("ExecStop", []), values.get("EnvironmentFile"),
                        values.get("WorkingDirectory"))


def read_env_file(path: Path) -> dict[str, str]:
    """An EnvironmentFile's ``KEY=VALUE`` lines (comments and blank lines skipped), in order."""
    out = {}
    for line in Path(path).read_text().splitlines():
        line = line.strip()
        if line and not line.startswith(("#", ";")) and "=" in line:
            key, _, value = line.partition("=")
            out[key.strip()] = value
    return out


def node_env(base: dict, node_dir: Path, node: dict) -> dict:
    """A node's environment: the harness's, then its ray.env over it (the unit's EnvironmentFile), then its GPUs."""
    return {**base, **read_env_file(node_dir / "ray.env"), "CUDA_VISIBLE_DEVICES": node["cuda_visible_devices"]}


@dataclass
class Started:
    host: str
    role: str
    address: str
    cuda_visible_devices: str
    process: subprocess.Popen
    commands: UnitCommands
    log: Path
    started_s: float = 0.0
    pre_s: list = field(default_factory=list)

    def record(self) -> dict:
        return {"host": self.host, "role": self.role, "address": self.address, "pid": self.process.pid,
                "cuda_visible_devices": self.cuda_visible_devices, "started_s": round(self.started_s, 2),
                "pre_s": [round(s, 2) for s in self.pre_s], "log": self.log.name,
                "exec_start_pre": [shlex.join(c) for c in self.commands.pre],
                "exec_start": shlex.join(self.commands.start), "exec_stop": shlex.join(self.commands.stop)}


def temp_dir(commands: UnitCommands) -> Path | None:
    """The ``--temp-dir`` a head's ``ray start`` names (the session folders' parent), or None."""
    for i, arg in enumerate(commands.start):
        if arg.startswith("--temp-dir="):
            return Path(arg.split("=", 1)[1])
        if arg == "--temp-dir" and i + 1 < len(commands.start):
            return Path(commands.start[i + 1])
    return None


def bound_sockets(temp: Path, old_session: str | None) -> int:
    """How many nodes have bound both their sockets in the session ``temp/session_latest`` names (0 while it
    still names ``old_session``, an earlier run's, whose socket files outlive their processes)."""
    latest = temp / "session_latest"
    if not latest.exists() or os.path.realpath(latest) == old_session:
        return 0
    counts = dict.fromkeys(SOCKETS, 0)
    try:
        entries = list(os.scandir(latest / "sockets"))
    except FileNotFoundError:
        return 0
    for entry in entries:
        kind = next((k for k in SOCKETS if re.fullmatch(rf"{k}(\.\d+)?", entry.name)), None)
        if kind and stat.S_ISSOCK(entry.stat(follow_symlinks=False).st_mode):
            counts[kind] += 1
    return min(counts.values())


def wait_bound(temp: Path, old_session: str | None, nodes: int, started: list[Started], timeout_s: float) -> None:
    """Wait until ``nodes`` nodes have bound their sockets (see the module's ``start``). NodeError when a started
    node ends meanwhile or they have not within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while bound_sockets(temp, old_session) < nodes:
        ended = next((n for n in started if n.process.poll() is not None), None)
        if ended is not None:
            raise NodeError(f"{ended.role} {ended.host}: `ray start` exited {ended.process.returncode} before its "
                            f"raylet bound its sockets (see {ended.log.name})")
        if time.monotonic() > deadline:
            raise NodeError(f"{nodes} node(s) started, fewer bound their raylet sockets under {temp}/session_latest/"
                            f"sockets in {timeout_s:.0f} s: the next node was not started")
        time.sleep(0.2)


def start(cluster: dict, src: Path, env: dict, log_dir: Path, t0: float, started: list[Started]) -> None:
    """Start every node of ``cluster`` (the profile's record, head first) from the units under ``src``, appending
    each to ``started`` as it starts (so a failure part-way still leaves what to stop); a node after the head once
    the nodes before it have bound their sockets, where the head names its ``--temp-dir``. NodeError when a node's
    ExecStartPre fails, its ``ray start`` exits at once, or the nodes before it never bind their sockets."""
    temp = old_session = None
    for index, node in enumerate(cluster["nodes"]):
        folder = src / node["dir"]
        commands = unit_commands((folder / "verl-lab-ray.service").read_text())
        if index == 0:
            temp = temp_dir(commands)
            if temp is not None and (temp / "session_latest").exists():
                old_session = os.path.realpath(temp / "session_latest")
        elif temp is not None:
            wait_bound(temp, old_session, index, started, START_TIMEOUT_S)
        node_environment = node_env(env, folder, node)
        log = log_dir / f"ray-{node['host']}.log"
        with open(log, "w") as fh:
            fh.write(f"# {node['role']} {node['host']} at {node['address']}, CUDA_VISIBLE_DEVICES="
                     f"{node['cuda_visible_devices']}\n")
            fh.flush()
            pre_s = []
            for pre in commands.pre:
                begun = time.monotonic()
                res = subprocess.run(pre, env=node_environment, cwd=commands.cwd, stdout=fh, stderr=subprocess.STDOUT,
                                     timeout=START_TIMEOUT_S)
                pre_s.append(time.monotonic() - begun)
                if res.returncode:
                    raise NodeError(f"{node['role']} {node['host']}: ExecStartPre exited {res.returncode} (see {log.name})")
            proc = subprocess.Popen(commands.start, env=node_environment, cwd=commands.cwd, stdout=fh,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        started.append(Started(node["host"], node["role"], node["address"], node["cuda_visible_devices"], proc, commands,
                               log, time.monotonic() - t0, pre_s))
        try:
            proc.wait(timeout=1)
        except subprocess.TimeoutExpired:
            continue        # `ray start --block` runs until it is stopped
        raise NodeError(f"{node['role']} {node['host']}: `ray start` exited {proc.returncode} (see {log.name})")


def stop(started: list[Started], grace_s: float = 20) -> list[dict]:
    """End each started node's session (the `ray start` process and the raylet, GCS and workers it started):
    SIGTERM, then SIGKILL after ``grace_s``. What each ended with."""
    for node in started:
        try:
            os.killpg(node.process.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace_s
    out = []
    for node in started:
        try:
            rc = node.process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            rc = None
        killed = False
        try:
            os.killpg(node.process.pid, signal.SIGKILL)     # what is left of its session (workers)
            killed = rc is None
        except ProcessLookupError:
            pass
        if rc is None:
            rc = node.process.wait()
        out.append({"host": node.host, "rc": rc, "killed": killed})
    return out


def form(cluster: dict, src: Path, env: dict, env_python: str, log_dir: Path, timeout_s: float,
         started: list[Started]) -> dict:
    """Start the nodes and wait until every one is alive with its GPUs. The record: the seconds from the head's
    start until the head answered and until every node had joined (``formed_s``), each node's command lines,
    and the nodes as Ray lists them. NodeError when they do not form within ``timeout_s``."""
    head = cluster["nodes"][0]
    address = cluster["address"]
    t0_wall, t0 = time.time(), time.monotonic()

    def record(seen: dict, error: str | None = None) -> dict:
        out = {"address": address, "interface": cluster.get("interface"), "timeout_s": timeout_s,
               "nodes_started": [n.record() for n in started], "nodes_alive": seen.get("nodes", []),
               "head_up_s": round(seen["head_up"] - t0_wall, 2) if seen.get("head_up") else None,
               "formed_s": round(seen["formed"] - t0_wall, 2) if seen.get("formed") else None}
        return {**out, "error": error} if error else out

    with open(log_dir / "ray-wait.log", "w") as wait_log:
        waiter = subprocess.Popen([env_python, str(Path(__file__).resolve()), "wait", "--address", address, "--node-ip",
                                   head["address"], "--nodes", str(len(cluster["nodes"])), "--gpus",
                                   str(head["num_gpus"]), "--timeout", str(int(timeout_s))],
                                  env={**env, **read_env_file(src / head["dir"] / "ray.env")}, stdout=subprocess.PIPE,
                                  stderr=wait_log, text=True)
        try:
            start(cluster, src, env, log_dir, t0, started)
            while waiter.poll() is None:        # a node whose `ray start` ends meanwhile fails the formation at once
                ended = next((n for n in started if n.process.poll() is not None), None)
                if ended is not None:
                    tail = " | ".join(line.strip() for line in ended.log.read_text(errors="replace").splitlines()[-3:])
                    raise NodeError(f"{ended.role} {ended.host}: `ray start` exited {ended.process.returncode} while "
                                    f"the cluster formed (see {ended.log.name}: {tail})")
                if time.monotonic() - t0 > timeout_s + 30:
                    raise NodeError(f"the cluster did not form in {timeout_s:.0f} s (see ray-wait.log)")
                time.sleep(0.2)
        except NodeError as exc:
            waiter.kill()
            waiter.wait()
            raise NodeError(json.dumps(record({}, str(exc)))) from None
        except BaseException:
            waiter.kill()
            waiter.wait()
            raise
        out = waiter.stdout.read()
    lines = [line for line in out.splitlines() if line.startswith("{")]
    seen = json.loads(lines[-1]) if lines else {"error": f"the waiter printed nothing (rc {waiter.returncode})"}
    if waiter.returncode or not seen.get("formed"):
        raise NodeError(json.dumps(record(seen, seen.get("error") or
                                          f"{len(seen.get('nodes', []))} of {len(cluster['nodes'])} nodes joined")))
    return record(seen)


def preflight(train_dir: Path, env: dict, timeout_s: float = 600) -> dict:
    """The launcher's cluster step of its preflight (``check_cluster``), run as the head's launcher would: its
    checks' results, the lines it printed, the seconds."""
    begun = time.monotonic()
    res = subprocess.run([sys.executable, str(Path(__file__).resolve()), "preflight", str(train_dir)], env=env,
                         capture_output=True, text=True, timeout=timeout_s)
    lines = [line for line in res.stdout.splitlines() if line.startswith("{")]
    found = json.loads(lines[-1]) if lines else {"results": []}
    return {"rc": res.returncode, "seconds": round(time.monotonic() - begun, 2), "results": found["results"],
            "output": (res.stdout + res.stderr)[-4000:]}


# ------------------------------------------------------------------ the child programs


def _wait(address: str, node_ip: str, nodes: int, gpus: float, timeout_s: float) -> int:
    """Connect to the head once its port answers, then poll Ray's node table until ``nodes`` nodes are alive,
    each with ``gpus`` GPUs; print the wall times and the nodes as JSON."""
    deadline = time.monotonic() + timeout_s
    host, port = address.rsplit(":", 1)
    seen: dict = {"nodes": []}

    def done(rc: int, **more) -> int:
        print(json.dumps({**seen, **more}), flush=True)
        return rc

    while True:                       # the GCS port first: ray.init against nothing waits a long time
        try:
            socket.create_connection((host, int(port)), timeout=1).close()
            break
        except OSError:
            if time.monotonic() > deadline:
                return done(1, error=f"nothing answers at {address}")
            time.sleep(0.2)
    import ray

    while True:
        try:
            ray.init(address=address, _node_ip_address=node_ip, log_to_driver=False)
            break
        except Exception as exc:  # noqa: BLE001 - the head's raylet may not have registered yet
            if time.monotonic() > deadline:
                return done(1, error=f"could not connect to {address}: {type(exc).__name__}: {exc}")
            ray.shutdown()
            time.sleep(0.5)
    seen["head_up"] = time.time()
    while True:
        alive = [{"ip": n["NodeManagerAddress"], "gpus": n["Resources"].get("GPU", 0),
                  "cpus": n["Resources"].get("CPU", 0)} for n in ray.nodes() if n["Alive"]]
        seen["nodes"] = sorted(alive, key=lambda n: n["ip"])
        if len(alive) >= nodes and all(n["gpus"] >= gpus for n in alive):
            seen["formed"] = time.time()
            return done(0)
        if time.monotonic() > deadline:
            return done(1, error=f"{len(alive)} of {nodes} nodes alive after {timeout_s:.0f} s")
        time.sleep(0.2)


def _preflight(train_dir: str) -> int:
    """``check_cluster`` of the launcher in ``train_dir`` (loaded from its file), with this environment."""
    path = os.path.join(train_dir, "train-launcher")
    loader = importlib.machinery.SourceFileLoader("verl_lab_train_launcher", path)
    spec = importlib.util.spec_from_loader(loader.name, loader)
    launcher = importlib.util.module_from_spec(spec)
    loader.exec_module(launcher)
    preflight = launcher.preflight_module()
    rep = preflight.Report()
    preflight.check_cluster(rep, launcher.load_launch(os.path.join(train_dir, launcher.PLAN_NAME)))
    print(json.dumps({"results": rep.results}), flush=True)
    return 1 if rep.failed or not rep.results else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("wait")
    w.add_argument("--address", required=True)
    w.add_argument("--node-ip", required=True)
    w.add_argument("--nodes", type=int, required=True)
    w.add_argument("--gpus", type=float, default=0)
    w.add_argument("--timeout", type=float, default=120)
    p = sub.add_parser("preflight")
    p.add_argument("train_dir")
    args = ap.parse_args(argv)
    if args.cmd == "wait":
        return _wait(args.address, args.node_ip, args.nodes, args.gpus, args.timeout)
    return _preflight(args.train_dir)


if __name__ == "__main__":
    sys.exit(main())
