"""The units no driver change may run under (the training unit, the Ray unit): judged busy or idle,
masked for the length of a driver change, stopped where the settings allow it, unmasked after.

Busy is any state but ``inactive`` and ``failed``: ``activating (auto-restart)`` (the training unit is
``Restart=on-failure``, ``RestartSec=30``) starts the job again within seconds, ``deactivating`` still
runs it. A process holding ``/dev/nvidia*`` is busy too; one that runs inside one of the units (its
cgroup) goes with the unit when the stage may stop it.

The mask: a ``/dev/null`` link at ``/run/systemd/system.control/<unit>`` and a daemon-reload. The
units' files live in ``/etc/systemd/system``, which outranks ``/run/systemd/system``, where
``systemctl mask --runtime`` puts its link: that mask does nothing for them (systemd 252, Debian 12:
the unit still starts). ``system.control`` comes before ``/etc/systemd/system`` in systemd's search
path, and ``/run`` is emptied by every boot, so a mask left by a crash ends at the next boot at the
latest. What the stage masked is written to ``RECORD``; ``unmask`` removes those links only.

Standard library only; the controller (tasks/driver_plan.py) judges the fact with the same
functions the box program acts on.
"""

from __future__ import annotations

import os
import subprocess
import time

try:
    from verl_lab_box.nvidia_driver_log import Failed
    from verl_lab_box.nvidia_driver_state import MASK_DIR, UNIT_PROPS, gpu_users, parse_units
except ImportError:                     # on a box: the modules lie side by side
    import sys
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from nvidia_driver_log import Failed
    from nvidia_driver_state import MASK_DIR, UNIT_PROPS, gpu_users, parse_units

IDLE = ("inactive", "failed")
RECORD = "/run/verl-lab-driver-masked"      # the units the stage masked, one a line
STOP_WAIT_S = 120
POLICIES = ("refuse", "stop")               # the driver_busy setting


# ---------------------------------------------------------------- judging (pure)


def unit_words(show: dict) -> str:
    """``activating (auto-restart)``, as ``systemctl status`` says it."""
    return f"{show.get('active') or '?'} ({show.get('sub') or '?'})"


def busy_units(state: dict, units) -> list[str]:
    """The units of ``units`` in any state but inactive or failed, with it: ["verl-lab-train.service
    is activating (auto-restart)"]. A unit systemd does not know is inactive."""
    found = []
    for unit in units:
        show = (state.get("units") or {}).get(unit) or {}
        if (show.get("active") or "inactive") not in IDLE:
            found.append(f"{unit} is {unit_words(show)}")
    return found


def unit_of(cgroup: str) -> str:
    """The systemd unit a cgroup path belongs to ("/system.slice/verl-lab-train.service" ->
    "verl-lab-train.service"; "" for none)."""
    parts = [p for p in (cgroup or "").split("/") if p.endswith((".service", ".scope"))]
    return parts[-1] if parts else ""


def outside_users(state: dict, units) -> list[list[str]]:
    """The processes holding /dev/nvidia* (but the persistence daemon) that stopping ``units`` does
    not end: they run in no unit of them."""
    return [b for b in gpu_users(state) if unit_of(b[2] if len(b) > 2 else "") not in units]


def describe_users(users: list[list[str]]) -> str:
    return ", ".join(f"{b[0]} ({b[1] if len(b) > 1 else '?'}"
                     + (f", in {unit_of(b[2])}" if len(b) > 2 and unit_of(b[2]) else "") + ")" for b in users)


def busy_reasons(state: dict, units, policy: str) -> list[str]:
    """Why no driver package may change now, under ``policy``: "refuse" counts the units and every
    GPU process; "stop" (the stage stops the units) counts only the GPU processes outside them."""
    reasons = busy_units(state, units) if policy != "stop" else []
    users = gpu_users(state) if policy != "stop" else outside_users(state, units)
    if users:
        reasons.append(f"processes hold /dev/nvidia* ({describe_users(users)})")
    return reasons


def busy_fix(units, policy: str) -> str:
    names = " ".join(units)
    if policy == "stop":
        return ("Stop the processes named (they run in none of the units the stage may stop), then re-run the "
                "driver stage")
    return (f"Stop training first: set train_unit_state = 'stopped' and re-run the train stage (or `systemctl stop "
            f"{names}`), then re-run the driver stage; or set driver_busy = 'stop' to let the driver stage stop "
            f"{names} itself (masked for the change, so nothing restarts them)")


