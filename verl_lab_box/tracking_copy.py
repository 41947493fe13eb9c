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

Two programs, one stream format (records of one JSON line; a ``data`` record is followed by its bytes):

* this one, ``read ROOT --owner USER < known.json > stream``: on a box, as the train user: what changed
  under ROOT since ``known`` (the controller's manifest entries);
* ``tracking_apply.py`` (beside it): ``state`` and ``apply`` of a copy, on the hub as root; the controller
  applies a box's stream to its cache with the same code, in its own process (tasks/tracking_copy.py).

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


# ------------------------------------------------------------------ the program


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="tracking_copy", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    r = sub.add_parser("read", help="on a box, as the train user: the stream of what changed (stdin: known)")
    r.add_argument("root")
    r.add_argument("--owner", help="the user whose files are copied (others are skipped)")
    args = ap.parse_args(argv)
    try:
        import pwd
        owner = pwd.getpwnam(args.owner).pw_uid if args.owner else None
        known = json.loads(sys.stdin.buffer.read() or b"{}")
        read_changes(args.root, known if isinstance(known, dict) else {}, sys.stdout.buffer, owner)
    except (CopyError, OSError, KeyError, ValueError) as exc:
        print(f"tracking_copy {args.command}: {exc}", file=sys.stderr)
        return 2
    sys.stdout.buffer.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
