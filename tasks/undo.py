"""Stage: what the settings no longer ask for, undone (every optional part of a box converges both ways).

Each optional part verl-lab places is there only while a setting asks for it. When the setting no longer does,
the deploy that places the part removes, stops or restores it in the same run, with an operation whose name
says what was undone and why (pyinfra prints it without ``-v``):

Each part, who places it, while what asks for it, which deploys undo it, and how:

- the Ray unit ``verl-lab-ray.service``, ``ray.env``, ``cluster-check``, ``cluster-gather``, ``<lab_root>/ray``:
  the cluster stage, while ``cluster`` names the box; deploy/full.py and deploy/cluster.py stop, disable and remove
  the unit, remove the files and Ray's folder;
- the training unit's drop-in ``cluster.conf``: the cluster stage, the same; the same and deploy/train.py remove it
  and reload systemd (the train stage then restarts a started unit);
- ``/etc/hosts``' managed line: the cluster stage, the same; deploy/full.py and deploy/cluster.py remove it and
  restore the lines it commented out;
- ``tracking-keys.env`` (the training unit's keys and the Ray head's): the train stage, while an online tracker has a
  key and the box is no Ray worker; deploy/full.py and deploy/train.py remove it;
- each tracker's folder and ``<lab_root>/tracking``: the train stage, while ``tracking.trackers`` names it; the same
  remove it while empty, keep one holding a run's files and say so;
- ``verl-lab-tensorboard.service`` and ``<lab_root>/tracking-lab``: deploy/tracking.py, while the box is the hub;
  deploy/full.py and deploy/tracking.py stop, disable and remove the unit and remove the served copy (the
  controller's cache keeps the curves);
- the copy's programs and staging (``<lab_root>/libexec/tracking``, ``<lab_root>/cache/tracking``):
  deploy/tracking.py, while a tracker of the box is copied or it is the hub; the same remove them;
- the driver stage's hold and pin, ``<lab_root>/libexec/driver``, its marker and the runtime masks it left: the
  driver stage, while ``driver = "install"``; deploy/full.py (right after the base stage, its facts asked in this
  stage's bundle: ``driver_found``) and deploy/driver.py release them and keep the installed driver, its nouveau
  blacklist and apt sources while its packages remain, refusing while a driver change runs or stopped part-way
  (tasks/driver/release.py says what and why).

**A burn-in is no setting**: deploy/burnin.py is a command run on purpose, once before a long run, and no setting
asks for it, so no deploy undoes it. Its record (``<train_dir>/burnin/burnin.json``, and the controller's copy and
history) is a run's output, kept like the others below. Its unit ``verl-lab-burnin.service`` is never enabled and
runs only when deploy/burnin.py starts it; it and its programs, probe and plan beside the launcher stay as that
command's tools (each burn-in places them again from the box's plan of the day).

**A run's outputs are never removed**: checkpoints, exports (a LoRA run's ``hf/lora_adapter`` too), GSM8K scores,
a tracker's event files and offline runs. They are what hours of GPU time made, a setting says how the *next*
run trains (not that the last one's model is unwanted), and a deploy cannot know whether they were copied
elsewhere: a settings edit (or a typo) must never be able to delete a trained model. What stays costs disk, which
the checks count. A tracker's folder that holds a run's files is kept and said so on every deploy. After
``workload.finetune`` changed, the earlier run's saves are kept too, and verl could not resume them (a LoRA save
holds the PEFT-wrapped model's weights under other names): the launcher's preflight refuses to start on one and
names the command that moves the folder aside (verl_lab_box/preflight.py ``check_resume``).

Root's work here is on root's own paths under root-only folders (docs/architecture.md, "Security", rule a):
units and drop-ins in ``/etc/systemd/system``, files in ``<train_dir>`` and ``<lab_root>``; the train user's
folders (``<lab_root>/ray``, a tracker's folder) are removed by their names in root's folders, ``rm -rf`` and
``rmdir`` never following a link (rule c), after the unit that wrote them stopped.

Pure parts first (``cluster_undo``, ``tracker_undo``, ``hub_undo``, ``copy_undo``), then the ``@deploy``; the
driver's part is the driver stage's (tasks/driver/stage.py ``release_driver``).
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path

from pyinfra import host, logger
from pyinfra.api import deploy
from pyinfra.operations import server

from tasks.cluster import (
    HOSTS_MARK,
    HOSTS_OFF,
    RAY_UNIT,
    RAY_UNIT_PATH,
    TRAIN_DROPIN,
    hosts_restored,
    ray_dir,
    ray_env_file,
    write_hosts_command,
)
from tasks.driver.plan import PIN_FILE, driver_want
from tasks.driver.release import stage_paths
from tasks.facts.bundle import ask
from tasks.facts.cluster import HostnameLookup
from tasks.facts.driver import DriverLeft
from tasks.facts.files import FolderEntries, PathStates, UnitState
from tasks.settings import TRAIN_UNIT, LabSettings
from tasks.tracking import KEYS_FILE, TRACKERS, Tracking, keys_for_box, tracking_root
from tasks.tracking.copy import libexec_dir, staging_dir
from tasks.tracking.hub import HUB_UNIT, hub_name, served_dir
from tasks.tracking.hub import UNIT_PATH as HUB_UNIT_PATH

PARTS = ("dropin", "ray", "trackers", "hub", "copy")


@dataclass(frozen=True)
class Undo:
    """One undone part: ``part`` (its family, PARTS), the operation's ``name`` (what and why), its commands."""

    part: str
    name: str
    commands: tuple[str, ...]


