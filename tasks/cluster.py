"""Boxes that train together: one Ray cluster, verl's own engine for many machines.

Host data ``cluster = {"name": "lab1", "head": "box1", "port": 6379}`` (the same value on every
member: set it once in the group's group_data) puts a box in a cluster; ``cluster_address`` is
a box's IPv4 address on the cluster network (the head needs one, or an IP literal as its
``ssh_hostname``; a worker without one uses the source address of its route to the head).
Default: no cluster, every box trains alone, and this stage does nothing at all.

The setting is checked with every other setting (``tasks.settings``: ``check_clusters`` across
hosts, before any host changes), and the cluster's plan is pure planning (``tasks.plan``:
``cluster_plan``, precision and memory by the weakest GPU, ``trainer.nnodes`` and
``trainer.n_gpus_per_node``). Pure parts here: the network interface NCCL and Gloo use
(``choose_interface``, from ``ip -o route get <head>``) and ``/etc/hosts`` such that the box's
hostname resolves to its node address (``hosts_file``). The stage ``install_cluster``
places a Ray head or worker unit (files/templates/verl-lab-ray.service.j2) running the env's Ray
as the train user, its environment file, and a drop-in that gives the training unit RAY_ADDRESS
and the interface.
"""

from __future__ import annotations

import ipaddress
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from pyinfra import host
from pyinfra.api import deploy
from pyinfra.operations import server, systemd

from tasks.facts.bundle import ask
from tasks.facts.cluster import HostnameLookup, RouteToHead
from tasks.facts.files import PathStates, UnitState
from tasks.failure import fail_host
from tasks.hostdata import member_targets
from tasks.placed import place, rendered, wanted_dir, wanted_file
from tasks.plan import GpuTarget, PlanError, cluster_plan, workload_for
from tasks.settings import RAY_UNIT, TRAIN_UNIT, Cluster, LabSettings, ipv4
from tasks.tracking import keys_for_box, run_name_of, tracking_values

TEMPLATES = Path(__file__).resolve().parent.parent / "files" / "templates"
UNIT_TEMPLATE = TEMPLATES / "verl-lab-ray.service.j2"
ENV_TEMPLATE = TEMPLATES / "ray.env.j2"
DROPIN_TEMPLATE = TEMPLATES / "train-cluster.conf.j2"
CHECKER = Path(__file__).resolve().parent.parent / "verl_lab_box" / "cluster_check.py"
GATHERER = Path(__file__).resolve().parent.parent / "verl_lab_box" / "cluster_gather.py"
RAY_UNIT_PATH = f"/etc/systemd/system/{RAY_UNIT}"
TRAIN_DROPIN = f"/etc/systemd/system/{TRAIN_UNIT}.d/cluster.conf"
HEAD_WAIT_TRIES = 30             # a worker asks for the head 30 times, 2 s apart, then fails (and restarts)
GCS_RECONNECT_S = 20             # a worker's raylet gives up on a vanished head after this (Ray's default: 60)
HOSTS_MARK = "# verl-lab cluster"        # ends the one /etc/hosts line this stage manages
HOSTS_OFF = HOSTS_MARK + ", was: "      # starts a line of /etc/hosts that mapped the hostname elsewhere


class ClusterError(ValueError):
    """The box cannot join its cluster as it is; the message says why and what to change."""


@dataclass(frozen=True)
class Interface:
    name: str                    # NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME
    address: str                 # this box's source address towards the head
    reason: str


def _addr_owner(addrs: str, address: str) -> str | None:
    """The interface of ``ip -o -4 addr show`` output that holds ``address`` (or its subnet)."""
    want, best = ipaddress.IPv4Address(address), None
    for line in addrs.splitlines():
        cells = line.split()
        if len(cells) >= 4 and cells[2] == "inet":
            net = ipaddress.IPv4Interface(cells[3])
            if net.ip == want:
                return cells[1]
            if want in net.network and best is None:
                best = cells[1]
    return best


