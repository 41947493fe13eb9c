"""The Debian bookworm root filesystem every box boots from: built once with debootstrap,
cached, and copied (or overlaid) per box.

The cache lives under ``/var/cache/verl-lab-test/`` (``VERL_LAB_CACHE`` overrides it). A build
is guarded by ``flock`` so two test runs never debootstrap at once, and a cache entry counts
only when its completion stamp exists (the stamp is written last), so an interrupted build is
rebuilt, never used.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

from tests.lab.cachelock import locked

SUITE = "bookworm"
DEFAULT_MIRROR = "http://deb.debian.org/debian"
PACKAGES = (
    "systemd", "systemd-sysv", "dbus", "openssh-server", "python3", "sudo", "ca-certificates",
    "curl", "git", "xz-utils", "python3-venv", "python3-pip", "gcc", "g++", "make", "procps",
    "iproute2", "gcc-11", "g++-11", "less", "rsync",
)
STAMP = ".verl-lab-rootfs-complete"


def cache_dir() -> Path:
    return Path(os.environ.get("VERL_LAB_CACHE", "/var/cache/verl-lab-test"))


def debian_mirror() -> str:
    """The Debian mirror this machine's apt uses (sources.list or deb822 .sources)."""
    env = os.environ.get("VERL_LAB_DEBIAN_MIRROR")
    if env:
        return env
    candidates = [Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt/sources.list.d").glob("*"))]
    for path in candidates:
        try:
            text = path.read_text()
        except OSError:
            continue
        for line in text.splitlines():
            line = line.split("#", 1)[0].strip()
            m = re.match(r"^(?:URIs:\s*|deb\s+(?:\[[^\]]*\]\s+)?)(https?://\S+)", line)
            if m and "security" not in m.group(1):
                return m.group(1).rstrip("/")
    return DEFAULT_MIRROR


def cache_key() -> str:
    return hashlib.sha256(f"{SUITE}|{'|'.join(PACKAGES)}|v2".encode()).hexdigest()[:12]


def cached_rootfs() -> Path:
    return cache_dir() / f"rootfs-{SUITE}-{cache_key()}"


def is_complete(path: Path) -> bool:
    return (path / STAMP).is_file()


def ensure_rootfs(log=print) -> Path:
    """Return the cached rootfs, building it first when it is missing or incomplete."""
    target = cached_rootfs()
    if is_complete(target):
        return target
    with locked(cache_dir() / "rootfs.lock"):
        if is_complete(target):           # another run built it while we waited
            return target
        if target.exists():
            shutil.rmtree(target)
        tmp = target.with_name(target.name + f".building-{os.getpid()}")
        if tmp.exists():
            shutil.rmtree(tmp)
        for stale in target.parent.glob(target.name + ".building-*"):
            shutil.rmtree(stale, ignore_errors=True)   # we hold the lock: nobody else builds
        mirror = debian_mirror()
        log(f"lab: building the {SUITE} rootfs with debootstrap from {mirror} (once; cached in {target})")
        started = time.monotonic()
        subprocess.run(
            ["debootstrap", "--variant=minbase", f"--include={','.join(PACKAGES)}",
             SUITE, str(tmp), mirror],
            check=True, stdout=subprocess.DEVNULL,
        )
        _prepare(tmp)
        tmp.rename(target)
        (target / STAMP).write_text(f"built {time.strftime('%F %T')} from {mirror} in {time.monotonic() - started:.0f}s\n")
        log(f"lab: rootfs ready in {time.monotonic() - started:.0f}s")
    return target


def _prepare(root: Path) -> None:
    """Make the tree a clean template: no host keys, no machine-id, no apt lists or debs."""
    subprocess.run(["chroot", str(root), "apt-get", "clean"], check=False)
    for key in (root / "etc/ssh").glob("ssh_host_*"):
        key.unlink()
    (root / "etc/machine-id").write_text("")
    dbus_id = root / "var/lib/dbus/machine-id"
    if dbus_id.is_symlink() or dbus_id.exists():
        dbus_id.unlink()
    shutil.rmtree(root / "var/lib/apt/lists", ignore_errors=True)
    (root / "var/lib/apt/lists/partial").mkdir(parents=True, exist_ok=True)
    # Units that would only slow a box down or fight the host.
    for unit in ("systemd-networkd.service", "systemd-resolved.service", "apt-daily.timer",
                 "apt-daily-upgrade.timer", "e2scrub_all.timer", "fstrim.timer"):
        (root / "etc/systemd/system" / unit).unlink(missing_ok=True)
        os.symlink("/dev/null", root / "etc/systemd/system" / unit)
    # sshd's socket dir and a root login by key only
    (root / "etc/ssh/sshd_config.d").mkdir(parents=True, exist_ok=True)
    (root / "root/.ssh").mkdir(mode=0o700, parents=True, exist_ok=True)


if __name__ == "__main__":
    print(ensure_rootfs())
