"""One lab box: a copy of the cached Debian rootfs booted with systemd-nspawn, sharing the
machine's network, reached over ssh on its own port of 127.0.0.1.

A box rebooted from inside (``systemctl reboot``) is started again on the same root, as a host
comes back from a reboot. A box is stopped with ``systemctl poweroff`` over ssh (with a timeout), then by the nspawn PID
recorded at boot (checked against the process start time, so a reused PID is never hit),
then its remaining processes are found by their root directory, never by name.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.lab.gpus import DEFAULT_DRIVER, GPUS, cards_for, standin_nvidia_smi
from tests.lab.gpus import gpu as gpu_model

HOST_CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
NSPAWN_REBOOTED = 133      # systemd-nspawn's exit status when the container rebooted


class BoxError(RuntimeError):
    pass


@dataclass(frozen=True)
class BoxSpec:
    """What to boot.

    ``name``: the box's inventory name (and hostname stem); ``gpu``: a key of tests.lab.gpus.GPUS
    (default: the name itself when it is one, else "t4"); ``gpu_count``: 0 boots a box with no
    nvidia-smi at all; ``driver``: the driver version nvidia-smi reports (None: no nvidia-smi,
    i.e. a box without an NVIDIA driver); ``groups``: extra inventory groups; ``data``: host data
    written into the inventory for this box.
    """

    name: str
    gpu: str | None = None
    gpu_count: int = 1
    driver: str | None = DEFAULT_DRIVER
    groups: tuple[str, ...] = ()
    data: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        if not self.name.replace("-", "").replace("_", "").isalnum() or not self.name[0].isalpha():
            raise ValueError(f"box name {self.name!r}: use letters, digits, '-' or '_', starting with a letter")
        if self.gpu is None:
            object.__setattr__(self, "gpu", self.name if self.name in GPUS else "t4")
        gpu_model(self.gpu)   # raises on an unknown key

    @classmethod
    def of(cls, spec: BoxSpec | str) -> BoxSpec:
        return spec if isinstance(spec, BoxSpec) else cls(name=spec)

    @property
    def gpus(self) -> list[str]:
        return [self.gpu] * self.gpu_count if self.driver is not None else []


def proc_start_time(pid: int) -> int | None:
    """The process's start time (clock ticks since boot), None when it is gone or a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    rest = stat.rsplit(")", 1)[1].split()
    if rest[0] in ("Z", "X"):
        return None
    return int(rest[19])


def alive(pid: int | None, start: int | None) -> bool:
    return bool(pid) and proc_start_time(pid) is not None and proc_start_time(pid) == start


def free_port(host: str = "127.0.0.1", high: int = 59999) -> int:
    """A port free on ``host`` now, from a wide random range 20000..``high`` (several runs share the machine)."""
    import random
    for _ in range(200):
        port = random.randint(20000, high)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        return port
    raise BoxError(f"no free port on {host}")


