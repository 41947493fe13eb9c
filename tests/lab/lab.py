"""``Lab``: boxes + mirror + inventory + pyinfra runs, torn down even when a test fails.

    with Lab() as lab:                          # starts the mirror (a thread)
        lab.boot(["p40", "t4", BoxSpec("big", gpu="h200", gpu_count=2)])
        res = lab.deploy("deploy/full.py", data={"env_backend": "venv"},
                         per_host={"p40": {"train_steps": 5}})
        res.assert_ok(); assert lab.deploy("deploy/full.py").changed == 0
        lab.box("t4").ssh("id verl")

Work dir: ``/var/tmp/verl-lab-test/<run-id>/`` (``VERL_LAB_WORK`` overrides the base) holding
``state.json`` (PIDs of what this lab started), the per-run ssh key and known_hosts, the boxes'
rootfs copies, ``mirror/`` (``lab.mirror.root``), ``controller-cache/`` and ``inventory.py``.
On start a lab stops the leftovers of dead labs of the same repo (their owner PID is gone);
it never touches a lab whose owner is alive.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from tests.lab import rootfs as rootfs_mod
from tests.lab.box import (
    Box,
    BoxError,
    BoxSpec,
    alive,
    proc_start_time,
    remove_tree,
    remove_tree_later,
    ssh_argv,
    stop_box,
)
from tests.lab.inventory import host_data, write_inventory
from tests.lab.mirror import Mirror
from tests.lab.results import DeployResult, parse

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_LAB_ROOT = "/opt/verl-lab"


def work_base() -> Path:
    return Path(os.environ.get("VERL_LAB_WORK", "/var/tmp/verl-lab-test"))


def requirements_missing() -> str | None:
    """Why the lab cannot run here, or None."""
    import shutil
    if os.geteuid() != 0:
        return "the lab in a box needs root (systemd-nspawn, debootstrap)"
    missing = [t for t in ("systemd-nspawn", "debootstrap", "ssh", "ssh-keygen") if not shutil.which(t)]
    if missing:
        return ("missing " + ", ".join(missing) + ": apt-get install debootstrap systemd-container "
                "openssh-client (see .ci/run)")
    return None


class Lab:
    def __init__(self, work_dir: Path | str | None = None, run_id: str | None = None,
                 repo_root: Path | str | None = None, log=None, mirror_process: bool = False,
                 boot_timeout: float = 120):
        self.run_id = run_id or f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-{secrets.token_hex(3)}"
        self.dir = Path(work_dir) if work_dir else work_base() / self.run_id
        self.repo = Path(repo_root).resolve() if repo_root else REPO_ROOT
        self.tag = secrets.token_hex(3)
        self.log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self.boot_timeout = boot_timeout
        self.mirror_process = mirror_process
        self.boxes: dict[str, Box] = {}
        self.mirror = Mirror(self.dir / "mirror")
        self._mirror_proc: subprocess.Popen | None = None
        self._mirror_url: str | None = None
        self.key = self.dir / "ssh" / "id_ed25519"
        self.known_hosts = self.dir / "ssh" / "known_hosts"
        self.controller_cache = self.dir / "controller-cache"
        self.inventory_path = self.dir / "inventory.py"
        self._deploys = 0
        self._started = False
        self._mirror_urls: dict[str, str] | None = None
        self._deleting: list[subprocess.Popen] = []     # folders of boxes stopped before close, being deleted
        # what runs pyinfra: None, this interpreter; the e2e tests give a pool of preloaded interpreters
        # (tests/fixtures/zygote.py ``Served``: ``.python(env)`` is the interpreter to run under ``env``)
        self.served = None

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> Lab:
        why = requirements_missing()
        if why:
            raise BoxError(why)
        cleanup_stale(self.repo, exclude=self.dir)
        if self.dir.exists():
            stop_recorded(self.dir, log=self.log)      # our own work dir, from a crashed run
        (self.dir / "ssh").mkdir(parents=True, exist_ok=True)
        (self.dir / "boxes").mkdir(exist_ok=True)
        self.controller_cache.mkdir(exist_ok=True)
        self.mirror.root.mkdir(parents=True, exist_ok=True)
        if not self.key.exists():
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"verl-lab-{self.run_id}",
                            "-f", str(self.key)], check=True)
        self.known_hosts.write_text("")
        self._started = True
        self._save()
        if self.mirror_process:
            self._start_mirror_process()
        else:
            self.mirror.start()
        self._save()
        return self

    def __enter__(self) -> Lab:
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self, keep_dir: bool = False) -> None:
        """Stop every box (poweroff, then PID), the mirror, and remove the lab's folder, boxes included.

        One ``rm`` deletes the folder: the boxes do not delete their own folders inside it, and the deletes of
        boxes stopped earlier (``stop_box``) are ended first. Two ``rm`` racing over the same tree cost many
        times the CPU of one (docs/testing.md, "Deleting a lab")."""
        errors = []
        removing = (self._started and not keep_dir and self.dir.exists()
                    and not os.environ.get("VERL_LAB_KEEP"))
        boxes = list(self.boxes.values())
        if boxes:
            # side by side: each box's poweroff waits for its systemd to finish
            with ThreadPoolExecutor(len(boxes)) as pool:
                stops = [(box, pool.submit(box.stop, remove=not removing)) for box in boxes]
            for box, stop in stops:
                try:
                    stop.result()
                except Exception as exc:      # report every box
                    errors.append(f"{box.name}: {exc}")
                self.boxes.pop(box.name, None)
            self._save()
        self.mirror.stop()
        if self._mirror_proc is not None:
            self._mirror_proc.terminate()
            try:
                self._mirror_proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._mirror_proc.kill()
            self._mirror_proc = None
        if removing:
            self._end_deletes()
            remove_tree_later(self.dir)   # boxes are stopped and unmounted: only files are left
        elif self._started:
            self._save()
        self._started = False
        if errors:
            raise BoxError("lab teardown: " + "; ".join(errors))

    # ------------------------------------------------------------------ mirror
    @property
    def mirror_url(self) -> str:
        return self._mirror_url or self.mirror.url

    @property
    def mirror_urls(self) -> dict[str, str]:
        """mirror_urls for the inventory: each served catalog source -> <mirror>/<source>.
        Assign to replace (e.g. to drop a source and use the real one)."""
        if self._mirror_urls is not None:
            return dict(self._mirror_urls)
        from tests.lab.mirror import LAB_SOURCES
        return {s: f"{self.mirror_url}/{s}" for s in LAB_SOURCES}

    @mirror_urls.setter
    def mirror_urls(self, value: Mapping[str, str]) -> None:
        self._mirror_urls = dict(value)

    def _start_mirror_process(self) -> None:
        port_file = self.dir / "mirror.port"
        port_file.unlink(missing_ok=True)
        log = open(self.dir / "mirror.log", "ab")
        self._mirror_proc = subprocess.Popen(
            [sys.executable, "-m", "tests.lab.mirror", "--root", str(self.mirror.root), "--port-file", str(port_file)],
            cwd=self.repo, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, "PYTHONPATH": str(self.repo)})
        log.close()
        deadline = time.monotonic() + 15
        while not port_file.exists():
            if self._mirror_proc.poll() is not None or time.monotonic() > deadline:
                raise BoxError(f"lab mirror process did not start: see {self.dir / 'mirror.log'}")
            time.sleep(0.1)
        self._mirror_url = f"http://127.0.0.1:{int(port_file.read_text())}"

    # ------------------------------------------------------------------ boxes
    def boot(self, specs: Iterable[BoxSpec | str], timeout: float | None = None) -> list[Box]:
        """Boot boxes (in parallel) and wait until each one's systemd is up and sshd answers."""
        if not self._started:
            self.start()
        specs = [BoxSpec.of(s) for s in specs]
        for s in specs:
            if s.name in self.boxes:
                raise BoxError(f"box {s.name} is already booted in this lab")
        rootfs = rootfs_mod.ensure_rootfs(log=self.log)
        started = time.monotonic()
        new = []
        for spec in specs:
            box = Box(spec, self.dir / "boxes" / spec.name, key=self.key, known_hosts=self.known_hosts,
                      run_tag=self.tag, log=self.log)
            self.boxes[spec.name] = box
            new.append(box)
            box.prepare(rootfs)
            self._write_known_hosts()
            box.start()
            self._save()
        for box in new:
            box.wait_ready(timeout or self.boot_timeout)
        self.log(f"lab: booted {', '.join(b.name for b in new)} in {time.monotonic() - started:.1f}s "
                 f"(work dir {self.dir})")
        return new

    def box(self, name: str) -> Box:
        return self.boxes[name]

    def _end_deletes(self) -> None:
        """End the deletes of boxes stopped earlier that still run: what they left is inside the folder
        the lab deletes next, by one ``rm``."""
        for proc in self._deleting:
            if proc.poll() is None:
                proc.terminate()
                proc.wait()
        self._deleting.clear()

    def stop_box(self, name: str) -> None:
        box = self.boxes.pop(name)
        deleting = box.stop()
        if deleting is not None:
            self._deleting.append(deleting)
        self._write_known_hosts()
        self._save()

    def _write_known_hosts(self) -> None:
        lines = [line for b in self.boxes.values() if b.root.exists() for line in b.known_hosts_lines()]
        self.known_hosts.write_text("\n".join(lines) + "\n")

    # ------------------------------------------------------------------ inventory and deploy
    def base_data(self) -> dict[str, Any]:
        return {"mirror_urls": self.mirror_urls, "lab_root": DEFAULT_LAB_ROOT,
                "controller_cache": str(self.controller_cache)}

    def write_inventory(self, data: Mapping[str, Any] | None = None,
                        per_host: Mapping[str, Mapping[str, Any]] | None = None,
                        hosts: Iterable[str] | None = None, path: Path | None = None,
                        rewritten_by: str = "each deploy of the lab", settings_note: str = "") -> Path:
        """The inventory for ``hosts`` (default: all boxes): lab defaults < ``data`` <
        the box spec's data < ``per_host[name]``. ``rewritten_by`` names, in the file's first
        line, what writes it again (a test's deploys; `bin/lab up`)."""
        per_host = per_host or {}
        unknown = set(per_host) - set(self.boxes)
        if unknown:
            raise KeyError(f"per_host names boxes that are not booted: {', '.join(sorted(unknown))}")
        names = list(hosts) if hosts is not None else list(self.boxes)
        rows = []
        for name in names:
            box = self.boxes[name]
            values = host_data(box, key=self.key, known_hosts=self.known_hosts,
                               base={**self.base_data(), **(data or {}), **box.spec.data,
                                     **per_host.get(name, {})})
            rows.append((name, [box.gpu, *box.spec.groups], values))
        return write_inventory(path or self.inventory_path, rows, header=f"Run {self.run_id}, work dir {self.dir}.",
                               rewritten_by=rewritten_by, settings_note=settings_note)

    def deploy(self, deploy_file: str | Path, data: Mapping[str, Any] | None = None,
               per_host: Mapping[str, Mapping[str, Any]] | None = None, hosts: Iterable[str] | None = None,
               extra_args: Iterable[str] = (), mode: str = "json", timeout: float = 1800,
               env: Mapping[str, str] | None = None) -> DeployResult:
        """Run ``python -m pyinfra -y [--json] <inventory> <deploy_file>`` from the repo root."""
        if mode not in ("json", "text"):
            raise ValueError("mode is 'json' or 'text'")
        names = list(hosts) if hosts is not None else list(self.boxes)
        self._deploys += 1
        inv = self.write_inventory(data, per_host, names, path=self.dir / f"inventory-{self._deploys}.py")
        inv_main = self.inventory_path
        inv_main.write_text(inv.read_text())
        run_env = self.pyinfra_env(env)
        python = sys.executable if self.served is None else self.served.python(run_env)
        cmd = [python, "-m", "pyinfra", "-y"]
        if mode == "json":
            cmd.append("--json")
        cmd += [*extra_args, str(inv), str(deploy_file)]
        started = time.monotonic()
        try:
            proc = subprocess.run(cmd, cwd=self.repo, capture_output=True, text=True, timeout=timeout, env=run_env)
            rc, out, err = proc.returncode, proc.stdout, proc.stderr
        except subprocess.TimeoutExpired as exc:
            rc = 124
            out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
            err = (exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else (exc.stderr or ""))
            err += f"\n[lab] pyinfra timed out after {timeout}s"
        logf = self.dir / f"deploy-{self._deploys}.log"
        logf.write_text(f"$ {' '.join(cmd)}\n# rc {rc}, {time.monotonic() - started:.1f}s\n"
                        f"--- stderr\n{err}\n--- stdout\n{out}\n")
        res = parse(cmd, rc, out, err, names, mode=mode)
        self.log(f"lab: deploy {deploy_file} -> rc {rc}, changed {res.changed} {res.changed_by_host}, "
                 f"failed {res.failed_hosts} in {time.monotonic() - started:.1f}s (log {logf})")
        return res

    def pyinfra_env(self, env: Mapping[str, str] | None = None) -> dict[str, str]:
        """The environment ``deploy`` runs pyinfra in: this process's, the repo on PYTHONPATH, ``env`` over it."""
        return {**os.environ, "PYINFRA_PROGRESS": "off", "PYTHONUNBUFFERED": "1",
                "PYTHONPATH": os.pathsep.join(filter(None, [str(self.repo), os.environ.get("PYTHONPATH")])),
                **(env or {})}

    # ------------------------------------------------------------------ state
    def _save(self) -> None:
        if not self.dir.exists():
            return
        me = os.getpid()
        state = {
            "run_id": self.run_id, "repo": str(self.repo), "owner_pid": me, "owner_start": proc_start_time(me),
            "mirror": {"url": self.mirror_url if (self.mirror._server or self._mirror_url) else None,
                       "pid": self._mirror_proc.pid if self._mirror_proc else None,
                       "pid_start": proc_start_time(self._mirror_proc.pid) if self._mirror_proc else None},
            "inventory": str(self.inventory_path), "key": str(self.key), "known_hosts": str(self.known_hosts),
            "boxes": {n: b.record() for n, b in self.boxes.items()},
        }
        tmp = self.dir / "state.json.tmp"
        tmp.write_text(json.dumps(state, indent=1))
        tmp.replace(self.dir / "state.json")

    def detach(self) -> None:
        """Leave boxes and mirror process running (bin/lab up); `bin/lab down` stops them from state.json."""
        self._save()
        state = json.loads((self.dir / "state.json").read_text())
        state["owner_pid"], state["owner_start"] = None, None     # nobody owns it: `down` will stop it
        state["detached"] = True
        (self.dir / "state.json").write_text(json.dumps(state, indent=1))
        self.boxes = {}
        self._mirror_proc = None
        self._started = False


