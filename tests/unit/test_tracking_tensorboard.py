"""How TensorBoard 2.20.0 (the boxes' pin, this test env's too, with tensorboard-data-server 0.7.2) reads
files that change under it, which decides how the lab's copy writes the hub's files and how the served unit
runs (files/templates/verl-lab-tensorboard.service.j2, tasks/tracking/copy.py):

* the unit's loader (``--load_fast=auto``: the Rust data server) reads bytes appended to a file in place,
  and a new file in a run's folder, where a restarted run's repeated steps replace the earlier points;
* it keeps a replaced file's old bytes (the push then restarts the unit, which reads the new ones);
* ``--detect_file_replacement=true`` does not help: without TensorFlow (the env has none) TensorBoard turns it
  off itself ("requires TensorFlow 2.9+"), and the Python loader it needs shows a restarted run's repeated
  steps twice.

Each case starts TensorBoard from this env on a folder of event files written with the lab's own writer
(tasks/tracking/events.py), with the unit's flags (its reload interval made 1 s), and reads its scalars API.
"""

from __future__ import annotations

import json
import shlex
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from tasks.settings import load_settings
from tasks.tracking import hub
from tasks.tracking.events import _event, record, scalar_value

pytest.importorskip("tensorboard_data_server")
TAG = "verl/score"
HEAD = record(_event(999.0, file_version="brain.Event:2"))


def points(steps, base: float = 0.0) -> bytes:
    return b"".join(record(_event(1000.0 + s, s, values=[scalar_value(TAG, base + s)])) for s in steps)


def unit_flags() -> list[str]:
    """The served unit's TensorBoard flags, as the template renders them, but the folder, port and reload."""
    unit = hub.rendered(hub.UNIT_TEMPLATE, **hub.hub_values(load_settings("box1", {})))
    line = next(ln for ln in unit.splitlines() if ln.startswith("ExecStart="))
    argv = shlex.split(line.split("=", 1)[1])[3:]           # after python -m tensorboard.main
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in ("--logdir", "--host", "--port", "--reload_interval"):
            skip = True
        else:
            out.append(a)
    return out


class Board:
    def __init__(self, logdir: Path, flags: list[str]):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self.proc = subprocess.Popen([sys.executable, "-m", "tensorboard.main", "--logdir", str(logdir), "--host",
                                      "127.0.0.1", "--port", str(port), "--reload_interval", "1", *flags],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"{self.url}/data/logdir", timeout=2)
                return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise AssertionError(f"TensorBoard did not start: {self.log[-2000:]}") from None
                time.sleep(0.5)

    def scalars(self) -> list:
        q = urllib.parse.urlencode({"run": "run", "tag": TAG})
        try:
            return [(s, v) for _, s, v in json.loads(urllib.request.urlopen(
                f"{self.url}/data/plugin/scalars/scalars?{q}", timeout=5).read())]
        except OSError:
            return []

    def wait_for(self, n: int, seconds: float = 20) -> list:
        deadline = time.monotonic() + seconds
        got = self.scalars()
        while len(got) < n and time.monotonic() < deadline:
            time.sleep(0.5)
            got = self.scalars()
        return got

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.log = self.proc.communicate(timeout=20)[0].decode(errors="replace")
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.log = self.proc.communicate()[0].decode(errors="replace")


@pytest.fixture
def run(tmp_path):
    folder = tmp_path / "logdir" / "run"
    folder.mkdir(parents=True)
    return folder


def test_unit_flags_are_the_fast_loader():
    assert unit_flags() == ["--load_fast=auto"]


def test_the_units_loader_reads_appended_bytes_and_keeps_a_replaced_files_old_ones(run):
    f = run / "events.out.tfevents.1.box1"
    f.write_bytes(HEAD + points(range(1, 6)))
    board = Board(run.parent, unit_flags())
    try:
        assert [s for s, _ in board.wait_for(5)] == [1, 2, 3, 4, 5]
        assert "server" in subprocess.run(["ps", "--ppid", str(board.proc.pid), "-o", "args="],
                                          capture_output=True, text=True).stdout, "not the Rust data server"
        with f.open("ab") as out:                 # the copy's append: same inode
            out.write(points(range(6, 9)))
        assert [s for s, _ in board.wait_for(8)] == list(range(1, 9))
        (run / "new").write_bytes(HEAD + points(range(1, 12)))
        (run / "new").replace(f)                  # a replace: a new inode under the same name
        time.sleep(6)
        assert [s for s, _ in board.scalars()] == list(range(1, 9)), "TensorBoard read the replaced file"
    finally:
        board.stop()
    board = Board(run.parent, unit_flags())          # what the push does then: the unit restarted
    try:
        assert [s for s, _ in board.wait_for(11)] == list(range(1, 12))
    finally:
        board.stop()


def test_a_restarted_runs_repeated_steps_replace_the_earlier_points(run):
    """verl started again from its step-6 save writes a new event file in the same run folder from step 7:
    the unit's loader shows each step once, the later value."""
    (run / "events.out.tfevents.1.box1").write_bytes(HEAD + points(range(1, 10)))
    board = Board(run.parent, unit_flags())
    try:
        board.wait_for(9)
        (run / "events.out.tfevents.2.box1").write_bytes(HEAD + points(range(7, 12), base=100))
        got = board.wait_for(11)
        assert got == [(s, float(s)) for s in range(1, 7)] + [(s, 100.0 + s) for s in range(7, 12)]
    finally:
        board.stop()


def test_detect_file_replacement_is_off_without_tensorflow_and_the_python_loader_repeats_steps(run):
    pytest.importorskip("tensorboard")
    try:
        import tensorflow  # noqa: F401
        pytest.skip("TensorFlow is installed here; the boxes' env has none")
    except ImportError:
        pass
    (run / "events.out.tfevents.1.box1").write_bytes(HEAD + points(range(1, 10)))
    board = Board(run.parent, ["--load_fast=false", "--detect_file_replacement=true"])
    try:
        board.wait_for(9)
        (run / "events.out.tfevents.2.box1").write_bytes(HEAD + points(range(7, 12), base=100))
        got = board.wait_for(14)
    finally:
        board.stop()
    assert "File replacement detection requested, but not enabled" in board.log
    assert [s for s, _ in got].count(7) == 2, got


def test_a_record_cut_by_the_copy_is_read_once_its_rest_is_appended(run):
    """The copy sends a file up to the size it had when read: verl may have written half a record."""
    whole = HEAD + points(range(1, 8))
    cut = len(HEAD + points(range(1, 5))) + 7
    f = run / "events.out.tfevents.1.box1"
    f.write_bytes(whole[:cut])
    board = Board(run.parent, unit_flags())
    try:
        assert [s for s, _ in board.wait_for(4)] == [1, 2, 3, 4]
        with f.open("ab") as out:
            out.write(whole[cut:])
        assert [s for s, _ in board.wait_for(7)] == list(range(1, 8))
    finally:
        board.stop()
