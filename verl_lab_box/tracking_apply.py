"""The tracking copy's writing side: a stream (verl_lab_box/tracking_copy.py's format) applied to a copy,
the copy's state, and the hub's stream made from the controller's cache. Root writes here, on the hub
(``<lab_root>/tracking-lab``: root's, no parent the train user can write) and the controller in its cache;
every folder and file is still opened one name at a time with ``O_NOFOLLOW`` below the copy's root, a
file that is appended to is checked to be a regular file of the size the manifest says, and a whole file
is written beside its name (``PART``, created ``O_EXCL``) and renamed over it, which replaces a link
itself, never its target.

``python3 tracking_apply.py state ROOT`` (the copy's files, sizes and tokens, as JSON) and
``python3 tracking_apply.py apply ROOT [--group GROUP] < stream`` (the result, as JSON), on the hub as
root; the controller calls ``apply_stream`` and ``write_push`` in its own process (tasks/tracking_copy.py).
Standard library only.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import stat
import sys

try:
    from verl_lab_box.tracking_copy import (
        DIR_FLAGS,
        FORMAT,
        MANIFEST,
        PART,
        CopyError,
        open_root,
        put,
        records,
        safe_rel,
        send_file,
        tail_digest,
        walk,
    )
except ImportError:                     # on a box: the programs lie side by side
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from tracking_copy import (
        DIR_FLAGS,
        FORMAT,
        MANIFEST,
        PART,
        CopyError,
        open_root,
        put,
        records,
        safe_rel,
        send_file,
        tail_digest,
        walk,
    )


def push_plan(cache: dict, hub: dict, boxes) -> tuple[list, list]:
    """What the hub's copy needs to hold what the cache holds: ``([(rel, how, offset)], [rel to delete])``.
    ``cache``/``hub``: ``{rel: {"size", "token"}}``. A hub file of the same token and no longer than the
    cache's gets the bytes it lacks; any other is copied whole. A hub file the cache lacks goes, only
    under a box the cache holds (never anything of a box the controller knows nothing of)."""
    send = []
    for rel in sorted(cache):
        mine, theirs = cache[rel], hub.get(rel)
        if theirs and theirs.get("token") and theirs["token"] == mine["token"] and theirs["size"] <= mine["size"]:
            if theirs["size"] < mine["size"]:
                send.append((rel, "append", theirs["size"]))
        else:
            send.append((rel, "whole", 0))
    boxes = set(boxes)
    drop = sorted(rel for rel in hub if rel not in cache and rel.split("/", 1)[0] in boxes)
    return send, drop


def load_manifest(root_fd: int) -> dict:
    try:
        fd = os.open(MANIFEST, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=root_fd)
    except OSError:
        return {}
    try:
        with os.fdopen(fd, "rb") as f:
            data = json.loads(f.read() or b"{}")
    except ValueError:
        return {}
    files = data.get("files") if isinstance(data, dict) else None
    return {k: v for k, v in files.items() if safe_rel(k) and isinstance(v, dict)} if isinstance(files, dict) else {}


def save_manifest(root_fd: int, files: dict) -> None:
    part = MANIFEST + ".part"
    fd = create_new(root_fd, part, 0o600)
    try:
        data = memoryview(json.dumps({"format": FORMAT, "files": files}, sort_keys=True).encode())
        while data:
            data = data[os.write(fd, data):]
    finally:
        os.close(fd)
    os.rename(part, MANIFEST, src_dir_fd=root_fd, dst_dir_fd=root_fd)


def create_new(dir_fd: int, name: str, mode: int, gid: int | None = None) -> int:
    """A new file ``name`` in ``dir_fd`` (a stale one of that name removed first), ``O_EXCL`` and
    ``O_NOFOLLOW``: never an existing file or a link's target; root's and ``gid``'s where given."""
    try:
        os.unlink(name, dir_fd=dir_fd)
    except FileNotFoundError:
        pass
    fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=dir_fd)
    if gid is not None:
        os.fchown(fd, 0, gid)
    os.fchmod(fd, mode)
    return fd


def open_parent(root_fd: int, rel: str, create: bool, gid: int | None = None, mode: int = 0o750) -> int:
    """The folder holding ``rel``, each part opened with ``O_NOFOLLOW`` (made when ``create``); a new
    descriptor."""
    fd = os.dup(root_fd)
    for part in rel.split("/")[:-1]:
        try:
            nfd = os.open(part, DIR_FLAGS, dir_fd=fd)
        except FileNotFoundError:
            if not create:
                os.close(fd)
                raise
            os.mkdir(part, mode, dir_fd=fd)
            nfd = os.open(part, DIR_FLAGS, dir_fd=fd)
            if gid is not None:
                os.fchown(nfd, 0, gid)
            os.fchmod(nfd, mode)
        except OSError:
            os.close(fd)
            raise
        os.close(fd)
        fd = nfd
    return fd


