"""The lab's tracking copy: a folder of growing files (TensorBoard event files, offline trackers' runs)
copied by appending only the bytes it gained, through descriptors that never follow a link.

Why this shape. The files to copy are the train user's (``<lab_root>/tracking``, writable by the training
unit): a name in that folder can be a link, or be swapped for one between a listing and a read, and root
reading it through the name would copy ``/etc/shadow`` to the controller. So the box's side runs as the
train user (``runuser``: the kernel refuses it what that user cannot read) and reads through descriptors:
each folder and file opened with ``O_NOFOLLOW`` one name at a time below the root, the open descriptor
checked (a regular file, the train user's) and read; the decision (append or copy whole) and the read use
the same descriptor, so there is no window between a check and a use. The hub's served copy is root's
alone (``<lab_root>/tracking-lab``, no parent the train user can write): root writes it, still through
descriptors opened with ``O_NOFOLLOW``.

What travels. A file that only grew (same identity ``dev:ino`` on the box, the last bytes the copy holds
still there: ``TAIL`` bytes before the copied size, sha256) travels as its new bytes, appended in place to
the copy (the copy keeps its inode: TensorBoard reads on from where it was); a file that is new, shrank,
was replaced or rewritten travels whole and replaces the copy (written beside it, renamed over it). Each
copy's root keeps a manifest (``MANIFEST``: per file its size, tail digest, the source's identity and a
token naming this version of its bytes) so the next copy knows what it holds.

Three commands, one stream format (records of one JSON line; a ``data`` record is followed by its bytes):

* ``read ROOT --owner USER < known.json > stream``: on a box, as the train user: what changed under ROOT
  since ``known`` (the controller's manifest entries);
* ``state ROOT > state.json``: on the hub, as root: every file of the served copy, its size and token;
* ``apply ROOT [--group GROUP] < stream > result.json``: on the hub, as root: the stream written into ROOT
  (files root's, readable by GROUP). The controller applies a box's stream to its cache with the same
  function, in its own process (tasks/tracking_hub.py), and writes the hub's stream (``write_push``).

Records: ``{"op": "begin", "rel": R, "how": "append", "offset": N}`` or ``{"op": "begin", "rel": R,
"how": "whole", "token": T?}``; ``{"op": "data", "length": L}`` and L bytes, zero or more; ``{"op": "end",
"id": "dev:ino", "mtime_ns": M}``; ``{"op": "delete", "rel": R}``; last ``{"op": "done", "skipped": {...},
"uid": U}`` (a stream without it was cut short). Standard library only.
"""

from __future__ import annotations

import argparse
import errno
import hashlib
import json
import os
import secrets
import stat
import sys

MANIFEST = ".verl-lab-copy.json"
PART = ".verl-lab-part"          # a whole copy being written (no "tfevents" in it: TensorBoard skips it)
RESERVED = (MANIFEST, MANIFEST + ".part", PART)
TAIL = 64 * 1024                 # the bytes before the copied size whose digest must still match
CHUNK = 4 * 2 ** 20
FORMAT = "verl-lab-copy 1"
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
SKIP_KINDS = ("links", "not_regular", "foreign_owner", "unreadable", "bad_name")


class CopyError(Exception):
    """The copy cannot go on (a root that is a link or not its owner's, a stream cut short)."""


# ------------------------------------------------------------------ pure parts


def safe_rel(rel) -> bool:
    """A path relative to a copy's root that names a file inside it: no empty, ``.`` or ``..`` part, no
    NUL, not one of the copy's own files."""
    if not isinstance(rel, str) or not rel or "\0" in rel or rel.startswith("/"):
        return False
    parts = rel.split("/")
    return all(p not in ("", ".", "..") for p in parts) and parts[-1] not in RESERVED


