"""The tracking copy's programs (verl_lab_box/tracking_copy.py reads, tracking_apply.py writes) on real
files: what travels (only the bytes a file gained, a replaced or shrunk file whole), and that neither the
read nor the apply follows a link or a folder swapped for one (each protection's test names the mutation
that makes it fail). The programs run here as on a box and on the hub, as subprocesses with this Python
(the box's is stdlib-only too); the owner checks need root (as the e2e suite does), else they are
skipped. The lab's run of the same programs, as the train user over SSH, is tests/e2e/test_tracking.py."""

from __future__ import annotations

import io
import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from verl_lab_box import tracking_apply as ta
from verl_lab_box import tracking_copy as tc

PROGRAM = Path(tc.__file__).resolve()
APPLY = Path(ta.__file__).resolve()
ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="chown and other owners need root")
SECRET = b"SECRET-BYTES-NOT-TO-COPY\n"
BOX_PYTHON = shutil.which("python3", path="/usr/bin:/bin") or sys.executable   # a box's system python


def read(src: Path, known: dict | None = None, owner: int | None = None) -> tuple[bytes, dict]:
    out = io.BytesIO()
    counts = tc.read_changes(str(src), known or {}, out, owner)
    return out.getvalue(), counts


def roundtrip(src: Path, dst: Path, owner: int | None = None) -> dict:
    """One collect: the copy's manifest as known, the read's stream applied (untrusted, as a box's)."""
    known = {}
    if dst.is_dir():
        fd = tc.open_root(str(dst))
        known = tc.known_for_read(ta.load_manifest(fd))
        os.close(fd)
    stream, _ = read(src, known, owner)
    return ta.apply_stream(str(dst), io.BytesIO(stream), trusted=False)


@pytest.fixture
def tree(tmp_path):
    src, dst, outside = tmp_path / "src", tmp_path / "dst", tmp_path / "outside"
    (src / "run").mkdir(parents=True)
    outside.mkdir()
    (outside / "secret").write_bytes(SECRET)
    return src, dst, outside


# ------------------------------------------------------------------ what travels


def test_a_grown_file_travels_as_its_new_bytes_appended_in_place(tree):
    src, dst, _ = tree
    f = src / "run" / "events.out.tfevents.1.box1"
    f.write_bytes(b"a" * 100)
    assert roundtrip(src, dst)["created"] == 1
    inode = (dst / "run" / f.name).stat().st_ino
    with f.open("ab") as out:
        out.write(b"b" * 50)
    stream, counts = read(src, tc.known_for_read(ta.load_manifest(tc.open_root(str(dst)))))
    assert counts == {"whole": 0, "append": 1, "bytes": 50}
    assert b"a" * 10 not in stream          # only the new bytes travelled
    result = ta.apply_stream(str(dst), io.BytesIO(stream), trusted=False)
    assert result["appended"] == 1 and result["bytes"] == 50
    copy = dst / "run" / f.name
    assert copy.read_bytes() == b"a" * 100 + b"b" * 50 and copy.stat().st_ino == inode   # in place
    assert roundtrip(src, dst) == {**result, "appended": 0, "bytes": 0}    # nothing new: nothing travels


@pytest.mark.parametrize("change", ["replaced", "shrank", "rewritten"])
def test_a_replaced_shrunk_or_rewritten_file_travels_whole(tree, change):
    src, dst, _ = tree
    f = src / "run" / "e"
    f.write_bytes(b"x" * 200)
    roundtrip(src, dst)
    if change == "replaced":            # a new inode, longer: the old bytes no longer its prefix
        (src / "run" / "new").write_bytes(b"y" * 300)
        os.replace(src / "run" / "new", f)
    elif change == "shrank":
        f.write_bytes(b"x" * 50)
    else:                               # same inode, grown, but its bytes before the copied size differ
        with f.open("r+b") as out:
            out.write(b"z" * 200 + b"w" * 10)
    result = roundtrip(src, dst)
    assert result["replaced"] == 1 and result["appended"] == 0
    assert (dst / "run" / "e").read_bytes() == f.read_bytes()


def test_decide():
    tail = lambda n: f"t{n}"    # noqa: E731
    known = {"id": "1:2", "size": 10, "mtime_ns": 5, "tail": "t10"}
    assert tc.decide(None, 10, "1:2", 5, tail) == ("whole", 0)
    assert tc.decide(known, 10, "1:2", 5, tail) == ("skip", 10)
    assert tc.decide(known, 15, "1:2", 6, tail) == ("append", 10)
    assert tc.decide(known, 10, "1:2", 6, tail) == ("append", 10)       # touched: identity refreshed, no bytes
    assert tc.decide(known, 15, "1:3", 6, tail) == ("whole", 0)         # another inode
    assert tc.decide(known, 9, "1:2", 6, tail) == ("whole", 0)          # shrank
    assert tc.decide(known, 15, "1:2", 6, lambda n: "other") == ("whole", 0)