def choose_interface(route: str, addrs: str, head: str) -> Interface:
    """One concrete interface for NCCL and Gloo (Gloo takes no ``^lo``-style patterns), from the
    ``RouteToHead`` fact. The head itself (a ``local`` route) takes the interface holding its
    address; loopback only when the head's address is itself a loopback one (every node on
    one machine); a missing or unreachable route raises ClusterError."""
    first = route.splitlines()[0] if route.strip() else ""
    cells = first.split()
    loopback = ipaddress.IPv4Address(head).is_loopback
    if not cells or "dev" not in cells or cells[0] in ("unreachable", "blackhole", "prohibit", "throw"):
        raise ClusterError(f"no route from this box to the head {head}: {first or 'ip printed nothing'}; "
                           "fix the network (or cluster_address) so that `ip route get " + head + "` names an interface")
    dev = cells[cells.index("dev") + 1]
    src = cells[cells.index("src") + 1] if "src" in cells else head
    if cells[0] == "local":
        owner = "lo" if loopback else _addr_owner(addrs, head)
        if not owner or (owner == "lo" and not loopback):
            raise ClusterError(f"{head} is this box's own address but no network interface holds it "
                               f"({owner or 'none found'}): other boxes cannot reach it; use an address of a real interface")
        why = ("the head's address is a loopback address: every node is on this machine" if loopback
               else f"this box is the head; {owner} holds {head}")
        return Interface(owner, head, why)
    if dev == "lo" and not loopback:
        raise ClusterError(f"the route to the head {head} goes over the loopback interface: {first}")
    via = f" via the gateway {cells[cells.index('via') + 1]}" if "via" in cells else ""
    return Interface(dev, src, f"the route to the head {head} leaves by {dev}{via} (source {src})")


def hosts_file(lookup: Mapping[str, Any], address: str) -> tuple[str | None, str]:
    """``/etc/hosts`` such that the box's hostname resolves to ``address`` (its node address, which
    NCCL, Gloo and Ray look the hostname up for), from the HostnameLookup fact; None, and why, where
    nothing is to change: the hostname resolves to it already, or ``address`` is a loopback one
    (every node on one machine, whose /etc/hosts they may share: left as it is).

    One managed line (ending with HOSTS_MARK) comes first and names the hostname (and the names
    that mapped it elsewhere, e.g. its FQDN); it replaces a previous one. An IPv4 line that mapped
    the hostname elsewhere (Debian's ``127.0.1.1 box1.lab box1``) stays, as a comment (HOSTS_OFF),
    followed by its other names if it has any: with ``multi on`` in /etc/host.conf (Debian's and
    Ubuntu's default) glibc answers every matching line and getaddrinfo sorts 127/8 first (RFC 6724:
    the smaller scope), so a first line alone would not win. No other line changes."""
    name, resolves = lookup.get("hostname", ""), list(lookup.get("resolves") or [])
    if ipaddress.IPv4Address(address).is_loopback:
        return None, (f"/etc/hosts left as it is: the node's address {address} is a loopback one (every node "
                      "on one machine, which may share one /etc/hosts)")
    if not name:
        return None, "/etc/hosts left as it is: the box's hostname could not be read"
    if resolves[:1] == [address]:
        return None, f"{name} resolves to {address}"
    short, mine, kept = name.split(".")[0], [], []
    for line in lookup.get("hosts", "").splitlines():
        cells = line.split("#", 1)[0].split()
        ours = [n for n in cells[1:] if n == short or n.startswith(short + ".")]
        managed = line.rstrip().endswith(HOSTS_MARK)    # the managed line of an earlier run: replaced
        if not managed and (not ours or cells[0] == address or not ipv4(cells[0])):
            kept.append(line)
            continue
        mine += [n for n in ours if n not in mine]
        rest = [n for n in cells[1:] if n not in ours]
        kept += [] if managed else [HOSTS_OFF + line] + ([f"{cells[0]}\t{' '.join(rest)}"] if rest else [])
    names = mine + [name] * (name not in mine)
    text = "\n".join([f"{address}\t{' '.join(names)}  {HOSTS_MARK}", *kept]) + "\n"
    if text == lookup.get("hosts"):
        raise ClusterError(f"{name} resolves to {', '.join(resolves) or 'nothing'} though /etc/hosts maps it to "
                           f"{address}: the hosts line of /etc/nsswitch.conf asks another source first; "
                           "put files first")
    return text, f"{name} resolved to {', '.join(resolves) or 'nothing'}, not the node's address {address}"


def write_hosts_command(text: str) -> str:
    """Shell: ``/etc/hosts`` made ``text``, written in place (a bind-mounted or linked /etc/hosts stays one)."""
    return (f"printf '%s' {shlex.quote(text)} > /etc/hosts.verl-lab && cat /etc/hosts.verl-lab > /etc/hosts"
            " && rm -f /etc/hosts.verl-lab")