def decide(known, size: int, ident: str, mtime_ns: int, tail_of) -> tuple[str, int]:
    """How a file of ``size`` bytes (identity ``ident``) travels, given what the copy ``known`` holds of
    it: ``("whole", 0)``, ``("append", offset)`` (offset == size: nothing new, the identity refreshed) or
    ``("skip", size)``. ``tail_of(n)``: the digest of the file's ``TAIL`` bytes before ``n``."""
    if not known or known.get("id") != ident or not isinstance(known.get("size"), int):
        return "whole", 0
    have = known["size"]
    if size < have:
        return "whole", 0
    if size == have and mtime_ns == known.get("mtime_ns"):
        return "skip", size
    if tail_of(have) != known.get("tail"):
        return "whole", 0
    return "append", have


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


def known_for_read(manifest: dict) -> dict:
    """The part of a cache's manifest a box's ``read`` needs: the entries copied from that box."""
    return {rel: {k: e[k] for k in ("id", "size", "mtime_ns", "tail") if k in e}
            for rel, e in manifest.items() if e.get("id")}


# ------------------------------------------------------------------ descriptors


def ident_of(st) -> str:
    return f"{st.st_dev}:{st.st_ino}"


def tail_digest(fd: int, size: int) -> str:
    start = max(0, size - TAIL)
    return hashlib.sha256(os.pread(fd, size - start, start)).hexdigest()


def open_root(path: str, owner: int | None = None, create_mode: int | None = None) -> int:
    """The copy's root folder, a folder and not a link; ``owner``: the uid it must belong to."""
    try:
        fd = os.open(path, DIR_FLAGS)
    except FileNotFoundError:
        if create_mode is None:
            raise
        os.mkdir(path, create_mode)
        fd = os.open(path, DIR_FLAGS)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise CopyError(f"{path} is a link or not a folder: not copied") from None
        raise
    st = os.fstat(fd)
    if owner is not None and st.st_uid != owner:
        os.close(fd)
        raise CopyError(f"{path} belongs to uid {st.st_uid}, not {owner}: not copied")
    return fd


def walk(dir_fd: int, skipped: dict, owner: int | None = None, prefix: str = ""):
    """``(rel, fd, stat)`` of every regular file below ``dir_fd``, each opened with ``O_NOFOLLOW`` (the
    caller closes it); links, other kinds, files not ``owner``'s and unreadable names are counted in
    ``skipped``. Folders are entered through their own descriptors, never by a path."""
    with os.scandir(dir_fd) as it:
        names = sorted(e.name for e in it)
    for name in names:
        rel = prefix + name
        if name in RESERVED:
            continue
        if not safe_rel(rel):
            _note(skipped, "bad_name", rel)
            continue
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
        except OSError as exc:
            _note(skipped, "links" if exc.errno == errno.ELOOP else "unreadable", rel)
            continue
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            try:
                yield from walk(fd, skipped, owner, rel + "/")
            finally:
                os.close(fd)
        elif not stat.S_ISREG(st.st_mode):
            os.close(fd)
            _note(skipped, "not_regular", rel)
        elif owner is not None and st.st_uid != owner:
            os.close(fd)
            _note(skipped, "foreign_owner", rel)
        else:
            yield rel, fd, st


def _note(skipped: dict, kind: str, rel: str) -> None:
    entry = skipped.setdefault(kind, {"count": 0, "some": []})
    entry["count"] += 1
    if len(entry["some"]) < 5:
        entry["some"].append(rel)


# ------------------------------------------------------------------ the stream


def put(out, record: dict, data: bytes = b"") -> None:
    out.write(json.dumps(record, sort_keys=True).encode() + b"\n")
    if data:
        out.write(data)


def records(inp):
    """The stream's records, ``(record, data)``; raises CopyError on a malformed one."""
    while True:
        line = inp.readline()
        if not line:
            return
        try:
            record = json.loads(line)
        except ValueError:
            raise CopyError("the stream holds a line that is not JSON") from None
        data = b""
        if record.get("op") == "data":
            length = record.get("length")
            if not isinstance(length, int) or length < 0:
                raise CopyError("a data record without its length")
            data = inp.read(length)
            if len(data) != length:
                raise CopyError("the stream was cut short inside a file's bytes")
        yield record, data


