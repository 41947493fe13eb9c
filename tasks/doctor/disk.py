"""The doctor's reading of a full disk: which path filled, how much was wanted and free where the
message says so, and for the checkpoint folder and the export the plan's numbers.

Pure: the lines before a finding (and the box's plan.json) in, a finding's details out. The rules
that call these are files/doctor/disk.toml and checkpoints.toml; each message read here is cited
there from the library that prints it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from verl_lab_box.checkpoints import gib

# Python's OSError: "[Errno 28] No space left on device: 'path'" (" -> 'dst'" for a copy: the
# destination is the full one)
OS_PATH = re.compile(r"No space left on device: '([^']+)'(?: -> '([^']+)')?")
# Ray 2.46 file_system_monitor.cc
RAY_OVER = re.compile(r"(\S+) is over ([\d.]+)% full, available space: ([\d.]+(?:e-?\d+)?) GB; "
                      r"capacity: ([\d.]+(?:e\+?\d+)?) GB")
RAY_OBJECT = re.compile(r"in object store because it is full\. Object size is (\d+) bytes")
# huggingface_hub file_download._check_disk_space
HF_SPACE = re.compile(r"The expected file size is: ([\d.]+) MB\. The target location (\S+) only has ([\d.]+) MB free")
# verl_lab_box/hf_snapshot.py
CUT = re.compile(r"was cut at (\d+) of (\d+) bytes \(\[Errno 28\][^)]*\); the partial file (\S+) is kept")
STAGING = re.compile(r"completed files are kept in (\S+?)(?: and|$)")
# verl-lab's own disk checks (tasks/data/stage.py, tasks/cuda.py)
STAGE_SHORT = re.compile(r"not enough free disk on (\S+) .*?: (\d+) MiB free, (\d+) MiB needed")
# the env build's own line (files/templates/env-build.sh.j2)
ENV_GEN = re.compile(r"verl-lab: building (\S+)")


def analyse_disk(lines: Sequence[str], plan: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """What the messages in ``lines`` (the finding's line last but a few) say about the disk: the
    path that filled (the last one named), and the sizes where the message gives them."""
    out: dict[str, Any] = {}
    for line in lines:
        if m := OS_PATH.search(line):
            out["path"] = m[2] or m[1]
        if m := RAY_OVER.search(line):
            out.update(path=m[1], threshold_percent=float(m[2]), available_gb=float(m[3]), capacity_gb=float(m[4]))
        if m := RAY_OBJECT.search(line):
            out["object_bytes"] = int(m[1])
        if m := HF_SPACE.search(line):
            out.update(path=m[2], file_bytes=round(float(m[1]) * 1e6), free_bytes=round(float(m[3]) * 1e6))
        if m := CUT.search(line):
            out.update(path=m[3], file_bytes=int(m[2]), written_bytes=int(m[1]),
                       needs_at_least_bytes_more=int(m[2]) - int(m[1]))
        elif m := STAGING.search(line):
            out.setdefault("path", m[1])
        if m := STAGE_SHORT.search(line):
            out.update(path=m[1], free_mib=int(m[2]), needed_mib=int(m[3]))
        if m := ENV_GEN.search(line):
            out["env_generation_being_built"] = m[1]
    if "needs_at_least_bytes_more" in out:
        out["advice"] = (f"the file needs {gib(out['needs_at_least_bytes_more'])} more on the disk of {out['path']} "
                         "(and every file after it of the snapshot)")
    elif "file_bytes" in out and "free_bytes" in out:
        out["advice"] = (f"the file needs {gib(out['file_bytes'])}, its disk had {gib(out['free_bytes'])} free "
                         f"({out['path']})")
    elif "threshold_percent" in out:
        out["advice"] = (f"{out['path']}: {out['available_gb']} GB free of {out['capacity_gb']} GB; Ray creates no "
                         f"object that needs spilling while the disk is over {out['threshold_percent']:g}% full")
    return out


def analyse_checkpoint_disk(lines: Sequence[str], plan: Mapping[str, Any] | None) -> dict[str, Any]:
    """The plan's checkpoint numbers for a disk that filled: one save on this box, how many are on
    disk at once, the export, and what one kept save fewer would free; the path where one is named."""
    seen = {k: v for k, v in analyse_disk(lines).items() if k == "path"}
    cp = (plan or {}).get("checkpoints")
    if not cp:
        return {**seen, "advice": "no plan.json with checkpoint sizes for this box: re-run deploy/train.py."}
    save, keep, export = cp["save_bytes_this_box"], cp["keep"], cp["export_bytes"]
    out = {**seen, "save_bytes_this_box": save, "saves_on_disk_at_once": cp["max_ckpt_to_keep"],
           "export_bytes": export, "disk_bytes_this_box": cp["disk_bytes_this_box"]}
    out["advice"] = (f"one save here is {gib(save)}; checkpoints keep = {keep} holds {cp['max_ckpt_to_keep']} "
                     f"on disk at once ({keep} whole + 1 being written), with the export {gib(export)}: "
                     f"{gib(cp['disk_bytes_this_box'])} before margin. "
                     + (f"keep = {keep - 1} needs {gib(save)} less." if keep > 1 else
                        "keep = 1 is the fewest: free space or use a larger disk."))
    return out