def test_push_plan():
    cache = {"b1/r/e": {"size": 12, "token": "A"}, "b1/verl-lab/new": {"size": 5, "token": "N"},
             "b2/r/e": {"size": 9, "token": "C"}, "b2/r/same": {"size": 4, "token": "S"}}
    hub = {"b1/r/e": {"size": 10, "token": "A"}, "b1/verl-lab/old": {"size": 5, "token": "O"},
           "b2/r/e": {"size": 9, "token": "other"}, "b2/r/same": {"size": 4, "token": "S"},
           "b3/r/e": {"size": 4, "token": "Z"}}
    send, drop = ta.push_plan(cache, hub, {"b1", "b2"})
    assert send == [("b1/r/e", "append", 10), ("b1/verl-lab/new", "whole", 0), ("b2/r/e", "whole", 0)]
    # the old summary of a box the cache holds goes; a box the cache knows nothing of is left alone
    assert drop == ["b1/verl-lab/old"]
    assert ta.push_plan(cache, {**hub, "b1/r/e": {"size": 14, "token": "A"}}, {"b1"})[0][0] == ("b1/r/e", "whole", 0)
    assert ta.push_plan(cache, {**hub, "b1/r/e": {"size": 10, "token": None}}, {"b1"})[0][0] == ("b1/r/e", "whole", 0)


def test_a_stream_cut_short_leaves_no_half_file_in_the_manifest(tree):
    src, dst, _ = tree
    (src / "run" / "e").write_bytes(b"q" * 1000)
    stream, _ = read(src)
    cut = stream[:stream.index(b"q" * 10) + 300]
    result = ta.apply_stream(str(dst), io.BytesIO(cut), trusted=False)
    assert not result["done"] and result["created"] == 0 and "cut short" in result["error"]
    assert ta.load_manifest(tc.open_root(str(dst))) == {} and not (dst / "run" / "e").exists()
    assert roundtrip(src, dst)["created"] == 1 and (dst / "run" / "e").read_bytes() == b"q" * 1000


def test_a_boxs_stream_cannot_delete_name_a_token_or_leave_its_folder(tree):
    src, dst, outside = tree
    (src / "run" / "e").write_bytes(b"1")
    roundtrip(src, dst)
    out = io.BytesIO()
    tc.put(out, {"op": "delete", "rel": "run/e"})
    for rel in ("../outside/x", "/etc/x", "run/../../x", "run/.verl-lab-copy.json"):
        tc.put(out, {"op": "begin", "rel": rel, "how": "whole"})
        tc.put(out, {"op": "data", "length": 3}, b"bad")
        tc.put(out, {"op": "end"})
    tc.put(out, {"op": "begin", "rel": "run/t", "how": "whole", "token": "chosen-by-the-box"})
    tc.put(out, {"op": "end"})
    tc.put(out, {"op": "done"})
    result = ta.apply_stream(str(dst), io.BytesIO(out.getvalue()), trusted=False)
    assert (dst / "run" / "e").exists() and result["deleted"] == 0
    assert len(result["failed"]) == 5 and sorted(os.listdir(outside)) == ["secret"]
    assert ta.load_manifest(tc.open_root(str(dst)))["run/t"]["token"] != "chosen-by-the-box"


# ------------------------------------------------------------------ read: links are not followed


def test_read_does_not_follow_a_planted_link(tree):
    """Mutation: without O_NOFOLLOW in ``walk``'s open, the link's target (a file anyone may read) travels."""
    src, dst, outside = tree
    os.symlink(outside / "secret", src / "run" / "events.out.tfevents.9.box1")
    os.symlink(outside, src / "run" / "linked-folder")
    os.mkfifo(src / "run" / "fifo")                  # would block a plain open: skipped, not read
    stream, counts = read(src)
    assert SECRET not in stream and counts["whole"] == 0
    result = ta.apply_stream(str(dst), io.BytesIO(stream), trusted=False)
    assert result["skipped"]["links"]["count"] == 2 and result["skipped"]["not_regular"]["count"] == 1


def test_read_root_that_is_a_link_is_refused(tree):
    src, _, outside = tree
    os.symlink(outside, src / "tensorboard")
    with pytest.raises(tc.CopyError, match="is a link"):
        read(src / "tensorboard")


