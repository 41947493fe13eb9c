"""The cached Debian 12 rootfs (tests/lab/rootfs.py) as a chroot on an overlay: real dpkg and apt of a lab box
without booting one (no systemd, no sshd, no network), for tests of what dpkg and apt themselves do with a
box's packages. Made in about a second (a copy of the rootfs, as a booted box makes, where overlayfs cannot be
mounted), gone with ``close`` (what ran wrote only to the overlay's upper layer, or the copy).

Its ``ssh`` and ``write_text`` answer as a booted box's do (tests/lab/box.py), so the stand-ins that set up a box
(tests/fixtures/standins/driver.py: ``serve_from_local_repo``) set up this one too. Nothing runs inside but what a
test asks: no /proc, /sys or /run of the host is mounted, so systemctl and lspci find nothing.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from tests.lab.box import overlay_root, unmount_root
from tests.lab.rootfs import ensure_rootfs

ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LC_ALL": "C",
       "DEBIAN_FRONTEND": "noninteractive", "HOME": "/root"}


class ChrootError(RuntimeError):
    pass


class Chroot:
    def __init__(self, work: Path):
        self.dir = work
        self.root = work / "root"
        rootfs = ensure_rootfs(log=lambda *_: None)
        work.mkdir(parents=True, exist_ok=True)
        if not overlay_root(rootfs, work):          # no overlayfs: a copy, as a booted box makes (tests/lab/box.py)
            subprocess.run(["cp", "-a", "--reflink=auto", str(rootfs), str(self.root)], check=True)

    def ssh(self, command: str, *, check: bool = True, timeout: float = 120,
            input: str | bytes | None = None) -> subprocess.CompletedProcess:
        """``command`` run by sh as root inside the chroot; text out (bytes in, as ``Box.ssh`` takes them)."""
        res = subprocess.run(["chroot", str(self.root), "/bin/sh", "-c", command], input=input, capture_output=True,
                             timeout=timeout, env=ENV, text=not isinstance(input, bytes))
        if isinstance(input, bytes):
            res = subprocess.CompletedProcess(res.args, res.returncode, res.stdout.decode(), res.stderr.decode())
        if check and res.returncode != 0:
            raise ChrootError(f"chroot: {command!r} exited {res.returncode}:\n{res.stdout}{res.stderr}")
        return res

    def path(self, path: str) -> Path:
        return self.root / path.lstrip("/")

    def exists(self, path: str) -> bool:
        return self.path(path).exists()

    def read_text(self, path: str) -> str:
        return self.path(path).read_text()

    def write_text(self, path: str, content: str, mode: str = "644") -> None:
        target = self.path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(content)
        target.chmod(int(mode, 8))

    def close(self) -> None:
        unmount_root(self.root)
        shutil.rmtree(self.dir, ignore_errors=True)
