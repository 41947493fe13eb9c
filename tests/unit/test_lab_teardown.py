"""The lab's teardown deletes its folder with one ``rm`` (tests/lab/lab.py ``Lab.close``, ``stop_recorded``):
the boxes do not delete their own folders inside it, and the deletes of boxes stopped earlier are ended
first. Two ``rm`` over the same tree cost many times the CPU of one (docs/testing.md, "Deleting a lab";
bench/lab_delete.py measures it). Plumbing of the harness itself: stand-in boxes (no nspawn) whose folders
are real files, deleted by the real ``rm``; a ``sleep`` stands in for a box's delete still running."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from tests.lab import lab as lab_mod
from tests.lab.box import remove_tree_later
from tests.lab.lab import Lab, stop_recorded


class StandinBox:
    """What Lab.close and Lab.stop_box use of a box: its name, record, and stop(remove=...)."""

    def __init__(self, lab_dir: Path, name: str, deleting: subprocess.Popen | None = None):
        self.name = name
        self.dir = lab_dir / "boxes" / name
        self.root = self.dir / "root"
        (self.dir / "upper" / "opt").mkdir(parents=True)
        for i in range(20):
            (self.dir / "upper" / "opt" / f"f{i}").write_text("x")
        self.removes: list[bool] = []
        self.deleting = deleting

    def known_hosts_lines(self) -> list[str]:
        return []

    def record(self) -> dict:
        return {"dir": str(self.dir)}

    def stop(self, timeout: float = 20, remove: bool = True):
        self.removes.append(remove)
        if self.deleting is not None:
            return self.deleting
        return remove_tree_later(self.dir) if remove else None


def _started_lab(tmp_path: Path, names=("p40", "t4")) -> Lab:
    lab = Lab(work_dir=tmp_path / "lab")
    lab._started = True
    lab.known_hosts.parent.mkdir(parents=True)
    for name in names:
        lab.boxes[name] = StandinBox(lab.dir, name)
    return lab


def _gone(tmp_path: Path, timeout: float = 20) -> list[Path]:
    """What is left under tmp_path once the detached deletes had ``timeout`` s to finish."""
    deadline = time.monotonic() + timeout
    while (left := sorted(tmp_path.iterdir())) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def test_close_deletes_the_folder_with_one_rm_and_the_boxes_delete_nothing(tmp_path, monkeypatch):
    monkeypatch.delenv("VERL_LAB_KEEP", raising=False)
    lab = _started_lab(tmp_path)
    boxes = list(lab.boxes.values())
    lab.close()
    assert [b.removes for b in boxes] == [[False], [False]]
    assert _gone(tmp_path) == [], "the lab's folder, boxes included, is deleted"


def test_a_kept_folder_still_loses_its_boxes(tmp_path, monkeypatch):
    monkeypatch.delenv("VERL_LAB_KEEP", raising=False)
    lab = _started_lab(tmp_path)
    boxes = list(lab.boxes.values())
    lab.close(keep_dir=True)
    assert [b.removes for b in boxes] == [[True], [True]]
    deadline = time.monotonic() + 20
    while list((lab.dir / "boxes").iterdir()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert list((lab.dir / "boxes").iterdir()) == [] and (lab.dir / "state.json").exists()


def test_close_ends_a_box_delete_still_running_before_its_own_rm(tmp_path, monkeypatch):
    monkeypatch.delenv("VERL_LAB_KEEP", raising=False)
    lab = _started_lab(tmp_path, names=("p40",))
    slow = subprocess.Popen(["sleep", "60"])          # a box's rm still going when the lab closes
    lab.boxes["t4"] = StandinBox(lab.dir, "t4", deleting=slow)
    lab.stop_box("t4")
    assert slow.poll() is None
    lab.close()
    assert slow.returncode is not None and slow.returncode < 0, "the earlier delete was ended"
    assert _gone(tmp_path) == []


@pytest.mark.parametrize("remove", [True, False])
def test_stop_recorded_lets_the_boxes_delete_only_a_folder_it_keeps(tmp_path, monkeypatch, remove):
    work = tmp_path / "lab"
    (work / "boxes" / "p40").mkdir(parents=True)
    (work / "state.json").write_text(json.dumps({"boxes": {"p40": {"dir": str(work / "boxes" / "p40")}}}))
    calls = []
    monkeypatch.setattr(lab_mod, "stop_box", lambda rec, **kw: calls.append(kw["remove"]))
    assert stop_recorded(work, log=lambda m: None, remove=remove) == ["p40"]
    assert calls == [not remove]
    assert work.exists() is not remove