class _Target:
    """The file a ``begin`` record opened: appended to in place, or written beside and renamed over."""

    def __init__(self, root_fd: int, record: dict, gid: int | None, file_mode: int, dir_mode: int):
        rel, how = record.get("rel"), record.get("how")
        if not safe_rel(rel) or how not in ("append", "whole"):
            raise CopyError(f"a begin record for {rel!r} ({how!r}) names no file of the copy")
        self.rel, self.how, self.token = rel, how, record.get("token")
        self.name = rel.rsplit("/", 1)[-1]
        self.dir_fd = open_parent(root_fd, rel, create=True, gid=gid, mode=dir_mode)
        self.existed = False
        try:
            if how == "append":
                offset = record.get("offset")
                self.fd = os.open(self.name, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self.dir_fd)
                st = os.fstat(self.fd)
                if not stat.S_ISREG(st.st_mode) or not isinstance(offset, int) or st.st_size < offset:
                    os.close(self.fd)
                    raise CopyError(f"{rel}: the copy holds {st.st_size} bytes, not the {offset} to append to")
                if st.st_size > offset:      # bytes of an append that did not finish: not the copy's
                    os.ftruncate(self.fd, offset)
                os.lseek(self.fd, offset, os.SEEK_SET)
            else:
                self.fd = create_new(self.dir_fd, PART, file_mode, gid)
        except BaseException:
            os.close(self.dir_fd)
            raise

    def write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(self.fd, view):]

    def finish(self, record: dict) -> dict:
        st = os.fstat(self.fd)
        entry = {"size": st.st_size, "tail": tail_digest(self.fd, st.st_size)}
        for key in ("id", "mtime_ns"):
            if key in record:
                entry[key] = record[key]
        if self.how == "whole":
            try:
                old = os.stat(self.name, dir_fd=self.dir_fd, follow_symlinks=False)
                self.existed = True
                if stat.S_ISDIR(old.st_mode):
                    raise CopyError(f"{self.rel}: a folder where the copy's file belongs")
            except FileNotFoundError:
                pass
            os.rename(PART, self.name, src_dir_fd=self.dir_fd, dst_dir_fd=self.dir_fd)
            entry["token"] = self.token or secrets.token_hex(8)
        return entry

    def close(self) -> None:
        os.close(self.fd)
        if self.how == "whole":
            try:
                os.unlink(PART, dir_fd=self.dir_fd)
            except FileNotFoundError:
                pass
        os.close(self.dir_fd)


def apply_stream(root: str, inp, gid: int | None = None, file_mode: int = 0o640, dir_mode: int = 0o750,
                 owner: int | None = None, trusted: bool = True) -> dict:
    """Write a stream into the copy at ``root`` (made if missing); its manifest follows. ``gid``: the group
    that may read it (files ``file_mode``, folders ``dir_mode``, root's); ``owner``: the uid ``root`` must
    belong to. ``trusted`` False (a box's stream, which its train user could have written): its tokens
    and deletes are not taken. A file that fails is named in ``failed`` and left out of the manifest (it
    travels whole next time); the others go on."""
    root_fd = open_root(root, owner, create_mode=dir_mode)
    result = {"created": 0, "appended": 0, "replaced": 0, "deleted": 0, "bytes": 0, "failed": [], "done": False}
    try:
        manifest = load_manifest(root_fd)
        target, failed_rel = None, None
        try:
            for record, data in records(inp):
                op = record.get("op")
                if op == "begin":
                    if target is not None:
                        raise CopyError(f"{target.rel}: begun again before its end")
                    failed_rel = None
                    try:
                        target = _Target(root_fd, record if trusted else {**record, "token": None}, gid,
                                         file_mode, dir_mode)
                    except (OSError, CopyError) as exc:
                        failed_rel = record.get("rel")
                        manifest.pop(failed_rel, None)
                        result["failed"].append({"rel": failed_rel, "why": str(exc)})
                elif op == "data":
                    if target is not None:
                        target.write(data)
                        result["bytes"] += len(data)
                    elif failed_rel is None:
                        raise CopyError("bytes outside a file's records")
                elif op == "end":
                    if target is not None:
                        try:
                            entry = target.finish(record)
                            if target.how == "append":
                                entry["token"] = (manifest.get(target.rel) or {}).get("token") or secrets.token_hex(8)
                                result["appended"] += 1
                            else:
                                result["replaced" if target.existed else "created"] += 1
                            manifest[target.rel] = entry
                        except (OSError, CopyError) as exc:
                            manifest.pop(target.rel, None)
                            result["failed"].append({"rel": target.rel, "why": str(exc)})
                        finally:
                            target.close()
                            target = None
                    failed_rel = None
                elif op == "delete":
                    rel = record.get("rel")
                    if not trusted:
                        result["failed"].append({"rel": rel, "why": "a delete in a box's stream: not taken"})
                        continue
                    if safe_rel(rel) and _delete(root_fd, rel):
                        result["deleted"] += 1
                    manifest.pop(rel, None)
                elif op == "done":
                    result["done"] = True
                    result["skipped"] = record.get("skipped") or {}
                    result["missing"] = bool(record.get("missing"))
                    result["source_uid"] = record.get("uid")
                    break
        except CopyError as exc:         # a malformed or cut stream: what came whole before it stands
            result["error"] = str(exc)
        finally:
            if target is not None:       # cut short inside a file: its bytes are not the copy's
                manifest.pop(target.rel, None)
                target.close()
            save_manifest(root_fd, manifest)
    finally:
        os.close(root_fd)
    return result