def unit_removal(part: str, unit: str, path: str, why: str) -> Undo:
    """A unit stopped, disabled and removed; systemd reloaded and its failed state forgotten; then checked."""
    u, p = shlex.quote(unit), shlex.quote(path)
    return Undo(part, f"Unit {unit}: stopped, disabled and removed ({why})", (
        f"systemctl disable --now {u} 2>/dev/null || systemctl stop {u} 2>/dev/null || true",
        f"rm -f {p} /etc/systemd/system/*.wants/{u} && systemctl daemon-reload",
        f"systemctl reset-failed {u} 2>/dev/null || true",
        f"if systemctl is-active --quiet {u}; then echo 'verl-lab: {unit} is still active' >&2; exit 1; fi"))


def _unit_there(states: dict, unit_state: dict | None, path: str) -> bool:
    u = unit_state or {}
    return states.get(path) is not None or any(u.get(k) for k in ("enabled", "active", "crash_looping"))


def cluster_paths_undone(settings: LabSettings) -> list[str]:
    t = settings.train_dir
    return [RAY_UNIT_PATH, TRAIN_DROPIN, ray_env_file(settings), f"{t}/cluster-check", f"{t}/cluster-gather",
            ray_dir(settings)]


def cluster_undo(settings: LabSettings, states: dict, ray_unit: dict | None, hosts: str, parts=PARTS) -> list[Undo]:
    """A box in no Ray cluster: what the cluster stage left, in the order it is undone (the Ray unit before the
    files it reads and the folder it writes). ``parts``: "dropin" (the training unit's drop-in), "ray" (the rest)."""
    why = "this box is in no Ray cluster now: no `cluster` setting names it"
    out = []
    if "ray" in parts and _unit_there(states, ray_unit, RAY_UNIT_PATH):
        out.append(unit_removal("ray", RAY_UNIT, RAY_UNIT_PATH, why))
    if "dropin" in parts and states.get(TRAIN_DROPIN) is not None:
        folder = shlex.quote(str(Path(TRAIN_DROPIN).parent))
        out.append(Undo("dropin", f"Unit {TRAIN_UNIT}: the cluster's drop-in {TRAIN_DROPIN} removed ({why})", (
            f"rm -f {shlex.quote(TRAIN_DROPIN)} && rmdir --ignore-fail-on-non-empty {folder} && "
            "systemctl daemon-reload",)))
    if "ray" not in parts:
        return out
    files = [p for p in (ray_env_file(settings), f"{settings.train_dir}/cluster-check",
                         f"{settings.train_dir}/cluster-gather") if states.get(p) is not None]
    if files:
        out.append(Undo("ray", f"The cluster's files removed: {', '.join(Path(p).name for p in files)} ({why})",
                        (f"rm -f {' '.join(shlex.quote(p) for p in files)}",)))
    if states.get(ray_dir(settings)) is not None:
        out.append(Undo("ray", f"Ray's folder {ray_dir(settings)} removed (its sessions and logs; {why})",
                        (f"rm -rf {shlex.quote(ray_dir(settings))}",)))
    restored = hosts_restored(hosts) if hosts else None
    if restored is not None and restored != hosts:
        out.append(Undo("ray", f"/etc/hosts: the cluster's line ('{HOSTS_MARK}') removed and the lines it commented "
                               f"out ('{HOSTS_OFF}...') restored ({why})", (write_hosts_command(restored),)))
    return out