# ---------------------------------------------------------------- acting on the box (root)


def read_units(units) -> dict:
    """{"units": {unit: {"load", "active", "sub", "file"}}} as the fact reads them."""
    res = subprocess.run(["systemctl", "show", *(f"-p{p}" for p in UNIT_PROPS), *units],
                         capture_output=True, text=True)
    return {"units": parse_units(res.stdout.splitlines())}


def mask(units, log) -> list[str]:
    """Mask ``units`` for a driver change (a link in MASK_DIR, then daemon-reload); returns what this
    call masked (a unit already masked there by someone else is left to them). Written to RECORD
    before the links, so an unmask after a crash finds them."""
    masked = recorded()
    mine = [u for u in units if u in masked or not os.path.lexists(os.path.join(MASK_DIR, u))]
    _write_record(sorted(set(masked) | set(mine)))
    os.makedirs(MASK_DIR, exist_ok=True)
    for unit in mine:
        link = os.path.join(MASK_DIR, unit)
        if not os.path.lexists(link):
            os.symlink("/dev/null", link)
    log.run(["systemctl", "daemon-reload"])
    log.say(f"masked {' '.join(mine)} for the driver change ({MASK_DIR}, until the change ends or the next boot)")
    return mine


def unmask(log) -> list[str]:
    """Remove the masks RECORD lists (only links to /dev/null), daemon-reload; returns the units."""
    units = recorded()
    gone = []
    for unit in units:
        link = os.path.join(MASK_DIR, unit)
        if os.path.islink(link) and os.readlink(link) == "/dev/null":
            os.remove(link)
            gone.append(unit)
    if units:
        subprocess.run(["systemctl", "daemon-reload"], capture_output=True)
    try:
        os.remove(RECORD)
    except FileNotFoundError:
        pass
    if gone:
        log.say(f"unmasked {' '.join(gone)}")
    return gone


def stop(units, log, wait_s: float = STOP_WAIT_S) -> None:
    """Stop ``units`` (masked already: nothing starts them again) and wait until each is inactive or
    failed."""
    log.run(["systemctl", "stop", *units], check=False)
    deadline = time.monotonic() + wait_s
    while busy_units(read_units(units), units) and time.monotonic() < deadline:
        time.sleep(1)


def recorded() -> list[str]:
    try:
        with open(RECORD, encoding="utf-8") as fh:
            return [line.strip() for line in fh if line.strip()]
    except OSError:
        return []


def _write_record(units: list[str]) -> None:
    part = RECORD + ".part"
    with open(part, "w", encoding="utf-8") as fh:
        fh.write("".join(f"{u}\n" for u in units))
    os.replace(part, RECORD)


# ---------------------------------------------------------------- a driver change's hold on the units


def take(plan: dict, read, log) -> list[str]:
    """Before a driver change: refuse (changing nothing) while a unit or a GPU process is busy under
    the plan's policy; else mask the units, stop them where the policy is "stop", and check again
    (a unit that started between the first check and the mask). Returns the units masked; the
    caller unmasks them in every outcome (``release``)."""
    units, policy = plan["units"], plan.get("busy") or "refuse"
    why = busy_reasons(read(), units, policy)
    if why:
        raise Failed(f"{'; '.join(why)}: no driver package is changed under a running job; nothing was changed. "
                     + busy_fix(units, policy))
    masked = mask(units, log)
    if policy == "stop":
        running = [u for u in units if busy_units(read_units([u]), [u])]
        if running:
            log.say(f"stopping {' '.join(running)} (driver_busy = 'stop')")
            stop(running, log)
    check(plan, read, log, "after masking")
    return masked


def check(plan: dict, read, log, when: str) -> None:
    """Every unit idle and no process on the GPUs, whatever the policy (the units are masked and,
    with "stop", stopped by now): else stop before apt changes anything."""
    why = busy_reasons(read(), plan["units"], "refuse")
    if why:
        raise Failed(f"{'; '.join(why)} ({when}): no driver package is changed under a running job; nothing was "
                     "installed. " + busy_fix(plan["units"], plan.get("busy") or "refuse"))
    log.say(f"ok    {', '.join(plan['units'])} idle and no process holds /dev/nvidia* ({when})")