def _delete(root_fd: int, rel: str) -> bool:
    try:
        fd = open_parent(root_fd, rel, create=False)
    except OSError:
        return False
    try:
        os.unlink(rel.rsplit("/", 1)[-1], dir_fd=fd)      # unlink never follows a link: it removes the name
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def copy_state(root: str) -> dict:
    """Every file of a copy: ``{rel: {"size", "token"}}``, the size as the file has it, the token as the
    manifest has it (None: a file the manifest does not know, copied whole)."""
    try:
        root_fd = open_root(root)
    except FileNotFoundError:
        return {}
    try:
        manifest = load_manifest(root_fd)
        out, skipped = {}, {}
        for rel, fd, st in walk(root_fd, skipped):
            os.close(fd)
            entry = manifest.get(rel) or {}
            # a size the manifest does not say is a file it does not know: copied whole
            out[rel] = {"size": st.st_size, "token": entry.get("token") if entry.get("size") == st.st_size else None}
        return out
    finally:
        os.close(root_fd)


def write_push(cache_root: str, send: list, drop: list, out, tokens: dict) -> int:
    """The hub's stream: ``send`` (push_plan's) read from the cache at ``cache_root`` (each file through a
    descriptor; its manifest token named), ``drop`` deleted. The bytes sent."""
    root_fd = open_root(cache_root)
    sent = 0
    try:
        for rel, how, offset in send:
            fd = None
            try:
                pfd = open_parent(root_fd, rel, create=False)
                try:
                    fd = os.open(rel.rsplit("/", 1)[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=pfd)
                finally:
                    os.close(pfd)
                st = os.fstat(fd)
                if stat.S_ISREG(st.st_mode):
                    sent += send_file(out, rel, fd, st, how, offset, token=tokens.get(rel))
            except OSError:
                continue        # gone from the cache since it was listed: the next push sees it
            finally:
                if fd is not None:
                    os.close(fd)
        for rel in drop:
            put(out, {"op": "delete", "rel": rel})
    finally:
        os.close(root_fd)
    put(out, {"op": "done", "format": FORMAT, "skipped": {}, "uid": os.geteuid()})
    return sent


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="tracking_apply", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    s = sub.add_parser("state", help="the copy's files, sizes and tokens")
    s.add_argument("root")
    a = sub.add_parser("apply", help="as root: write the stream on stdin into ROOT")
    a.add_argument("root")
    a.add_argument("--group", help="the group that reads the copy (TensorBoard's user)")
    args = ap.parse_args(argv)
    out = sys.stdout.buffer
    try:
        if args.command == "state":
            out.write(json.dumps(copy_state(args.root), sort_keys=True).encode() + b"\n")
        else:
            import grp
            gid = grp.getgrnam(args.group).gr_gid if args.group else None
            result = apply_stream(args.root, sys.stdin.buffer, gid=gid, owner=0 if os.geteuid() == 0 else None)
            out.write(json.dumps(result, sort_keys=True).encode() + b"\n")
            if not result["done"]:
                return 3
    except (CopyError, OSError, KeyError) as exc:
        print(f"tracking_apply {args.command}: {exc}", file=sys.stderr)
        return 2
    out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
