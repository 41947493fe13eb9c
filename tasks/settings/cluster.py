"""The cluster setting: each box's ``cluster`` and ``cluster_address`` values (checkers in
``tasks.settings``' form, run by ``load_settings``), and the clusters across hosts
(``check_clusters``: every member's data agrees, the head is a member with an address), checked
with every host's settings before any host changes (``tasks.hostdata.check_inventory``). The
stage that forms the Ray cluster: ``tasks/cluster.py``.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tasks.settings.errors import SettingsError, SettingsErrors

CLUSTER_EXAMPLE = "cluster = {'name': 'lab1', 'head': 'box1'} on every box of the cluster (e.g. in its group_data)"
CLUSTER_NAME_RE = re.compile(r"^[a-z][a-z0-9_-]{0,30}$")


CLUSTER_KEYS = ("name", "head", "port")


def _cluster(host: str, value: Any) -> dict[str, Any] | None:
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise SettingsError(host, "cluster", f"{value!r} is not a mapping", f"set {CLUSTER_EXAMPLE}")
    found = [SettingsError(host, f"cluster.{key}", "not a cluster key", "use name, head and port")
             for key in value if key not in CLUSTER_KEYS]
    for key in ("name", "head"):
        if not isinstance(value.get(key), str) or not value[key].strip():
            found.append(SettingsError(host, f"cluster.{key}", "missing" if key not in value else f"{value[key]!r} "
                                       "is not a name", f"set {CLUSTER_EXAMPLE}" + (
                                           " (head: the inventory name of the box that runs Ray's head)"
                                           if key == "head" else "")))
    if isinstance(value.get("name"), str) and value["name"].strip() and not CLUSTER_NAME_RE.match(value["name"]):
        found.append(SettingsError(host, "cluster.name", f"{value['name']!r} is not a short lowercase name",
                                   "use letters, digits, '-' or '_', e.g. 'lab1'"))
    port = value.get("port", 6379)
    if not isinstance(port, int) or isinstance(port, bool) or not 1024 <= port <= 65535:
        found.append(SettingsError(host, "cluster.port", f"{port!r} is not a port from 1024 to 65535",
                                   "leave it out for Ray's default 6379, or set a free port"))
    if found:
        raise SettingsErrors(found)
    return {"name": value["name"], "head": value["head"], "port": port}


def _ip_address(host: str, key: str, value: Any) -> str | None:
    if value is None:
        return None
    try:
        return str(ipaddress.IPv4Address(value))
    except (ipaddress.AddressValueError, ValueError):
        raise SettingsError(host, key, f"{value!r} is not an IPv4 address",
                            "set the box's address on the cluster network, e.g. '10.0.0.5'") from None


# the cluster setting across hosts (every member's data agrees, the head is a member with an address):
# checked with every host's settings before any host changes (tasks/hostdata.check_inventory)


@dataclass(frozen=True)
class Cluster:
    name: str
    head: str
    head_address: str
    port: int
    members: tuple[str, ...]

    @property
    def address(self) -> str:
        return f"{self.head_address}:{self.port}"

    def role(self, host: str) -> str:
        return "head" if host == self.head else "worker"


def ipv4(value: Any) -> str | None:
    try:
        return str(ipaddress.IPv4Address(str(value)))
    except ValueError:
        return None


def check_clusters(settings: Mapping[str, Any],
                   group_values: Mapping[str, Mapping[str, Any]] | None = None) -> tuple[dict[str, Cluster], list[SettingsError]]:
    """Every cluster of the inventory, and what is wrong with the setting across hosts (a head
    outside its cluster, members that disagree, a head without an address, a box put in two
    clusters by two of its groups). ``settings``: host -> its ``tasks.settings.LabSettings`` (not
    imported: that module imports this one; its cluster, cluster_address and raw are read).
    ``group_values``: host -> {group: the cluster value that group's data sets}, for boxes whose
    own host data does not set one."""
    problems: list[SettingsError] = []
    for host, by_group in sorted((group_values or {}).items()):
        names = sorted({f"{g}: {v.get('name')}" for g, v in by_group.items() if isinstance(v, Mapping)})
        if len({v.get("name") for v in by_group.values() if isinstance(v, Mapping)}) > 1:
            problems.append(SettingsError(host, "cluster", f"the box is in two clusters ({', '.join(names)})",
                                          "take it out of one of these groups, or set its own cluster in host data"))
    members: dict[str, list[str]] = {}
    for host, s in settings.items():
        if s.cluster:
            members.setdefault(s.cluster["name"], []).append(host)
    clusters = {}
    for name, hosts in sorted(members.items()):
        first = settings[hosts[0]].cluster
        odd = [h for h in hosts if settings[h].cluster != first]
        if odd:
            problems.append(SettingsError(odd[0], "cluster", f"{settings[odd[0]].cluster!r} differs from "
                                          f"{hosts[0]}'s {first!r} in cluster {name!r}",
                                          f"give every box of {name} the same value (once, in its group's group_data)"))
            continue
        head = first["head"]
        if head not in hosts:
            problems.append(SettingsError(hosts[0], "cluster.head", f"{head!r} is not a box of cluster {name!r} "
                                          f"(its boxes: {', '.join(sorted(hosts))})",
                                          f"name one of them as the head, or put {head} in cluster {name}"))
            continue
        hs = settings[head]
        address = hs.cluster_address or ipv4(hs.raw.get("ssh_hostname") or head)
        if not address:
            problems.append(SettingsError(head, "cluster_address", f"the head of cluster {name!r} has no address "
                                          "the workers can be given", "set cluster_address = '<its IPv4 address "
                                          "on the cluster network>' in its host data"))
            continue
        clusters[name] = Cluster(name, head, address, first["port"], tuple(sorted(hosts)))
    return clusters, problems
