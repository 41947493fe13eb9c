"""The tracking copy's two legs, at execute time on the controller (deploy/tracking.py): a box's tracker
files into the controller cache (``collect``), the cache onto the hub's served copy (``push``), each
appending only the bytes a file gained (the programs both ends run: verl_lab_box/tracking_copy.py reads,
verl_lab_box/tracking_apply.py writes).

Who does what, and why it is safe by construction:

* on every box the programs are placed root's (``<lab_root>/libexec/tracking/``) beside a
  staging folder only root can enter (``<lab_root>/cache/tracking``, under the base stage's root-owned
  ``cache``): what the legs hand over between commands (the known state, the streams) lies there;
* ``collect`` runs the program's ``read`` as the train user (``runuser``) over the train user's folder,
  reading through ``O_NOFOLLOW`` descriptors; root only redirects its input and output to files in the
  staging folder and fetches the stream from there. Root never opens a name under the train user's folder;
* ``push`` runs ``state`` and ``apply`` as root over the hub's served copy, ``<lab_root>/tracking-lab``:
  root's, under root-owned parents, in no ``ReadWritePaths`` of the training unit, readable by the train
  user (TensorBoard) and writable by root alone; the stream it applies is the controller's own;
* the controller writes its cache (its own folder) from a box's stream taking only names inside the box's
  folder (no deletes, no tokens from a box: ``trusted=False``).

When the push replaced or removed a file TensorBoard had read, it restarts the served unit: TensorBoard
2.20's default loader (``--load_fast=auto``, the Rust data server) reads appended bytes in place but keeps
reading a replaced file's old inode (tests/unit/test_tracking_tensorboard.py shows both, and that
``--detect_file_replacement`` does nothing without TensorFlow).
"""

from __future__ import annotations

import json
import os
import secrets
import shlex
from io import BytesIO
from pathlib import Path

from pyinfra import logger
from pyinfra.api import StringCommand, deploy

from tasks.placed import place, wanted_dir, wanted_file
from tasks.settings import LabSettings
from verl_lab_box import tracking_apply as apply
from verl_lab_box import tracking_copy as copy

PROGRAM = Path(copy.__file__).resolve()          # the box's side: read
APPLY = Path(apply.__file__).resolve()           # the hub's side: state, apply


def libexec_dir(settings: LabSettings) -> str:
    return f"{settings.lab_root}/libexec/tracking"


def program_path(settings: LabSettings, program: Path = PROGRAM) -> str:
    return f"{libexec_dir(settings)}/{program.name}"


def staging_dir(settings: LabSettings) -> str:
    """Root's alone (0700, under the base stage's root-owned ``<lab_root>/cache``)."""
    return f"{settings.box_cache}/tracking"


def incoming_dir(settings: LabSettings) -> Path:
    """The controller's: a box's stream between its fetch and its apply."""
    return settings.controller_cache / "tracking" / "incoming"


def copy_wanted(settings: LabSettings) -> list:
    return [wanted_dir(settings.lab_root), wanted_dir(f"{settings.lab_root}/libexec"),
            wanted_dir(libexec_dir(settings)),
            wanted_file(program_path(settings), "The tracking copy's program", PROGRAM.read_bytes()),
            wanted_file(program_path(settings, APPLY), "The tracking copy's program (writing side)",
                        APPLY.read_bytes()),
            wanted_dir(settings.box_cache, mode="750"),
            wanted_dir(staging_dir(settings), "The tracking copy's staging folder (root's alone)", mode="700")]


@deploy("The tracking copy's program")
def install_copy_program(settings: LabSettings):
    """On every box whose trackers deploy/tracking.py copies (the hub too): the program and its staging."""
    place(copy_wanted(settings))


# ------------------------------------------------------------------ pure: the commands


def read_command(settings: LabSettings, root: str, known: str, stream: str) -> str:
    """The box's side of ``collect``: the program's ``read`` as the train user; its input and output are
    files of the staging folder that root's shell opens (the train user cannot reach them)."""
    q, user = shlex.quote, settings.train_user
    return (f"cd / && runuser -u {q(user)} -- {q(settings.launcher_python)} {q(program_path(settings))} read "
            f"{q(root)} --owner {q(user)} < {q(known)} > {q(stream)}; rc=$?; rm -f {q(known)}; "
            f"[ $rc -eq 0 ] || rm -f {q(stream)}; exit $rc")