class Box:
    def __init__(self, spec: BoxSpec, box_dir: Path, *, key: Path, known_hosts: Path, run_tag: str,
                 port: int | None = None, log=print):
        self.spec = spec
        self.name = spec.name
        self.dir = box_dir
        self.root = box_dir / "root"
        self.key = key
        self.known_hosts = known_hosts
        self.port = port or free_port()
        self.hostname = f"{spec.name}-{run_tag}"[:63]
        self.machine = f"vl-{run_tag}-{spec.name}"[:63]
        self.machine_id = uuid.uuid4().hex
        self.overlay = False
        self.pid: int | None = None
        self.pid_start: int | None = None
        self.proc: subprocess.Popen | None = None
        self._stopping = False
        self.reboots = 0
        self.console = box_dir / "console.log"
        self.log = log

    # ------------------------------------------------------------------ state
    def record(self) -> dict:
        return {"pid": self.pid, "pid_start": self.pid_start, "port": self.port, "dir": str(self.dir),
                "root": str(self.root), "overlay": self.overlay, "machine": self.machine, "hostname": self.hostname,
                "gpu": self.spec.gpu, "gpus": self.spec.gpus}

    @property
    def gpu(self) -> str:
        return self.spec.gpu

    # ------------------------------------------------------------------ create
    def prepare(self, rootfs: Path) -> None:
        """Copy the rootfs and give the copy its identity, keys, sshd port and nvidia-smi."""
        if self.dir.exists():
            unmount_root(self.root)
            remove_tree(self.dir)
        self.dir.mkdir(parents=True)
        self.overlay = overlay_root(rootfs, self.dir)
        if not self.overlay:
            subprocess.run(["cp", "-a", "--reflink=auto", str(rootfs), str(self.root)], check=True)
        r = self.root
        (r / "etc/hostname").write_text(self.hostname + "\n")
        hosts = (r / "etc/hosts").read_text() if (r / "etc/hosts").exists() else "127.0.0.1\tlocalhost\n"
        (r / "etc/hosts").write_text(hosts + f"127.0.1.1\t{self.hostname} {self.name}\n")
        (r / "etc/machine-id").write_text(self.machine_id + "\n")
        # one host key, ed25519: `ssh-keygen -A` also makes an RSA key, whose generation costs ~1 s of CPU a box
        # (docs/testing.md, "CPU time"); pyinfra and ssh verify the ed25519 key as they would any other
        (r / "etc/ssh").mkdir(parents=True, exist_ok=True)
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"root@{self.hostname}",
                        "-f", str(r / "etc/ssh/ssh_host_ed25519_key")], check=True, stdin=subprocess.DEVNULL,
                       stdout=subprocess.DEVNULL)
        (r / "etc/ssh/sshd_config.d/verl-lab-box.conf").write_text(
            "# written by tests/lab/box.py: this box shares the machine's network\n"
            f"Port {self.port}\nListenAddress 127.0.0.1\nHostKey /etc/ssh/ssh_host_ed25519_key\n"
            "PermitRootLogin prohibit-password\n"
            "PasswordAuthentication no\nKbdInteractiveAuthentication no\nUseDNS no\n"
            "MaxSessions 64\nMaxStartups 64:30:128\n")
        # pip in this box does not byte-compile what it installs, as an admin's pip.conf may say (the env stage
        # honours the box's pip config: files/templates/env-build.sh.j2 sets no PIP_CONFIG_FILE). An env build's
        # byte-compiling took ~38 of its ~56 CPU-s (torch and verl's needs, docs/testing.md "CPU time"), about 7
        # builds a CI run; without it the first import as root (the build's own proofs) writes the bytecode of what
        # it imports, ~8 CPU-s once. The tests' own venvs (Ray, TensorBoard, the data stage's pyarrow) ask for --compile
        (r / "etc/pip.conf").write_text("# written by tests/lab/box.py (docs/testing.md, \"CPU time\")\n"
                                        "[install]\ncompile = false\n")    # ("no-compile = true" would turn it on)
        ssh_dir = r / "root/.ssh"
        ssh_dir.mkdir(mode=0o700, exist_ok=True)
        auth = ssh_dir / "authorized_keys"
        auth.write_text(Path(str(self.key) + ".pub").read_text())
        auth.chmod(0o600)
        if HOST_CA_BUNDLE.is_file():
            dest = r / "etc/ssl/certs/ca-certificates.crt"
            dest.parent.mkdir(parents=True, exist_ok=True)
            if dest.is_symlink():
                dest.unlink()
            shutil.copyfile(HOST_CA_BUNDLE, dest)
        smi = r / "usr/bin/nvidia-smi"
        if self.spec.gpus:
            smi.write_text(standin_nvidia_smi(cards_for(self.hostname, self.spec.gpus), self.spec.driver))
            smi.chmod(0o755)
        elif smi.exists():
            smi.unlink()

    def known_hosts_lines(self) -> list[str]:
        lines = []
        for pub in sorted((self.root / "etc/ssh").glob("ssh_host_*_key.pub")):
            kind, blob = pub.read_text().split()[:2]
            lines.append(f"[127.0.0.1]:{self.port} {kind} {blob}")
        return lines

    def start(self) -> None:
        Path("/run/systemd/nspawn").mkdir(parents=True, exist_ok=True)
        self._stopping = False
        self._spawn_watched()

    def _spawn_watched(self) -> None:
        self._spawn()
        threading.Thread(target=self._restart_on_reboot, name=f"box-{self.name}-reboots", daemon=True).start()

    def _spawn(self) -> None:
        out = open(self.console, "ab")
        self.proc = subprocess.Popen(
            ["systemd-nspawn", "--register=no", "--keep-unit", "--quiet", "--link-journal=no",
             f"--machine={self.machine}", "-D", str(self.root), "-b", "--console=pipe"],
            stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        out.close()
        self.pid = self.proc.pid
        time.sleep(0.05)
        self.pid_start = proc_start_time(self.pid)

    def _restart_on_reboot(self) -> None:
        """A box rebooted from inside (``systemctl reboot``) ends its systemd-nspawn with status 133,
        as systemd-nspawn(1) documents; start it again on the same root, as systemd-nspawn@.service's
        RestartForceExitStatus=133 does for a machine, so the box comes back like a rebooted host."""
        while True:
            proc = self.proc
            if proc is None or proc.wait() != NSPAWN_REBOOTED or self._stopping:
                return
            self.reboots += 1
            self.log(f"lab: box {self.name} rebooted (boot {self.reboots + 1}); starting it again")
            self._spawn()

    def wait_ready(self, timeout: float = 90, respawns: int = 1) -> None:
        """Wait for sshd, then for systemd to finish booting (running or degraded).

        A systemd-nspawn that exits before the box's sshd answers is started again on the same
        root, ``respawns`` times (logged, with its console): under a full machine (the test suite's
        parallel workers) nspawn 252 was seen to exit 255 at start, 2 boxes of ~60 in a run, with
        nothing on its console but its own cleanup message. A box that fails again fails."""
        deadline = time.monotonic() + timeout
        while True:
            if (self.proc is not None and self.proc.poll() == NSPAWN_REBOOTED and not self._stopping
                    and time.monotonic() < deadline):
                time.sleep(0.3)           # rebooted: _restart_on_reboot starts it again
                continue
            if self.proc is not None and self.proc.poll() is not None:
                why = f"box {self.name}: systemd-nspawn exited ({self.proc.returncode}) during boot:\n" + self.console_tail()
                if respawns <= 0:
                    raise BoxError(why)
                respawns -= 1
                self.log(f"lab: {why}\nlab: starting box {self.name} again")
                self._spawn_watched()     # the watcher of the first start ended with it
                deadline = time.monotonic() + timeout
                continue
            with socket.socket() as s:
                s.settimeout(1)
                try:
                    s.connect(("127.0.0.1", self.port))
                    banner = s.recv(64)
                    if banner.startswith(b"SSH-"):
                        break
                except OSError:
                    pass
            if time.monotonic() > deadline:
                raise BoxError(f"box {self.name}: sshd did not answer on port {self.port} in {timeout:.0f}s:\n"
                               + self.console_tail())
            time.sleep(0.3)
        left = max(5, deadline - time.monotonic())
        res = self.ssh(f"timeout {int(left)} systemctl is-system-running --wait", check=False, timeout=left + 10)
        state = res.stdout.strip()
        if state not in ("running", "degraded"):
            raise BoxError(f"box {self.name}: systemd is {state!r} (rc {res.returncode}) {res.stderr.strip()}\n"
                           + self.console_tail())
        if state == "degraded":
            failed = self.ssh("systemctl --failed --no-legend --plain | cut -d' ' -f1", check=False).stdout.split()
            self.log(f"lab: box {self.name} booted degraded (failed units: {', '.join(failed) or '?'})")

    def console_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.console.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no console log)"

    # ------------------------------------------------------------------ use
    def ssh_command(self) -> list[str]:
        return ssh_argv(self.key, self.known_hosts, self.port, connect_timeout=10)

    def ssh(self, command: str, *, check: bool = True, timeout: float = 300, input: str | bytes | None = None,
            user: str | None = None) -> subprocess.CompletedProcess:
        """Run ``command`` (a shell string) on the box as root (or ``user`` via runuser)."""
        if user:
            import shlex
            command = f"runuser -u {shlex.quote(user)} -- sh -c {shlex.quote(command)}"
        text = not isinstance(input, bytes)
        res = subprocess.run(self.ssh_command() + ["--", command], capture_output=True, text=text,
                             input=input, timeout=timeout)
        if check and res.returncode != 0:
            raise BoxError(f"box {self.name}: `{command}` failed with rc {res.returncode}:\n"
                           f"{res.stdout}\n{res.stderr}")
        return res

    run = ssh

    def exists(self, path: str) -> bool:
        return self.ssh(f"test -e '{path}'", check=False).returncode == 0

    def read_text(self, path: str) -> str:
        return self.ssh(f"cat '{path}'").stdout

    def write_text(self, path: str, content: str, mode: str = "644") -> None:
        self.ssh(f"mkdir -p \"$(dirname '{path}')\" && cat > '{path}' && chmod {mode} '{path}'", input=content)

    def stat(self, path: str) -> tuple[str, str, str]:
        """(octal mode, owner, group) of ``path`` on the box."""
        mode, owner, group = self.ssh(f"stat -c '%a %U %G' '{path}'").stdout.split()
        return mode, owner, group

    # ------------------------------------------------------------------ destroy
    def stop(self, timeout: float = 20, remove: bool = True) -> subprocess.Popen | None:
        """Stop the box; ``remove``: delete its folder too (see stop_box). Returns the deleting process."""
        self._stopping = True
        deleting = stop_box(self.record(), timeout=timeout, ssh=self.ssh_command(), proc=self.proc, log=self.log,
                            remove=remove)
        self.pid = None
        return deleting