def keys_why(tracking: Tracking, worker: bool) -> str:
    """Why a box gets no keys file (``keys_for_box`` gave none)."""
    if not tracking.remote:
        return f"no tracker with a server: tracking.trackers is {list(tracking.trackers)}"
    if not tracking.online:
        return "tracking logs offline now (the controller syncs the runs with the keys it keeps)"
    if worker:
        return "a Ray cluster's worker gets no key (verl's trackers run on the head)"
    return "the online trackers need no key of tracking.keys_file"


def tracker_undo(settings: LabSettings, states: dict, entries: dict, worker: bool) -> tuple[list[Undo], list[str]]:
    """The train stage's tracker parts the settings no longer ask for: the keys file, and each tracker's folder
    (and their parent) while empty. Returns what is undone and the lines for what is kept (a run's files)."""
    tracking, out, kept = settings.tracking, [], []
    keys = f"{settings.train_dir}/{KEYS_FILE}"
    if states.get(keys) is not None and not keys_for_box(tracking, worker=worker):
        out.append(Undo("trackers", f"Tracker keys {keys} removed ({keys_why(tracking, worker)})",
                        (f"rm -f {shlex.quote(keys)}",)))
    every = Tracking(trackers=TRACKERS).folders(settings.lab_root)
    wanted = tracking.folders(settings.lab_root)
    gone = []
    for tracker, path in every.items():
        names = entries.get(path)
        if tracker in wanted or names is None:
            continue
        if names:
            kept.append(f"kept {path}: tracking.trackers no longer names {tracker}, and the folder holds a run's "
                        f"files ({len(names)}{'+' if len(names) >= 50 else ''} entries: {', '.join(names[:3])}"
                        f"{', ...' if len(names) > 3 else ''}); remove it by hand when they are no longer needed")
            continue
        gone.append(path)
    root = tracking_root(settings.lab_root)
    left = [n for n in (entries.get(root) or []) if f"{root}/{n}" not in gone]
    root_goes = not wanted and entries.get(root) is not None and not left
    if gone or root_goes:
        what = ", ".join(Path(p).name for p in gone) + (f"{', ' if gone else ''}{root}" if root_goes else "")
        commands = [f"rmdir --ignore-fail-on-non-empty {' '.join(shlex.quote(p) for p in gone)}"] if gone else []
        if root_goes:
            commands.append(f"rmdir --ignore-fail-on-non-empty {shlex.quote(root)}")
        out.append(Undo("trackers", f"Tracker folders removed while empty: {what} (tracking.trackers is "
                                    f"{list(tracking.trackers)})", tuple(commands)))
    return out, kept


def hub_role(settings: LabSettings, hosts: list[str]) -> tuple[bool, bool, str]:
    """(whether this box is the lab's TensorBoard hub, whether its trackers are copied by deploy/tracking.py, why
    it is not the hub) from its settings and the inventory's boxes, as deploy/tracking.py decides them."""
    tracking = settings.tracking
    hub = hub_name(settings, hosts)
    is_hub = "tensorboard" in tracking.trackers and hub == settings.host
    copied = "tensorboard" in tracking.trackers or bool(tracking.offline) or is_hub
    why = ("tracking.trackers has no 'tensorboard'" if "tensorboard" not in tracking.trackers
           else f"the lab's TensorBoard hub is {hub} now")
    return is_hub, copied, why


def hub_undo(settings: LabSettings, states: dict, hub_unit: dict | None, why: str) -> list[Undo]:
    out = []
    if _unit_there(states, hub_unit, HUB_UNIT_PATH):
        out.append(unit_removal("hub", HUB_UNIT, HUB_UNIT_PATH, f"this box is not the lab's TensorBoard hub: {why}"))
    served = served_dir(settings)
    if states.get(served) is not None:
        out.append(Undo("hub", f"The lab's TensorBoard folder {served} removed (not the hub: {why}; every box's "
                               f"curves stay in the controller cache, {settings.controller_cache}/tracking/lab)",
                        (f"rm -rf {shlex.quote(served)}",)))
    return out


