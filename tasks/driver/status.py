"""What the status and the driver stage say about a held driver (pure): a newer build of the held
branch in the box's archive (a security update the pin keeps out until it is taken on purpose with
``driver_update``), a branch past its end of life (files/drivers.toml ``end_of_life``), and a
driver change that is running or that left the training and Ray units masked."""

from __future__ import annotations

import datetime
from collections.abc import Mapping

from tasks.driver.choice import Distro, DistroBranch
from verl_lab_box.nvidia_driver_state import JOB_UNIT, MASK_DIR, branch_of, upstream
from verl_lab_box.nvidia_driver_units import IDLE


def held_branch(state: Mapping, distro: Distro | None) -> tuple[DistroBranch, str] | None:
    """The distro branch the stage's pin holds, and the pinned version; None without a pin."""
    pin = state.get("pin") or {}
    version = pin.get("version")
    if distro is None or not version:
        return None
    found = next((b for b in distro.branches if b.branch == branch_of(version)
                  and b.module_package in (pin.get("packages") or ())), None)
    return (found, version) if found else None


def newer_build(state: Mapping, branch: DistroBranch, installed: str) -> str | None:
    """A build of ``branch`` newer than ``installed`` that the box's archive carries (apt-cache
    madison lists a package's versions newest first), or None."""
    entries = [e["version"] for e in (state.get("archive") or {}).get(branch.module_package, [])]
    if installed not in entries or entries.index(installed) == 0:
        return None
    newest = entries[0]
    return newest if branch_of(newest) == branch.branch else None


def end_of_life_passed(branch: DistroBranch, today: datetime.date) -> bool:
    """``end_of_life = "2026-06"``: past once that month is over."""
    if not branch.end_of_life:
        return False
    year, month = (int(x) for x in branch.end_of_life.split("-"))
    return today >= datetime.date(year + month // 12, month % 12 + 1, 1)


def change_notes(state: Mapping) -> list[str]:
    """A driver change running (its job unit), or the masks one left where none runs."""
    job = ((state.get("units") or {}).get(JOB_UNIT) or {}).get("active", "inactive")
    masked = list(state.get("masks") or ())
    if job not in IDLE:
        return [f"driver: a driver change is running ({JOB_UNIT}, {job}): "
                + (f"{', '.join(masked)} masked until it ends" if masked else "apt runs there")
                + f"; `journalctl -fu {JOB_UNIT}` follows it"]
    if masked:
        return [f"driver: {', '.join(masked)} masked by a driver change that did not end ({MASK_DIR}), and no driver "
                "change runs: the unit cannot start. Re-run the driver stage (it removes the masks it left), or "
                f"`rm {' '.join(f'{MASK_DIR}/{u}' for u in masked)} && systemctl daemon-reload`"]
    return []


def driver_notes(state: Mapping, distro: Distro | None, today: datetime.date | None = None) -> list[str]:
    """The lines status prints under a box (and the driver stage logs) about its held driver, and
    about a driver change running or left behind."""
    changes = change_notes(state)
    held = held_branch(state, distro)
    if held is None:
        return changes
    branch, version = held
    notes = []
    newer = newer_build(state, branch, version)
    if newer:
        notes.append(f"driver: a newer build of the held R{branch.branch} is in this box's archive: {upstream(newer)} "
                     f"({newer}; held at {upstream(version)}). It may carry security fixes: set driver_update = True "
                     "and re-run the driver stage when the box is idle (driver_reboot = True lets it reboot, one box "
                     "at a time)")
    if end_of_life_passed(branch, today or datetime.date.today()):
        month = datetime.date(*(int(x) for x in branch.end_of_life.split("-")), 1).strftime("%B %Y")
        notes.append(f"driver: R{branch.branch} is past its end of life ({month}, NVIDIA): no more security updates "
                     f"for it. {distro.name} ships no later branch as {branch.packages[0]}; a distro with a supported "
                     "branch (Ubuntu 22.04/24.04: R580) keeps getting them")
    return changes + notes
