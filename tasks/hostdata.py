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


# the keys a host's training plan and box checks read: a bad value of one of them leaves that host's
# plan unchecked until it is fixed (its default would be checked instead of what the user meant)
PLAN_KEYS = ("workload", "model_artifact", "dataset_artifact", "gpu_override", "catalog_overrides", "cluster",
             "checkpoints", "train_steps", "mirror_profile", "mirror_urls", "artifact_mode", "driver",
             "allow_no_driver", "lab_root")
HEADER = "verl-lab: the inventory has errors; nothing was changed on any host:"
_PROBLEMS: list = []          # the inventory pass's problems of the hosts in this run
_IN_RUN: list[str] = []       # the hosts of this run, in inventory order (pyinfra's --limit)


def misspelt_keys(data: dict) -> set[str]:
    """The keys of a host's data that are near misses of verl-lab's (pyinfra would ignore them: the
    defaults apply), at the top level and in ``workload``/``checkpoints``."""
    from tasks.settings import CHECKPOINT_DEFAULTS, WORKLOAD_DEFAULTS, near_miss
    found = {k for k in data if near_miss(k)}
    for key, known in (("workload", WORKLOAD_DEFAULTS), ("checkpoints", CHECKPOINT_DEFAULTS)):
        if isinstance(data.get(key), dict):
            found |= {f"{key}.{k}" for k in data[key] if k not in known}
    return found


def checked_settings(name: str, data: dict) -> tuple[LabSettings | None, list[SettingsError]]:
    """A host's settings and every problem of its data. A host whose problems are misspelt keys, or
    bad values the plan does not read, still gets settings (those keys at their defaults), so its
    plan and box are checked in the same run; None where a value the plan reads is bad."""
    try:
        return load_settings(name, data), []
    except SettingsError as exc:
        problems = exc.problems
    misspelt = misspelt_keys(data)
    bad = {p.key.split(".")[0] for p in problems if p.key not in misspelt}
    if bad & set(PLAN_KEYS):
        return None, problems
    kept = {}
    for key, value in data.items():
        if key in misspelt or key in bad:
            continue
        if key in ("workload", "checkpoints") and isinstance(value, dict):
            value = {k: v for k, v in value.items() if f"{key}.{k}" not in misspelt}
        kept[key] = value
    try:
        return load_settings(name, kept), problems
    except SettingsError:
        return None, problems


def hosts_in_run(hosts=None) -> list:
    """The hosts this run acts on: pyinfra's --limit/--exclude (State.limit_hosts), else all."""
    if hosts is not None:
        return list(hosts)
    from pyinfra.context import ctx_state
    limit = getattr(ctx_state.get(), "limit_hosts", None) if ctx_state.isset() else None
    return list(limit) if limit is not None else list(inventory)


def check_inventory(hosts=None, stop: bool = True, everyone=None) -> list[SettingsError]:
    """Check every host's data once per run and return the problems of the hosts in the run
    (``hosts``: default pyinfra's --limit, else the inventory; ``everyone``: every host of the
    inventory, read for the clusters across hosts). ``stop``: raise them all at once, if any."""
    global _CHECKED
    if not _CHECKED:
        run = hosts_in_run(hosts)
        everyone = list(everyone) if everyone is not None else (list(run) if hosts is not None else list(inventory))
        names = {h.name for h in run}
        checked, in_groups, problems = {}, {}, []
        for each in everyone:
            settings, found = checked_settings(each.name, each.data.dict())
            if settings is not None:
                checked[each.name] = _CACHE[each.name] = settings
            problems += found
            inv = getattr(each, "inventory", None)
            if inv is not None and "cluster" not in inv.get_host_data(each.name):   # its groups decide its cluster
                in_groups[each.name] = {g: inv.get_group_data(g)["cluster"] for g in each.groups
                                        if inv.get_group_data(g).get("cluster")}
        clusters, cluster_problems = check_clusters(checked, in_groups)
        _CLUSTERS.update(clusters)
        problems += cluster_problems
        # the data stage's plan of every host, the training plan of every host whose GPU host data gives
        problems += inventory_problems(checked, clusters)
        _PROBLEMS[:] = [p for p in problems if p.host in names]
        _IN_RUN[:] = [h.name for h in run]
        _CHECKED = True
    if stop and _PROBLEMS:
        raise InventoryError(report(_PROBLEMS))
    return list(_PROBLEMS)


def report(problems, header: str = HEADER) -> str:
    return header + "\n  " + "\n  ".join(str(p) for p in problems)


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