def stop_box(rec: Mapping[str, Any], *, timeout: float = 20, ssh: list[str] | None = None,
             proc: subprocess.Popen | None = None, log=print, remove: bool = True) -> subprocess.Popen | None:
    """Stop a box from its state record: poweroff over ssh, then its PID, then leftovers by root dir.

    ``remove``: also delete the box's folder (in the background; the deleting process is returned). A lab
    that deletes its whole folder next passes False: a second ``rm`` over a tree another ``rm`` is still
    deleting costs many times the CPU of one (docs/testing.md, "Deleting a lab")."""
    pid, start, root = rec.get("pid"), rec.get("pid_start"), Path(rec["root"])
    if alive(pid, start):
        if ssh:
            try:
                subprocess.run(ssh + ["--", "systemctl poweroff"], capture_output=True, timeout=10)
            except subprocess.TimeoutExpired:
                pass
            _wait_gone(pid, start, proc, timeout)
        for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
            if not alive(pid, start):
                break
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                break
            _wait_gone(pid, start, proc, wait)
    if proc is not None:
        try:
            proc.wait(timeout=1)
        except subprocess.TimeoutExpired:
            pass
    _kill_rooted_at(root)
    unmount_root(root)
    box_dir = Path(rec["dir"])
    if remove and box_dir.exists():
        # a full rootfs copy takes ~30 s to delete on a discard-mounted disk, and an overlay's own
        # writes can be GBs too (Python env generations): teardown does not wait for either
        return remove_tree_later(box_dir)
    return None