def apply_command(settings: LabSettings, root: str, stream: str) -> str:
    """The hub's side of ``push``, as root. ``-B`` here and in ``state_command``: root's Python writes no bytecode
    beside the placed programs (``tracking_apply`` imports ``tracking_copy``), so the box holds only what the
    deploy placed (tests/e2e/test_converge.py compares its listing)."""
    q = shlex.quote
    return (f"{q(settings.launcher_python)} -B {q(program_path(settings, APPLY))} apply {q(root)} "
            f"--group {q(settings.train_user)} < {q(stream)}; rc=$?; rm -f {q(stream)}; exit $rc")


def state_command(settings: LabSettings, root: str) -> str:
    q = shlex.quote
    return f"{q(settings.launcher_python)} -B {q(program_path(settings, APPLY))} state {q(root)}"


def skipped_words(skipped: dict) -> str:
    """``links 2 (run/a, run/b); foreign_owner 1 (...)``: what the read left out, said once."""
    return "; ".join(f"{kind} {v['count']} ({', '.join(v['some'])})" for kind, v in sorted(skipped.items())
                     if isinstance(v, dict) and v.get("count"))


# ------------------------------------------------------------------ the controller's cache


def cache_files(lab_cache: Path) -> tuple[dict, set]:
    """Every file of the lab's cache (``<box>/<rel>``: size and token) and the boxes it holds. A file the
    box's manifest does not know (the controller's own summary files, a cache from before the manifest)
    is entered with a new token; entries of files gone are dropped."""
    files: dict = {}
    boxes = set()
    if not lab_cache.is_dir():
        return files, boxes
    for box in sorted(p for p in lab_cache.iterdir() if p.is_dir() and not p.is_symlink()):
        boxes.add(box.name)
        fd = copy.open_root(str(box))
        try:
            manifest = apply.load_manifest(fd)
            present = {}
            for rel, f, st in copy.walk(fd, {}):
                try:
                    entry = manifest.get(rel)
                    if not entry or entry.get("size") != st.st_size or not entry.get("token"):
                        entry = {**(entry or {}), "size": st.st_size, "tail": copy.tail_digest(f, st.st_size),
                                 "token": secrets.token_hex(8)}
                        entry.pop("id", None)        # no longer the box's file as the box had it
                    present[rel] = entry
                finally:
                    os.close(f)
            if present != manifest:
                apply.save_manifest(fd, present)
        finally:
            os.close(fd)
        files.update({f"{box.name}/{rel}": {"size": e["size"], "token": e["token"]} for rel, e in present.items()})
    return files, boxes


# ------------------------------------------------------------------ execute time


def _run(host, command: str):
    return host.run_shell_command(StringCommand(command))


def _error(host, text: str) -> bool:
    host.log_styled(f"verl-lab tracking: {text}", fg="red", log_func=logger.error)
    return False