def send_file(out, rel: str, fd: int, st, how: str, offset: int, token: str | None = None) -> int:
    """One file's records: its bytes from ``offset`` to the size it had when it was opened (read through
    ``fd``: what was checked is what is sent). The bytes sent."""
    begin = {"op": "begin", "rel": rel, "how": how, **({"offset": offset} if how == "append" else {})}
    if token:
        begin["token"] = token
    put(out, begin)
    pos, sent = offset, 0
    while pos < st.st_size:
        data = os.pread(fd, min(CHUNK, st.st_size - pos), pos)
        if not data:          # it shrank while being read: what was read stands, the next copy sees the rest
            break
        put(out, {"op": "data", "length": len(data)}, data)
        pos += len(data)
        sent += len(data)
    put(out, {"op": "end", "id": ident_of(st), "mtime_ns": st.st_mtime_ns})
    return sent


def read_changes(root: str, known: dict, out, owner: int | None = None) -> dict:
    """On a box: the stream of what changed under ``root`` since ``known``; a missing root sends nothing."""
    skipped: dict = {}
    counts = {"whole": 0, "append": 0, "bytes": 0}
    try:
        root_fd = open_root(root)       # whoever made it: its files are checked, and read with its user's rights
    except FileNotFoundError:
        put(out, {"op": "done", "format": FORMAT, "missing": True, "skipped": {}, "uid": os.geteuid(), **counts})
        return counts
    try:
        for rel, fd, st in walk(root_fd, skipped, owner):
            try:
                how, offset = decide(known.get(rel), st.st_size, ident_of(st), st.st_mtime_ns,
                                     lambda n, fd=fd: tail_digest(fd, n))
                if how != "skip":
                    counts[how] += 1
                    counts["bytes"] += send_file(out, rel, fd, st, how, offset)
            finally:
                os.close(fd)
    finally:
        os.close(root_fd)
    put(out, {"op": "done", "format": FORMAT, "skipped": skipped, "uid": os.geteuid(), **counts})
    return counts


# ------------------------------------------------------------------ applying a stream


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


# ------------------------------------------------------------------ the program


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="tracking_copy", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    r = sub.add_parser("read", help="on a box, as the train user: the stream of what changed (stdin: known)")
    r.add_argument("root")
    r.add_argument("--owner", help="the user whose files are copied (others are skipped)")
    s = sub.add_parser("state", help="on the hub: the served copy's files, sizes and tokens")
    s.add_argument("root")
    a = sub.add_parser("apply", help="on the hub, as root: write the stream on stdin into ROOT")
    a.add_argument("root")
    a.add_argument("--group", help="the group that reads the copy (TensorBoard's user)")
    args = ap.parse_args(argv)
    out = sys.stdout.buffer
    try:
        if args.command == "read":
            import pwd
            owner = pwd.getpwnam(args.owner).pw_uid if args.owner else None
            known = json.loads(sys.stdin.buffer.read() or b"{}")
            read_changes(args.root, known if isinstance(known, dict) else {}, out, owner)
        elif args.command == "state":
            out.write(json.dumps(copy_state(args.root), sort_keys=True).encode() + b"\n")
        else:
            import grp
            gid = grp.getgrnam(args.group).gr_gid if args.group else None
            result = apply_stream(args.root, sys.stdin.buffer, gid=gid, owner=0 if os.geteuid() == 0 else None)
            out.write(json.dumps(result, sort_keys=True).encode() + b"\n")
            if not result["done"]:
                return 3
    except (CopyError, OSError, KeyError) as exc:
        print(f"tracking_copy {args.command}: {exc}", file=sys.stderr)
        return 2
    out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
