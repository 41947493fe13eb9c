"""Facts about free disk space on a box."""

from __future__ import annotations

import shlex
from collections.abc import Iterable

from pyinfra.api import FactBase

from verl_lab_box.checkpoints import fact_command as checkpoint_fact_command
from verl_lab_box.checkpoints import parse_fact_output as parse_checkpoint_output


def parse_df_portable(lines: Iterable[str]) -> dict | None:
    """The data row of ``df -P -m <path>``.

    Returns ``{"filesystem": "/dev/vda", "size_mib": int, "free_mib": int, "mount": "/"}``
    (``Available`` is what an unprivileged write can use, and what is reported as free).
    """
    for line in lines:
        cells = line.split()
        if len(cells) < 6 or cells[0] == "Filesystem":
            continue
        if not (cells[1].isdigit() and cells[2].isdigit() and cells[3].isdigit()):
            continue
        return {
            "filesystem": cells[0],
            "size_mib": int(cells[1]),
            "free_mib": int(cells[3]),
            "mount": " ".join(cells[5:]),
        }
    return None


class FreeDisk(FactBase[dict | None]):
    """Free space (MiB) on the filesystem that ``path`` is, or would be, created on.

    ``path`` need not exist: the nearest existing parent is measured. Returns
    ``{"path": <that parent>, "filesystem": ..., "mount": ..., "size_mib": int, "free_mib": int}``
    or None (the default) when df gave nothing usable.
    """

    def command(self, path: str) -> str:
        p = shlex.quote(path)
        return (
            f"p={p}; while [ ! -e \"$p\" ] && [ \"$p\" != / ]; do p=$(dirname \"$p\"); done; "
            "echo \"@@ $p\"; df -P -m \"$p\" 2>&1; true"
        )

    def process(self, output) -> dict | None:
        lines = list(output)
        where = None
        for line in lines:
            if line.startswith("@@ "):
                where = line[3:].strip()
        row = parse_df_portable(line for line in lines if not line.startswith("@@ "))
        if row is None:
            return self.default()
        return {"path": where, **row}


class CheckpointDisk(FactBase[dict | None]):
    """verl's saves under the checkpoint folder ``path`` and the free disk there (or where it would
    be made): ``{"free": {"path", "free_bytes"}, "tracker": step or None, "saves": [{"step",
    "roles": {"actor": bytes, "critic": bytes}}], "exports": [{"step", "bytes", "save": whether
    its actor save is still there}]}`` (verl_lab_box/checkpoints.py, whose ``scan`` answers the same
    on the box; an export of a removed save is pruned before the run, so the disk check counts it
    as free), or None (the default) when df gave nothing usable."""

    def command(self, path: str) -> str:
        return checkpoint_fact_command(path)

    def process(self, output) -> dict | None:
        return parse_checkpoint_output("\n".join(output)) or self.default()
