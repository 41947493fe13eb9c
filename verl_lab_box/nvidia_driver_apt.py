"""What apt's ``--simulate`` would do, judged before anything is installed, and the GPUs the
candidate driver package itself says it supports (its ``supported-gpus.json``). Pure functions on
text the box printed; ``nvidia_driver.py`` (shipped with this file beside it) acts on them.
Standard library only.
"""

from __future__ import annotations

import json
import os
import re
import sys

try:
    from verl_lab_box.nvidia_driver_state import branch_of
except ImportError:                     # on a box: the modules lie side by side
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from nvidia_driver_state import branch_of

_INST = re.compile(r"^Inst (\S+) (?:\[(\S+)\] )?\((\S+) ")
_REMV = re.compile(r"^Remv (\S+)(?: \[(\S+)\])?")


def simulated(text: str) -> dict[str, str]:
    """``apt-get install --simulate`` -> {package: version it would install}."""
    return {m.group(1): m.group(3) for m in map(_INST.match, text.splitlines()) if m}


def removed(text: str) -> dict[str, str]:
    """``apt-get install --simulate`` -> {package: installed version it would remove} (``Remv`` lines:
    a Conflicts/Breaks with what is asked for, as Ubuntu's nvidia-dkms-* do through
    ``nvidia-dkms-kernel``)."""
    return {m.group(1): m.group(2) or "" for m in map(_REMV.match, text.splitlines()) if m}


def newly_installed(text: str, name: str) -> bool:
    """``name`` is installed by the simulation where it was not installed before (no ``[old]``)."""
    return any(m.group(1) == name and not m.group(2) for m in map(_INST.match, text.splitlines()) if m)


def same_transaction(first: str, second: str) -> bool:
    """Two simulations install the same versions and remove the same packages."""
    return simulated(first) == simulated(second) and removed(first) == removed(second)


def is_driver_package(name: str) -> bool:
    """A package of an NVIDIA driver: its libraries, tools, module, firmware."""
    return "nvidia" in name or name.startswith(("libcuda", "libnvcuvid", "libnvoptix"))


def foreign_branch(would: dict[str, str], branch: int) -> list[str]:
    """The NVIDIA driver packages apt would install from another branch than ``branch`` (a package
    of the chosen name that now depends on a newer branch, as archives do with retired branches)."""
    wrong = []
    for name, version in sorted(would.items()):
        got = branch_of(version)
        if is_driver_package(name) and got is not None and got >= 300 and got != branch:
            wrong.append(f"{name} {version}")
    return wrong


def unasked_removals(gone: dict[str, str], replaces: list[str] | tuple[str, ...]) -> list[str]:
    """The NVIDIA packages the simulation would remove that the stage was not asked to replace
    (``replaces``: what the stage itself installed and pinned before)."""
    return [f"{name} {version}".strip() for name, version in sorted(gone.items())
            if is_driver_package(name) and name not in replaces]


def changed_driver_packages(would: dict[str, str], gone: dict[str, str]) -> list[str]:
    """Every NVIDIA driver package the simulation would install, upgrade or remove."""
    return sorted({n for n in (*would, *gone) if is_driver_package(n)})


# ---------------------------------------------------------------- supported-gpus.json


def supported_chips(text: str) -> list[dict]:
    """supported-gpus.json (NVIDIA's, in the driver package) -> its "chips": [{"devid": "0x1B38",
    "name": "Tesla P40", "legacybranch"?: "470.xx", ...}]."""
    data = json.loads(text)
    chips = data.get("chips") if isinstance(data, dict) else None
    if not isinstance(chips, list):
        raise ValueError("no 'chips' list")
    return chips


def unsupported(chips: list[dict], gpus: list[dict], version: str, unlisted: list[dict] | None = None) -> list[str]:
    """The GPUs (``{"name", "device"}``: the PCI device ID, e.g. "2702", where the bus shows it; else
    nvidia-smi's exact name) the driver ``version``'s own list does not support: absent, or listed
    only for a legacy branch. Keyed by device ID, so an "RTX 4080 SUPER" is not taken for an
    "RTX 4080". ``unlisted``: GPUs (``{"device", "name"}``) the driver supports that NVIDIA's list
    leaves out (files/drivers.toml says which and how that was found)."""
    spared = {(u.get("device") or "").lower() for u in unlisted or ()} | \
        {(u.get("name") or "").strip().lower() for u in unlisted or ()}
    by_id: dict[str, list[dict]] = {}
    by_name: dict[str, list[dict]] = {}
    for chip in chips:
        by_id.setdefault(str(chip.get("devid", "")).lower().removeprefix("0x"), []).append(chip)
        by_name.setdefault(str(chip.get("name", "")).strip().lower(), []).append(chip)
    out = []
    for gpu in gpus:
        device = (gpu.get("device") or "").lower()
        rows = by_id.get(device, []) if device else by_name.get((gpu.get("name") or "").strip().lower(), [])
        what = f"{gpu.get('name')} (PCI 10de:{device})" if device else f"{gpu.get('name')!r} (by its name: no PCI ID read)"
        if not rows and (device or (gpu.get("name") or "").strip().lower()) in spared - {""}:
            continue
        if not rows:
            out.append(f"{what}: not in the supported-GPU list of {version}")
        elif all(r.get("legacybranch") for r in rows):
            out.append(f"{what}: listed by {version} for the legacy branch {rows[0]['legacybranch']} only")
    return list(dict.fromkeys(out))