def collect(state, host, settings: LabSettings, remote_root: str, local_root: str) -> bool:
    """A box's files under ``remote_root`` (the train user's) into the cache at ``local_root``: only what
    changed, appended in place where a file only grew (at execute time)."""
    local = Path(local_root)
    local.mkdir(parents=True, exist_ok=True)
    fd = copy.open_root(str(local))
    try:
        known = copy.known_for_read(apply.load_manifest(fd))
    finally:
        os.close(fd)
    token = secrets.token_hex(6)
    staging = staging_dir(settings)
    known_path, stream_path = f"{staging}/{token}.known", f"{staging}/{token}.stream"
    if not host.put_file(BytesIO(json.dumps(known).encode()), known_path):
        return _error(host, f"could not hand the known state of {remote_root} to the box")
    ok, out = _run(host, read_command(settings, remote_root, known_path, stream_path))
    if not ok:
        return _error(host, f"could not read {remote_root} as {settings.train_user}: {out.stderr[-600:]}")
    incoming = incoming_dir(settings)
    incoming.mkdir(parents=True, exist_ok=True)
    fetched = incoming / f"{host.name}-{token}.stream"
    try:
        got = host.get_file(stream_path, str(fetched))
        _run(host, f"rm -f {shlex.quote(stream_path)}")
        if not got:
            return _error(host, f"could not fetch the stream of {remote_root}")
        with fetched.open("rb") as stream:
            result = apply.apply_stream(str(local), stream, trusted=False)
    except copy.CopyError as exc:
        return _error(host, f"the stream of {remote_root} was refused: {exc}")
    finally:
        fetched.unlink(missing_ok=True)
    if not result["done"]:
        return _error(host, f"the stream of {remote_root} was cut short; what arrived whole is kept")
    if result.get("source_uid") == 0:
        return _error(host, f"the read of {remote_root} ran as root, not as {settings.train_user}: refused")
    words = skipped_words(result.get("skipped") or {})
    if words:
        host.log_styled(f"verl-lab tracking: left out under {remote_root} (links, other kinds, files not "
                        f"{settings.train_user}'s): {words}", fg="yellow", log_func=logger.warning)
    for failed in result["failed"]:
        _error(host, f"{failed['rel']}: {failed['why']}")
    host.log_styled(f"verl-lab tracking: {remote_root}: {result['created'] + result['replaced']} file(s) copied "
                    f"whole, {result['appended']} appended to, {result['bytes']} bytes"
                    + (" (no such folder yet)" if result.get("missing") else ""), log_func=logger.info)
    return not result["failed"]


def push(state, host, settings: LabSettings, local_root: str, remote_root: str, unit: str) -> bool:
    """Make the hub's served copy hold what the cache holds (at execute time, after every collect): the
    bytes each file gained appended in place, new or replaced files whole, files the cache dropped
    removed; TensorBoard restarted where it had read a file that was then replaced or removed."""
    ok, out = _run(host, state_command(settings, remote_root))
    if not ok:
        return _error(host, f"could not read the served copy {remote_root}: {out.stderr[-600:]}")
    try:
        served = json.loads(out.stdout or "{}")
    except ValueError:
        return _error(host, f"the served copy's state is not JSON: {out.stdout[:200]}")
    cache, boxes = cache_files(Path(local_root))
    send, drop = apply.push_plan(cache, served, boxes)
    if not send and not drop:
        host.log_styled(f"verl-lab tracking: the hub's copy holds all {len(cache)} file(s) of {len(boxes)} box(es)",
                        log_func=logger.info)
        return True
    incoming = incoming_dir(settings)
    incoming.mkdir(parents=True, exist_ok=True)
    token = secrets.token_hex(6)
    stream = incoming / f"push-{token}.stream"
    remote = f"{staging_dir(settings)}/push-{token}.stream"
    try:
        with stream.open("wb") as f:
            sent = apply.write_push(local_root, send, drop, f, {rel: cache[rel]["token"] for rel, _, _ in send})
        if not host.put_file(str(stream), remote):
            return _error(host, "could not hand the stream to the hub")
    finally:
        stream.unlink(missing_ok=True)
    ok, out = _run(host, apply_command(settings, remote_root, remote))
    try:
        result = json.loads(out.stdout.strip().splitlines()[-1]) if out.stdout.strip() else {}
    except ValueError:
        result = {}
    if not ok or not result.get("done"):
        return _error(host, f"the hub could not apply the stream: {out.stderr[-600:]}")
    for failed in result["failed"]:
        _error(host, f"{failed['rel']}: {failed['why']}")
    if result["replaced"] or result["deleted"]:
        # TensorBoard's loader keeps a replaced or removed file's old bytes: it starts again from the files
        _run(host, f"systemctl try-restart {shlex.quote(unit)}")
    host.log_styled(f"verl-lab tracking: the hub serves {len(cache)} file(s) of {len(boxes)} box(es): "
                    f"{result['created']} new, {result['appended']} appended to, {result['replaced']} replaced, "
                    f"{result['deleted']} removed, {sent} bytes sent", log_func=logger.info)
    return not result["failed"]
