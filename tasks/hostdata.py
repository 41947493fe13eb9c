"""The bridge from pyinfra's inventory to LabSettings.

``check_inventory()`` checks every host's data before any operation is prepared, so a bad
value anywhere stops the run before any host changes, with every problem of every host listed
(tasks/validation.py: settings, clusters, the data stage's plan, and the training plan where host
data gives the GPU).
"""

from __future__ import annotations

from pyinfra import host, inventory

from tasks.plan import GpuTarget
from tasks.settings import Cluster, LabSettings, SettingsError, check_clusters, load_settings
from tasks.validation import inventory_problems

_CHECKED = False
_CACHE: dict[str, LabSettings] = {}
_CLUSTERS: dict[str, "Cluster"] = {}


class InventoryError(SystemExit):
    """Raised before anything runs; pyinfra prints it and exits non-zero."""


def settings_for(target=None) -> LabSettings:
    target = target or host
    if target.name not in _CACHE:
        _CACHE[target.name] = load_settings(target.name, target.data.dict())
    return _CACHE[target.name]


def cluster_for(target=None) -> Cluster | None:
    """The Ray cluster the host trains in (checked with every host's data), or None: it trains alone."""
    target = target or host
    return next((c for c in _CLUSTERS.values() if target.name in c.members), None)


def member_targets(cluster: Cluster, own: str, target: GpuTarget) -> dict[str, GpuTarget | None]:
    """Prepare time: every member's GPU target (the other boxes' GPU facts, or their gpu_override)."""
    from tasks.facts.gpu import NvidiaGpus
    from tasks.target import decide_gpu

    found = {}
    for name in cluster.members:
        if name == own:
            found[name] = target
            continue
        other = inventory.get_host(name)
        ov = settings_for(other)
        found[name] = decide_gpu(ov, None if ov.gpu_override else other.get_fact(NvidiaGpus)).target
    return found


def check_inventory(hosts=None) -> None:
    """Check every host's data once per run (``hosts`` defaults to pyinfra's inventory)."""
    global _CHECKED
    if _CHECKED:
        return
    problems: list[str] = []
    checked, in_groups = {}, {}
    for each in hosts if hosts is not None else inventory:
        try:
            checked[each.name] = settings_for(each)
        except SettingsError as exc:
            problems += [str(each) for each in exc.problems]
        inv = getattr(each, "inventory", None)
        if inv is not None and "cluster" not in inv.get_host_data(each.name):   # its groups decide its cluster
            in_groups[each.name] = {g: inv.get_group_data(g)["cluster"] for g in each.groups
                                    if inv.get_group_data(g).get("cluster")}
    clusters, cluster_problems = check_clusters(checked, in_groups)
    _CLUSTERS.update(clusters)
    problems += [str(p) for p in cluster_problems]
    # the data stage's plan of every host, the training plan of every host whose GPU host data gives
    problems += [str(p) for p in inventory_problems(checked, clusters)]
    _CHECKED = True
    if problems:
        raise InventoryError(
            "verl-lab: the inventory has errors; nothing was changed on any host:\n  "
            + "\n  ".join(problems)
        )


def every_host_once_all_answered(key: str, value) -> dict | None:
    """A deploy file runs once per host, side by side: keep this host's ``value`` on pyinfra's run
    state under ``key``; the last host to answer gets every host's value (by host name, sorted),
    the others None. For a lab-wide report (deploy/status.py, deploy/doctor.py)."""
    from pyinfra import state

    found = state.__dict__.setdefault(f"verl_lab_{key}", {})
    found[host.name] = value
    return dict(sorted(found.items())) if len(found) == len(state.inventory.get_active_hosts()) else None


def write_json(path, data) -> None:
    """``data`` as JSON at ``path``, whole or not at all (``.part`` then a rename)."""
    import json
    import os
    from pathlib import Path

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    part = path.with_name(path.name + ".part")
    part.write_text(json.dumps(data, indent=2, allow_nan=False))
    os.replace(part, path)