def hosts_restored(text: str) -> str | None:
    """``/etc/hosts`` as it was before ``hosts_file`` changed it (None: it holds nothing of this stage's): the
    managed line removed, each line it turned into a comment (HOSTS_OFF) restored, and the line of that line's
    other names which ``hosts_file`` wrote after it dropped. Every other line stays as it is."""
    lines = text.splitlines()
    managed = [line for line in lines if line.rstrip().endswith(HOSTS_MARK)]
    if not managed and not any(line.startswith(HOSTS_OFF) for line in lines):
        return None
    ours = {n for line in managed for n in line.split("#", 1)[0].split()[1:]}
    out, skip = [], None
    for line in lines:
        if line in managed:
            continue
        if skip is not None and line == skip:
            skip = None
            continue
        skip = None
        if line.startswith(HOSTS_OFF):
            line = line[len(HOSTS_OFF):]
            cells = line.split("#", 1)[0].split()
            rest = [n for n in cells[1:] if n not in ours]
            skip = f"{cells[0]}\t{' '.join(rest)}" if cells and rest else None
        out.append(line)
    return "\n".join(out) + "\n" if out else ""


# ------------------------------------------------------------------ the stage


@dataclass(frozen=True)
class RayNode:
    """One box's Ray unit, environment and training drop-in (pure)."""

    settings: LabSettings
    cluster: Cluster
    interface: Interface
    num_gpus: int
    plan_env: Mapping[str, str]
    # the head's only (``head_tracking``): verl's trackers run in its TaskRunner, a Ray worker of the head
    tracking: Mapping[str, Any] = field(default_factory=dict)

    @property
    def role(self) -> str:
        return self.cluster.role(self.settings.host)

    @property
    def node_address(self) -> str:
        s = self.settings
        return s.cluster_address or (self.cluster.head_address if self.role == "head" else self.interface.address)

    def values(self) -> dict:
        s = self.settings
        return {"host": s.host, "role": self.role, "cluster": self.cluster.name, "node_address": self.node_address,
                "head_address": self.cluster.address, "port": self.cluster.port, "num_gpus": self.num_gpus,
                "ray": f"{s.env_prefix}/bin/ray", "ray_dir": ray_dir(s), "env_file": ray_env_file(s),
                "train_user": s.train_user, "home": f"{s.lab_root}/home", "env_prefix": s.env_prefix,
                "cuda_prefix": s.cuda_prefix, "interface": self.interface, "hf_endpoint": s.mirrors.base("huggingface"),
                "plan_env": dict(self.plan_env), "unit_name": RAY_UNIT, "wait_tries": HEAD_WAIT_TRIES,
                "gcs_reconnect_s": GCS_RECONNECT_S, "tracking_env": {}, "tracking_keys_file": None,
                "tracking_keys_digest": "", **self.tracking}


def head_tracking(settings: LabSettings, run_name: str) -> dict:
    """What the head's Ray unit needs for verl's trackers: their environment (``ray.env``) and the keys file
    of an online run (a second, optional EnvironmentFile of the unit; its digest in ``ray.env``, so a new key
    restarts the unit). verl 0.5.0 makes its ``Tracking`` in ``RayPPOTrainer.fit``, inside the TaskRunner
    actor (on the head: patch 0010), and a Ray worker has the environment its node's ``ray start`` had plus
    the job's runtime env, which forwards only verl's own few variables (``get_ppo_ray_runtime_env``): the
    training unit's environment does not reach it on a cluster."""
    tracked = tracking_values(settings.tracking, settings.lab_root, settings.train_dir, run_name,
                              keys_for_box(settings.tracking))
    return {k: tracked[k] for k in ("tracking_env", "tracking_keys_file", "tracking_keys_digest")}


def ray_dir(settings: LabSettings) -> str:
    """Holds Ray's temp dir ``tmp/`` (sessions, sockets: the head's, which every worker uses too;
    Ray makes it mode 777, so it lives inside this folder of the train user's)."""
    return f"{settings.lab_root}/ray"


def ray_env_file(settings: LabSettings) -> str:
    return f"{settings.train_dir}/ray.env"


def cluster_paths(settings: LabSettings) -> list[str]:
    return [ray_dir(settings), ray_env_file(settings), f"{settings.train_dir}/cluster-check",
            f"{settings.train_dir}/cluster-gather", RAY_UNIT_PATH,
            str(Path(TRAIN_DROPIN).parent), TRAIN_DROPIN]