def test_read_folder_or_file_swapped_for_a_link_at_the_worst_moment(tree, monkeypatch):
    """The rename race, made to happen at the worst moment: the moment the read has opened the folder
    ``run`` (checked it is a folder), the folder is renamed away and a link to another folder put in its
    place; the moment the read has listed ``run``'s names, its file is swapped for a link to a secret.
    The read goes on through the descriptors it opened (O_NOFOLLOW), so nothing of the other folder
    travels. Mutations: ``walk`` entering a folder by its name again after checking it
    (``os.open(name, O_DIRECTORY, dir_fd=...)``) copies the other folder's file; its file open without
    O_NOFOLLOW copies the secret."""
    src, _, outside = tree
    run = src / "run"
    (run / "events.out.tfevents.1.box1").write_bytes(b"ok")
    (run / "events.out.tfevents.2.box1").write_bytes(b"ok2")
    decoy = outside / "decoy"
    decoy.mkdir()
    (decoy / "events.out.tfevents.1.box1").write_bytes(SECRET)
    real_open, real_scandir, done = os.open, os.scandir, set()

    def adversary_open(path, flags, *args, **kwargs):
        fd = real_open(path, flags, *args, **kwargs)
        if path == "run" and "folder" not in done:
            done.add("folder")
            os.rename(run, src / "run.real")
            os.symlink(decoy, run)
        return fd

    def adversary_scandir(fd):
        it = real_scandir(fd)
        if "folder" in done and "file" not in done:
            done.add("file")
            victim = src / "run.real" / "events.out.tfevents.2.box1"
            os.rename(victim, src / "run.real" / "moved")
            os.symlink(outside / "secret", victim)
        return it

    monkeypatch.setattr(tc.os, "open", adversary_open)
    monkeypatch.setattr(tc.os, "scandir", adversary_scandir)
    stream, counts = read(src)
    monkeypatch.undo()
    assert done == {"folder", "file"}
    assert SECRET not in stream and b"ok" in stream
    result = ta.apply_stream(str(tree[1]), io.BytesIO(stream), trusted=False)
    assert result["skipped"]["links"]["some"] == ["run/events.out.tfevents.2.box1"]


@ROOT_ONLY
def test_read_skips_files_not_the_owners(tree):
    """Mutation: without the owner check, a file the train user did not write (root's, left in its tree)
    travels."""
    src, _, _ = tree
    nobody = pwd.getpwnam("nobody").pw_uid
    mine, root_s = src / "run" / "mine", src / "run" / "roots"
    mine.write_bytes(b"mine")
    root_s.write_bytes(SECRET)
    for p in (src, src / "run", mine):
        os.chown(p, nobody, -1)
    stream, counts = read(src, owner=nobody)
    assert SECRET not in stream and counts["whole"] == 1
    result = ta.apply_stream(str(tree[1]), io.BytesIO(stream), trusted=False)
    assert result["skipped"]["foreign_owner"] == {"count": 1, "some": ["run/roots"]}


@ROOT_ONLY
def test_program_read_as_another_user_reads_with_its_rights():
    """The box's command runs ``read`` under ``runuser`` with the system's python3, as on a box: a file its
    owner made unreadable (mode 000) is read by root but not by the user, so what travels is what the
    train user can read."""
    nobody = pwd.getpwnam("nobody").pw_uid
    base = Path(tempfile.mkdtemp(prefix="verl-lab-copy-", dir="/var/tmp"))
    try:
        os.chmod(base, 0o755)
        program = base / PROGRAM.name
        shutil.copy(PROGRAM, program)
        src = base / "src"
        (src / "run").mkdir(parents=True)
        f = src / "run" / "locked"
        f.write_bytes(SECRET)
        f.chmod(0)
        for p in (src, src / "run", f):
            os.chown(p, nobody, -1)
        argv = [BOX_PYTHON, str(program), "read", str(src), "--owner", "nobody"]
        as_user = subprocess.run(["runuser", "-u", "nobody", "--", *argv], input=b"{}", capture_output=True,
                                 timeout=60, cwd="/")
        as_root = subprocess.run(argv, input=b"{}", capture_output=True, timeout=60)
    finally:
        shutil.rmtree(base)
    assert as_user.returncode == 0 and SECRET not in as_user.stdout, as_user.stderr
    assert b'"unreadable"' in as_user.stdout and SECRET in as_root.stdout
    assert json.loads(as_user.stdout.splitlines()[-1])["uid"] == nobody


# ------------------------------------------------------------------ apply: root writes only inside its copy


def _stream(rel: str, data: bytes, how: str = "whole", offset: int = 0) -> bytes:
    out = io.BytesIO()
    tc.put(out, {"op": "begin", "rel": rel, "how": how, **({"offset": offset} if how == "append" else {})})
    tc.put(out, {"op": "data", "length": len(data)}, data)
    tc.put(out, {"op": "end"})
    tc.put(out, {"op": "done"})
    return out.getvalue()


