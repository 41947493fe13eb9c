"""CPU of deleting a lab's folder: one ``rm`` over the whole folder (what tests/lab/lab.py ``Lab.close`` does)
against the teardown before it, where each box's stop started an ``rm`` on its own folder and the lab, a moment
later, an ``rm`` over the whole folder, boxes included, racing them (docs/testing.md, "Deleting a lab").

Each arm deletes a fresh tree of ``--boxes`` box folders under the lab work base (the disk the labs use), made of
``--files`` small files each (in folders of 100, as a Python env's are), or of a copy of ``--copy-from`` (a real
env). The deletes are the harness's own (``remove_tree_later``); their CPU (user + system) comes from the
kernel's accounting of each ``rm`` as it is reaped (``os.wait4``). Arms interleaved, ``--repeat`` rounds.

    sudo .venv/bin/python bench/lab_delete.py [--boxes 3] [--files 20000] [--copy-from DIR] [--repeat 1]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.harness import log, render_table, summary, write_result  # noqa: E402
from tests.lab.box import remove_tree_later  # noqa: E402
from tests.lab.lab import work_base  # noqa: E402


def make_lab_tree(folder: Path, boxes: int, files: int, copy_from: Path | None) -> int:
    """A lab-like folder: boxes/<name>/upper holding ``files`` files (or a copy of ``copy_from``); returns the
    number of entries made."""
    for b in range(boxes):
        upper = folder / "boxes" / f"box{b}" / "upper"
        if copy_from is not None:
            upper.mkdir(parents=True)
            subprocess.run(["cp", "-a", "--reflink=auto", str(copy_from), str(upper / "env")], check=True)
            continue
        for i in range(files):
            d = upper / "env" / f"pkg{i // 100}"
            if i % 100 == 0:
                d.mkdir(parents=True)
            (d / f"m{i % 100}.py").write_bytes(b"#" * 2048)
    (folder / "mirror").mkdir()
    subprocess.run(["sync"], check=True)
    return sum(1 for _ in folder.rglob("*"))


def reap(procs: list[subprocess.Popen]) -> float:
    """Wait for each process; its CPU seconds (user + system), summed."""
    cpu = 0.0
    for p in procs:
        _, status, usage = os.wait4(p.pid, 0)
        p.returncode = os.waitstatus_to_exitcode(status)
        cpu += usage.ru_utime + usage.ru_stime
    return cpu


def delete_whole(folder: Path) -> float:
    """Lab.close now: the boxes delete nothing, one rm deletes the folder."""
    return reap([remove_tree_later(folder)])


def delete_racing(folder: Path) -> float:
    """Lab.close before: an rm per box folder, then an rm over the whole folder while they run."""
    boxes = [remove_tree_later(d) for d in sorted((folder / "boxes").iterdir())]
    return reap([*boxes, remove_tree_later(folder)])


ARMS = {"one rm (now)": delete_whole, "rm per box + rm of the lab (before)": delete_racing}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--boxes", type=int, default=3)
    ap.add_argument("--files", type=int, default=20000)
    ap.add_argument("--copy-from", type=Path)
    ap.add_argument("--repeat", type=int, default=1)
    args = ap.parse_args(argv)
    base = work_base()
    base.mkdir(parents=True, exist_ok=True)
    cpu: dict[str, list[float]] = {a: [] for a in ARMS}
    wall: dict[str, list[float]] = {a: [] for a in ARMS}
    entries = 0
    for round_ in range(args.repeat):
        for arm, delete in ARMS.items():
            folder = base / f"bench-lab-delete-{os.getpid()}-{round_}"
            entries = make_lab_tree(folder, args.boxes, args.files, args.copy_from)
            log(f"{arm}: {entries} entries")
            started = time.monotonic()
            cpu[arm].append(delete(folder))
            wall[arm].append(time.monotonic() - started)
            left = [p for p in base.iterdir() if folder.name in p.name]
            if left:
                raise SystemExit(f"left behind: {left}")
    base_arm = next(iter(ARMS))
    rows = [(arm, summary(cpu[arm])["median"], summary(wall[arm])["median"],
             summary(cpu[arm])["median"] / summary(cpu[base_arm])["median"]) for arm in ARMS]
    print(f"{args.boxes} box folders, {entries} entries, {args.repeat} round(s), under {base}")
    print(render_table(["delete", "CPU s (median)", "wall s", "CPU x one rm"], rows))
    write_result("lab_delete", {"boxes": args.boxes, "files": args.files, "entries": entries,
                                "copy_from": str(args.copy_from) if args.copy_from else None,
                                "cpu_s": cpu, "wall_s": wall})
    return 0


if __name__ == "__main__":
    sys.exit(main())