def read_state(work_dir: Path) -> dict | None:
    try:
        return json.loads((Path(work_dir) / "state.json").read_text())
    except (OSError, ValueError):
        return None


def stop_recorded(work_dir: Path, log=print, remove: bool = True) -> list[str]:
    """Stop what a lab's state.json records (boxes by PID, the mirror process); returns box names."""
    state = read_state(work_dir)
    stopped = []
    if state:
        for name, rec in state.get("boxes", {}).items():
            ssh = None
            key, kh = state.get("key"), state.get("known_hosts")
            if key and kh and rec.get("port"):
                ssh = ssh_argv(key, kh, rec["port"], connect_timeout=5)
            stop_box(rec, ssh=ssh, log=log, remove=not remove)   # the folder goes whole, by one rm
            stopped.append(name)
        m = state.get("mirror") or {}
        if alive(m.get("pid"), m.get("pid_start")):
            import signal
            os.kill(m["pid"], signal.SIGTERM)
    if remove and Path(work_dir).exists():
        remove_tree(Path(work_dir))
    return stopped


def cleanup_stale(repo: Path, exclude: Path | None = None, log=print) -> None:
    """Stop labs under the work base whose owner process is gone and whose repo is ours."""
    base = work_base()
    if not base.is_dir():
        return
    for d in base.iterdir():
        if d.name.startswith("."):
            continue
        if exclude is not None and d.resolve() == Path(exclude).resolve():
            continue
        state = read_state(d)
        if not state or state.get("repo") != str(repo) or state.get("detached"):
            continue
        if alive(state.get("owner_pid"), state.get("owner_start")):
            continue
        log(f"lab: stopping leftovers of dead run {state.get('run_id')} ({d})")
        stop_recorded(d, log=log)
