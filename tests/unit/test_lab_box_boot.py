"""The lab box's boot wait (tests/lab/box.py ``Box.wait_ready``): a systemd-nspawn that exits during
boot is started again once, and a second exit fails the box. Plumbing of the lab itself, with real
processes standing in for nspawn: one that exits 255 at once (as nspawn 252 was seen to under a
full machine), and one that answers on the box's port with an SSH banner as the box's sshd would."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.lab.box import Box, BoxError, BoxSpec

BANNER_SERVER = (
    "import socket, sys\n"
    "s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
    "s.bind(('127.0.0.1', int(sys.argv[1]))); s.listen(8)\n"
    "while True:\n"
    "    c, _ = s.accept(); c.sendall(b'SSH-2.0-standin\\r\\n'); c.close()\n"
)


class ScriptedBox(Box):
    """A Box whose starts follow a script: "exit" (the process ends with 255) or "sshd" (it serves
    the banner); systemd answers "running"."""

    def __init__(self, tmp: Path, starts: list[str]):
        super().__init__(BoxSpec("p40"), tmp / "box", key=tmp / "key", known_hosts=tmp / "known_hosts",
                         run_tag="t")
        self.logged: list[str] = []
        self.log = self.logged.append
        self.dir.mkdir(parents=True)
        self.console.write_text("nspawn: cleanup\n")
        self.starts = list(starts)
        self.spawned: list[subprocess.Popen] = []

    def _spawn_watched(self) -> None:
        what = self.starts.pop(0)
        argv = ([sys.executable, "-c", "raise SystemExit(255)"] if what == "exit"
                else [sys.executable, "-c", BANNER_SERVER, str(self.port)])
        self.proc = subprocess.Popen(argv)
        self.spawned.append(self.proc)
        if what == "exit":
            self.proc.wait()

    def ssh(self, command, **kw):
        return subprocess.CompletedProcess(command, 0, stdout="running\n", stderr="")

    def close(self):
        for proc in self.spawned:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.fixture
def boxes(tmp_path):
    made = []

    def make(starts):
        box = ScriptedBox(tmp_path / str(len(made)), starts)
        made.append(box)
        return box

    yield make
    for box in made:
        box.close()


def test_an_nspawn_that_exits_at_boot_is_started_once_more(boxes):
    box = boxes(["exit", "sshd"])
    box._spawn_watched()
    box.wait_ready(timeout=20)
    assert len(box.spawned) == 2 and box.proc.poll() is None
    assert any("systemd-nspawn exited (255) during boot" in line and "starting box p40 again" in line
               for line in box.logged), box.logged


def test_a_second_exit_fails_the_box_with_its_console(boxes):
    box = boxes(["exit", "exit"])
    box._spawn_watched()
    with pytest.raises(BoxError, match=r"(?s)systemd-nspawn exited \(255\) during boot.*nspawn: cleanup"):
        box.wait_ready(timeout=20)
    assert len(box.spawned) == 2


def test_no_respawn_asked_fails_at_the_first_exit(boxes):
    box = boxes(["exit", "sshd"])
    box._spawn_watched()
    with pytest.raises(BoxError):
        box.wait_ready(timeout=20, respawns=0)
    assert len(box.spawned) == 1