def _wait_gone(pid, start, proc, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            return
        if not alive(pid, start):
            return
        time.sleep(0.2)


def _kill_rooted_at(root: Path) -> None:
    """SIGKILL processes whose root directory is this box's rootfs (a killed nspawn's orphans)."""
    try:
        target = str(root.resolve())
    except OSError:
        return
    for _ in range(3):
        found = []
        for p in Path("/proc").iterdir():
            if not p.name.isdigit():
                continue
            try:
                if os.readlink(p / "root") == target:
                    found.append(int(p.name))
            except OSError:
                continue
        if not found:
            return
        for pid in found:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.5)


def ssh_argv(key: Path | str, known_hosts: Path | str, port: int, connect_timeout: int = 10) -> list[str]:
    """The test harness's ssh to a box (root@127.0.0.1:port), up to the command.

    KexAlgorithms: OpenSSH 9.x's default key exchange (sntrup761x25519) costs ~65 ms more client CPU a connection
    than curve25519 (measured here: 77 against 12 ms), and the suite opens some 1,400 connections a run
    (docs/testing.md, "CPU time"). Only this harness's own ssh uses it: pyinfra's connections (paramiko) are the
    product's and keep their own choice."""
    return ["ssh", "-F", "/dev/null", "-i", str(key), "-o", "IdentitiesOnly=yes", "-o", "BatchMode=yes",
            "-o", f"UserKnownHostsFile={known_hosts}", "-o", "StrictHostKeyChecking=yes",
            "-o", f"ConnectTimeout={connect_timeout}", "-o", "LogLevel=ERROR",
            "-o", "KexAlgorithms=curve25519-sha256,curve25519-sha256@libssh.org",
            "-p", str(port), "root@127.0.0.1"]