def test_apply_does_not_write_through_a_planted_link(tree):
    """Mutation: ``DIR_FLAGS`` without O_NOFOLLOW (``open_parent`` following a folder's link) writes the
    file into the link's target."""
    _, dst, outside = tree
    dst.mkdir()
    os.symlink(outside, dst / "box1")
    result = ta.apply_stream(str(dst), io.BytesIO(_stream("box1/run/events.out.tfevents.1", b"payload")))
    assert result["created"] == 0 and result["failed"] and sorted(os.listdir(outside)) == ["secret"]


def test_apply_does_not_append_or_replace_through_a_planted_file_link(tree):
    """Mutation: the append's open without O_NOFOLLOW appends to the link's target."""
    _, dst, outside = tree
    (dst / "run").mkdir(parents=True)
    os.symlink(outside / "secret", dst / "run" / "e")
    result = ta.apply_stream(str(dst), io.BytesIO(_stream("run/e", b"more", how="append", offset=len(SECRET))))
    assert result["failed"] and (outside / "secret").read_bytes() == SECRET
    result = ta.apply_stream(str(dst), io.BytesIO(_stream("run/e", b"whole")))
    # the rename replaces the link itself, never its target
    assert result["replaced"] == 1 and (outside / "secret").read_bytes() == SECRET
    assert not (dst / "run" / "e").is_symlink() and (dst / "run" / "e").read_bytes() == b"whole"


def test_apply_delete_removes_no_file_through_a_link(tree):
    """Mutation: ``_delete`` opening the parent with a path that follows links removes the target's file."""
    _, dst, outside = tree
    dst.mkdir()
    os.symlink(outside, dst / "box1")
    out = io.BytesIO()
    tc.put(out, {"op": "delete", "rel": "box1/secret"})
    tc.put(out, {"op": "done"})
    assert ta.apply_stream(str(dst), io.BytesIO(out.getvalue()))["deleted"] == 0
    assert (outside / "secret").read_bytes() == SECRET


def test_apply_refuses_a_root_that_is_a_link_or_not_roots(tree):
    _, dst, outside = tree
    os.symlink(outside, dst)
    with pytest.raises(tc.CopyError, match="is a link"):
        ta.apply_stream(str(dst), io.BytesIO(_stream("x", b"1")))
    if os.geteuid() == 0:
        mine = tree[0].parent / "theirs"
        mine.mkdir()
        os.chown(mine, pwd.getpwnam("nobody").pw_uid, -1)
        with pytest.raises(tc.CopyError, match="belongs to uid"):
            ta.apply_stream(str(mine), io.BytesIO(_stream("x", b"1")), owner=0)


@ROOT_ONLY
def test_apply_makes_files_roots_and_readable_by_the_group(tree):
    _, dst, _ = tree
    gid = pwd.getpwnam("nobody").pw_gid
    ta.apply_stream(str(dst), io.BytesIO(_stream("box1/run/e", b"1")), gid=gid)
    for path, mode in ((dst / "box1", 0o750), (dst / "box1" / "run", 0o750), (dst / "box1" / "run" / "e", 0o640)):
        st = path.stat()
        assert (st.st_uid, st.st_gid, st.st_mode & 0o777) == (0, gid, mode), path


def test_state_lists_sizes_and_tokens_the_manifest_vouches_for(tree):
    src, dst, _ = tree
    (src / "run" / "e").write_bytes(b"12345")
    roundtrip(src, dst)
    state = ta.copy_state(str(dst))
    assert state["run/e"]["size"] == 5 and state["run/e"]["token"]
    (dst / "run" / "e").write_bytes(b"123")       # changed behind the manifest's back: copied whole again
    assert ta.copy_state(str(dst))["run/e"] == {"size": 3, "token": None}
    assert ta.copy_state(str(dst / "none")) == {}


def test_program_end_to_end(tree):
    """The three commands as the box and the hub run them (a subprocess, the program's own file)."""
    src, dst, _ = tree
    (src / "run" / "e").write_bytes(b"abc")
    read_out = subprocess.run([sys.executable, "-S", str(PROGRAM), "read", str(src)], input=b"{}",
                              capture_output=True, check=True).stdout
    applied = subprocess.run([sys.executable, "-S", str(APPLY), "apply", str(dst)], input=read_out,
                             capture_output=True, check=True).stdout
    assert json.loads(applied)["created"] == 1
    state = json.loads(subprocess.run([sys.executable, "-S", str(APPLY), "state", str(dst)],
                                      capture_output=True, check=True).stdout)
    assert state["run/e"]["size"] == 3
    cut = subprocess.run([sys.executable, "-S", str(APPLY), "apply", str(dst)], input=read_out[:-20],
                         capture_output=True)
    assert cut.returncode in (2, 3)