def copy_undo(settings: LabSettings, states: dict, entries: dict) -> list[Undo]:
    """The tracking copy's programs and staging on a box whose trackers are not copied and that is not the hub;
    ``<lab_root>/libexec`` too where nothing else is in it (no other stage placed a program)."""
    there = [p for p in (libexec_dir(settings), staging_dir(settings)) if states.get(p) is not None]
    if not there:
        return []
    libexec = f"{settings.lab_root}/libexec"
    commands = [f"rm -rf {' '.join(shlex.quote(p) for p in there)}"]
    others = [n for n in entries.get(libexec) or [] if f"{libexec}/{n}" not in there]
    if entries.get(libexec) is not None and not others:
        commands.append(f"rmdir --ignore-fail-on-non-empty {shlex.quote(libexec)}")
    return [Undo("copy", f"The tracking copy's programs and staging removed: {', '.join(there)} (no tracker of this "
                         "box is copied by deploy/tracking.py and it is not the hub)", tuple(commands))]


# ------------------------------------------------------------------ the stage

_FOUND: dict[str, tuple] = {}      # host -> the one bundle's answers, asked by the first call of a deploy


def _paths(settings: LabSettings) -> list[str]:
    return [*cluster_paths_undone(settings), f"{settings.train_dir}/{KEYS_FILE}", HUB_UNIT_PATH, served_dir(settings),
            libexec_dir(settings), staging_dir(settings), *stage_paths(driver_want(settings))]


def _folders(settings: LabSettings) -> list[str]:
    return [tracking_root(settings.lab_root), *Tracking(trackers=TRACKERS).folders(settings.lab_root).values(),
            f"{settings.lab_root}/libexec"]


def _found(settings: LabSettings) -> tuple:
    if settings.host not in _FOUND:
        _FOUND[settings.host] = ask((PathStates, {"paths": _paths(settings)}), (UnitState, {"unit": RAY_UNIT}),
                                    (UnitState, {"unit": HUB_UNIT}), (FolderEntries, {"paths": _folders(settings)}),
                                    (HostnameLookup, {}),
                                    (DriverLeft, {"pin": PIN_FILE, "units": list(driver_want(settings).units)}))
    return _FOUND[settings.host]


def driver_found(settings: LabSettings) -> tuple[dict, dict]:
    """What the driver stage left on this box (``DriverLeft``, the paths' states), from the same bundle: deploy/full.py
    hands it to the driver stage with driver = "check" (tasks/driver/release.py), so it costs no command of its own."""
    states, *_, left = _found(settings)
    return left or DriverLeft.default(), states or {}


def planned_undo(settings: LabSettings, parts, in_cluster: bool, worker: bool, hosts: list[str]) -> tuple[list, list]:
    """Prepare time: what this deploy undoes of ``parts`` on this box, and the lines of what it keeps."""
    states, ray_unit, hub_unit, entries, lookup = _found(settings)[:5]
    states, entries = states or {}, entries or {}
    undo, kept = [], []
    if not in_cluster:
        undo += cluster_undo(settings, states, ray_unit, (lookup or {}).get("hosts", ""), parts)
    if "trackers" in parts:
        more, kept = tracker_undo(settings, states, entries, worker)
        undo += more
    is_hub, copied, why = hub_role(settings, hosts)
    if "hub" in parts and not is_hub:
        undo += hub_undo(settings, states, hub_unit, why)
    if "copy" in parts and not copied:
        undo += copy_undo(settings, states, entries)
    return undo, kept


@deploy("verl-lab: what the settings no longer ask for")
def undo_unwanted(settings: LabSettings, parts, in_cluster: bool, worker: bool, hosts: list[str]) -> list[Undo]:
    """Queue the undoing of ``parts`` (PARTS) that this box holds and its settings no longer ask for, an
    operation each, named with what and why; say what is kept. Returns what it queued."""
    undo, kept = planned_undo(settings, parts, in_cluster, worker, hosts)
    for line in kept:
        host.log_styled(f"verl-lab: {line}", log_func=logger.info)
    for step in undo:
        server.shell(name=step.name, commands=list(step.commands))
    return undo
