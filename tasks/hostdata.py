"""The bridge from pyinfra's inventory to LabSettings.

``check_inventory()`` checks every host's data before any operation is prepared, so a bad
value anywhere stops the run before any host changes, with every problem of every host listed
(tasks/validation.py: settings, clusters, the data stage's plan, and the training plan where host
data gives the GPU).
"""

from __future__ import annotations

import difflib

from pyinfra import host, inventory

from tasks.plan import GpuTarget
from tasks.settings import Cluster, LabSettings, SettingsError, check_clusters, load_settings
from tasks.validation import inventory_problems

_CHECKED = False
_CACHE: dict[str, LabSettings] = {}
_CLUSTERS: dict[str, Cluster] = {}


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


def keys_left_out(data: dict, unread) -> set[str]:
    """The keys of a host's data (dotted keys set inside their settings) that nothing reads: those ``unread``
    names (a near miss, a nested key at the top, an unknown key, a bad dotted key) and the unknown keys in
    ``workload``/``checkpoints``. The host's settings are made without them."""
    from tasks.settings import CHECKPOINT_DEFAULTS, WORKLOAD_DEFAULTS
    found = {p.key for p in unread}
    for key, known in (("workload", WORKLOAD_DEFAULTS), ("checkpoints", CHECKPOINT_DEFAULTS)):
        if isinstance(data.get(key), dict):
            found |= {f"{key}.{k}" for k in data[key] if k not in known}
    return found


def checked_settings(name: str, data: dict) -> tuple[LabSettings | None, list[SettingsError]]:
    """A host's settings and every problem of its data. A host whose problems are keys nothing reads, or
    bad values the plan does not read, still gets settings (those keys at their defaults), so its
    plan and box are checked in the same run; None where a value the plan reads is bad."""
    from tasks.settings import host_keys
    try:
        return load_settings(name, data), []
    except SettingsError as exc:
        problems = exc.problems
    data, unread = host_keys(name, data)
    dropped = keys_left_out(data, unread)
    bad = {p.key.split(".")[0] for p in problems if p.key not in dropped}
    if bad & set(PLAN_KEYS):
        return None, problems
    kept = {}
    for key, value in data.items():
        if key in dropped or key in bad:
            continue
        if key in ("workload", "checkpoints") and isinstance(value, dict):
            value = {k: v for k, v in value.items() if f"{key}.{k}" not in dropped}
        kept[key] = value
    try:
        return load_settings(name, kept), problems
    except SettingsError:
        return None, problems


def origin(inv, host, key: str) -> str | None:
    """Where a key of ``host``'s data was set: ``--data``, the host's own data, a group's or all's
    (pyinfra's waterfall: override, host, groups, all); None where the inventory cannot tell."""
    if inv is None:
        return None
    if key in inv.get_override_data():
        return "--data"
    if key in inv.get_host_data(host.name):
        return "the host's own data in the inventory"
    group = next((g for g in reversed(list(host.groups)) if key in inv.get_group_data(g)), None)
    if group and group != "all":
        return f"group {group}'s data (group_data/{group}.py or the inventory)"
    return "all's data (group_data/all.py)" if key in inv.get_data() or group == "all" else None


def with_origin(problems: list[SettingsError], inv, host) -> list[SettingsError]:
    """``problems`` of one host, those of a key nothing reads (tasks/settings/keys.py) saying where the key
    was set."""
    from tasks.settings import host_keys
    unread = {p.key for p in host_keys(host.name, host.data.dict())[1]}
    out = []
    for p in problems:
        where = origin(inv, host, p.key) if p.key in unread else None
        out.append(SettingsError(p.host, p.key, f"{p.problem}; set by {where}", p.fix) if where else p)
    return out


def unmatched_limits(inventory, limit=(), exclude=(), run=None) -> str | None:
    """Why the run's hosts are not what ``--limit``/``--exclude`` meant, or None: a pattern that matches no
    host or group of the inventory (pyinfra only logs a warning and goes on, with the other patterns' hosts
    or with none), or a run left with no host. ``run``: pyinfra's ``State.limit_hosts`` (None: no limit)."""
    from fnmatch import fnmatch
    names = [h.name for h in inventory]
    every = set(names)          # pyinfra names a group after the inventory file too: one of every host, not listed
    groups = sorted(g for g, members in getattr(inventory, "groups", {}).items()
                    if g != "all" and {h.name for h in members} != every)
    for option, patterns in (("--limit", limit), ("--exclude", exclude)):
        for pattern in patterns or ():
            if pattern not in getattr(inventory, "groups", {}) and pattern != "all" \
                    and not any(fnmatch(n, pattern) for n in names):
                close = difflib.get_close_matches(pattern, names + groups, n=1, cutoff=0.5)
                return (f"verl-lab: {option} {pattern!r} matches no host or group of the inventory; nothing was "
                        f"changed on any host. " + (f"Did you mean {close[0]!r}? " if close else "")
                        + f"Hosts: {', '.join(names)}; groups: {', '.join(groups) or 'none'}")
    if run is not None and not run:
        return "verl-lab: --limit/--exclude leave no host in this run; nothing was changed on any host"
    return None


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
            inv = getattr(each, "inventory", None)
            problems += with_origin(found, inv, each)
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


def warning_report(warnings, in_run: list[str]) -> str:
    """What the run's checks warn of, refusing nothing: each host's together, in the run's order."""
    order = {name: i for i, name in enumerate(in_run)}
    warnings = sorted(warnings, key=lambda p: order.get(p.host, len(order)))
    count = f"{len(warnings)} warning{'s' if len(warnings) != 1 else ''}"
    return report(warnings, header=f"verl-lab: {count} (nothing refused for them):")


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