def overlay_root(lower: Path, box_dir: Path) -> bool:
    """Mount ``box_dir/root`` as an overlay on the (read-only, shared) cached rootfs.

    Creating and deleting a box is then instant: only what the box writes lands in
    ``box_dir/upper`` (a full copy takes seconds to make and ~30 s to delete on this disk).
    False when overlayfs is not available: the caller copies instead.
    """
    if os.environ.get("VERL_LAB_COPY_ROOTFS"):
        return False
    upper, work, root = box_dir / "upper", box_dir / "work", box_dir / "root"
    for d in (upper, work, root):
        d.mkdir(parents=True, exist_ok=True)
    res = subprocess.run(["mount", "-t", "overlay", "overlay", "-o",
                          f"lowerdir={lower},upperdir={upper},workdir={work}", str(root)],
                         capture_output=True, text=True)
    if res.returncode != 0:
        for d in (upper, work, root):
            d.rmdir()
        return False
    return True


def unmount_root(root: Path) -> None:
    """Unmount a box's overlay root if it is mounted (lazily when still busy)."""
    target = str(root)
    try:
        mounted = any(line.split()[4] == target for line in Path("/proc/self/mountinfo").read_text().splitlines())
    except OSError:
        return
    if not mounted:
        return
    if subprocess.run(["umount", target], capture_output=True).returncode != 0:
        subprocess.run(["umount", "-l", target], capture_output=True)


def remove_tree_later(path: Path) -> subprocess.Popen | None:
    """Rename ``path`` aside and delete it in a detached process, so teardown does not wait; returns that
    process (None when the rename failed and ``path`` was deleted here)."""
    trash = path.with_name(f".deleting-{path.name}-{uuid.uuid4().hex[:8]}")
    try:
        path.rename(trash)
    except OSError:
        remove_tree(path)
        return None
    return subprocess.Popen(["rm", "-rf", "--one-file-system", str(trash)], stdin=subprocess.DEVNULL,
                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


def remove_tree(path: Path) -> None:
    """rm -rf that never crosses into another file system (a bind mount left inside a box)."""
    subprocess.run(["rm", "-rf", "--one-file-system", str(path)], check=False)
