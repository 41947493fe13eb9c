"""The bridge from pyinfra's inventory to LabSettings.

``check_inventory()`` checks every host's data before any operation is prepared, so a bad
value anywhere stops the run before any host changes, with a message naming each bad host.
"""

from __future__ import annotations

from pyinfra import host, inventory

from tasks.settings import LabSettings, SettingsError, load_settings

_CHECKED = False
_CACHE: dict[str, LabSettings] = {}


class InventoryError(SystemExit):
    """Raised before anything runs; pyinfra prints it and exits non-zero."""


def settings_for(target=None) -> LabSettings:
    target = target or host
    if target.name not in _CACHE:
        _CACHE[target.name] = load_settings(target.name, target.data.dict())
    return _CACHE[target.name]


def check_inventory(hosts=None) -> None:
    """Check every host's data once per run (``hosts`` defaults to pyinfra's inventory)."""
    global _CHECKED
    if _CHECKED:
        return
    problems: list[str] = []
    for each in hosts if hosts is not None else inventory:
        try:
            settings_for(each)
        except SettingsError as exc:
            problems.append(str(exc))
    _CHECKED = True
    if problems:
        raise InventoryError(
            "verl-lab: the inventory has errors; nothing was changed on any host:\n  "
            + "\n  ".join(problems)
        )