def cluster_wanted(node: RayNode) -> list:
    s, values = node.settings, node.values()
    return [wanted_dir(ray_dir(s), "Ray's folder (the train user's)", mode="750", user=s.train_user,
                       group=s.train_user),
            wanted_file(ray_env_file(s), f"Ray {node.role} environment file", rendered(ENV_TEMPLATE, **values),
                        mode="640", group=s.train_user),
            wanted_file(f"{s.train_dir}/cluster-check", "Cluster check (verl_lab_box/cluster_check.py)",
                        CHECKER.read_bytes(), mode="750", group=s.train_user),
            wanted_file(f"{s.train_dir}/cluster-gather", "Cluster gather (verl_lab_box/cluster_gather.py)",
                        GATHERER.read_bytes(), mode="750", group=s.train_user),
            wanted_file(RAY_UNIT_PATH, f"Unit {RAY_UNIT} ({node.role})", rendered(UNIT_TEMPLATE, **values)),
            wanted_dir(str(Path(TRAIN_DROPIN).parent)),
            wanted_file(TRAIN_DROPIN, f"{TRAIN_UNIT} in cluster {node.cluster.name}", rendered(DROPIN_TEMPLATE, **values))]


def training_in(cluster: Cluster | None, settings: LabSettings, gpu) -> tuple[LabSettings, dict | None]:
    """What the training stage gets on a cluster member: every member's GPU target (one plan for
    the cluster) and, on a worker, a unit left installed, not enabled (training runs from the
    head, over Ray). A box alone: its own settings, no targets, nothing asked."""
    if cluster is None:
        return settings, None
    targets = member_targets(cluster, settings.host, gpu.target)
    return (settings if cluster.role(settings.host) == "head" else replace(settings, train_unit_state="installed"),
            targets)


@deploy("verl-lab Ray cluster node")
def install_cluster(settings: LabSettings, gpu, cluster: Cluster, targets: Mapping[str, GpuTarget | None]):
    """The box's Ray unit (head or worker), its environment and the training unit's drop-in; the
    unit (re)started when they changed or it is not running."""
    route, states, unit, lookup = ask((RouteToHead, {"address": cluster.head_address}),
                                      (PathStates, {"paths": cluster_paths(settings)}), (UnitState, {"unit": RAY_UNIT}),
                                      (HostnameLookup, {}))
    missing = sorted(n for n, t in targets.items() if t is None)
    try:
        if missing:
            raise ClusterError(f"no GPU target on {', '.join(missing)} (see its training stage)")
        interface = choose_interface(route["route"], route["addrs"], cluster.head_address)
        plan = cluster_plan(targets, workload_for(settings))
        tracked = (head_tracking(settings, run_name_of(plan.overrides)) if cluster.role(settings.host) == "head"
                   else {})
        node = RayNode(settings, cluster, interface, gpu.target.count, plan.env, tracked)
        hosts, hosts_why = hosts_file(lookup, node.node_address)
    except (ClusterError, PlanError) as exc:
        fail_host(name=f"Ray {cluster.role(settings.host)} of cluster {cluster.name}", message=str(exc),
                  stage="cluster")
        return
    if hosts is None:
        host.noop(hosts_why)
    else:       # written in place (a bind-mounted or linked /etc/hosts stays one), then looked up again
        address = node.node_address
        server.shell(name=f"/etc/hosts: the hostname resolves to {address} ({hosts_why})", commands=[
            write_hosts_command(hosts),
            f"got=$(getent ahostsv4 \"$(hostname)\" | awk '{{ print $1; exit }}'); [ \"$got\" = {address} ] || "
            f"{{ echo \"verl-lab: $(hostname) still resolves to ${{got:-nothing}}, not {address}: see the hosts "
            "line of /etc/nsswitch.conf\" >&2; exit 1; }"])
    changed = [p for p, why in place(cluster_wanted(node), states).items() if why]
    if RAY_UNIT_PATH in changed or TRAIN_DROPIN in changed:
        systemd.daemon_reload(name="systemd reads the changed units")
    unit = unit or UnitState.default()
    if not unit["enabled"]:
        systemd.service(name=f"Unit {RAY_UNIT}: enabled", service=RAY_UNIT, enabled=True, running=None)
    restart = [p for p in changed if p in (ray_env_file(settings), RAY_UNIT_PATH)]   # what `ray start` reads
    if restart or not unit["active"]:
        why = "changed: " + ", ".join(restart) if restart else "not running"
        server.shell(name=f"Unit {RAY_UNIT}: (re)started ({why})",
                     commands=[f"systemctl reset-failed {RAY_UNIT} 2>/dev/null || true; systemctl restart {RAY_UNIT}"])
    else:
        host.noop(f"Ray {node.role} of cluster {cluster.name} at {node.node_address} running "
                  f"(NCCL/Gloo over {interface.name})")

