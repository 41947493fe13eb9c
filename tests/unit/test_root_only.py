"""Root never follows what a less trusted user controls (docs/architecture.md, "Security"): the pure checks
and the shell they make, run here for real as root against folders of another user (``nobody``).

- ``tasks.placed.root_only_problem`` on the RootOnlyChain fact's answer: a folder root works in must have only
  root-owned parents that no one else can write (or sticky ones), and be root's alone;
- ``root_dir_command``: the base stage's ``mkdir`` of ``install_tmpdir`` under the sticky ``/var/tmp`` refuses
  a link or someone's folder in its place, also when it is planted over and over while the command runs;
- ``verl_lab_box.checkpoints.as_folder_owner`` / ``read_file``: the facts that read the train user's checkpoint
  folder (CheckpointDisk, RunExports) read as its owner, never through a link to root's files, never stuck on a
  FIFO.

The lab proves the same on a booted box through pyinfra (tests/e2e/test_root_links.py).
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from tasks.facts.disk import CheckpointDisk
from tasks.facts.export import RunExports
from tasks.facts.files import RootOnlyChain
from tasks.placed import missing_under_shared, root_dir_command, root_only_problem

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "facts" / "files.RootOnlyChain" / "shared_and_foreign.json"

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="runs commands as root against another user's folders")


def chain(paths):
    fact = RootOnlyChain()
    out = subprocess.run(["sh", "-c", fact.command(paths=paths)], capture_output=True, text=True, check=True).stdout
    return fact.process(out.splitlines())


def nobody() -> tuple[int, int]:
    entry = pwd.getpwnam("nobody")
    return entry.pw_uid, entry.pw_gid


@pytest.fixture
def shared():
    """A folder under root-only parents (mode 755, unlike pytest's 700 tmp folders, so ``nobody`` reaches
    what is its own below it), removed after."""
    base = Path(tempfile.mkdtemp(prefix="verl-lab-rootonly-", dir="/var/tmp"))
    base.chmod(0o755)
    yield base
    shutil.rmtree(base, ignore_errors=True)


def test_the_recorded_chains_are_judged():
    case = json.loads(FIXTURE.read_text())
    found = case["fact"]
    assert root_only_problem("/var/tmp/verl-lab", found["/var/tmp/verl-lab"]) is None     # sticky parent: allowed
    assert missing_under_shared(found["/var/tmp/verl-lab"]) == ["/var/tmp/verl-lab"]      # ... made by root_dir_command
    assert root_only_problem("/opt/verl-lab", found["/opt/verl-lab"]) is None
    assert missing_under_shared(found["/opt/verl-lab"]) == []                               # only root writes in /opt
    why = root_only_problem("/srv/shared/theirs/lab", found["/srv/shared/theirs/lab"])
    assert why.startswith("/srv/shared/theirs, above /srv/shared/theirs/lab, belongs to uid 65534, not root")
    why = root_only_problem("/srv/shared/link/lab", found["/srv/shared/link/lab"])
    assert why.startswith("/srv/shared/link, on the way to /srv/shared/link/lab, is a link of uid 65534's")
    assert "did not say" in root_only_problem("/x", None)


def test_a_name_swapped_while_the_box_answers_is_refused():
    """The rename race at prepare time: ``readlink -m`` met the link, the ``lstat`` of the name a moment later met
    nothing (or a folder where the link led elsewhere): the answers disagree, and that is refused, not trusted.
    (Seen in tests/e2e/test_root_links.py's race before this check: the victim folder, root's, passed as the
    folder itself.)"""
    victim = {"path": "/root/victim", "uid": 0, "mode": "700", "dir": True}
    root = [{"path": "/var/tmp", "uid": 0, "mode": "1777", "dir": True}, {"path": "/", "uid": 0, "mode": "755", "dir": True}]
    seen_link_then_nothing = {"canonical": "/root/victim", "parts": [victim, *root],
                              "written": [{"path": "/var/tmp/verl-lab", "kind": "none", "uid": None}]}
    assert "changed while the box was asked" in root_only_problem("/var/tmp/verl-lab", seen_link_then_nothing)
    seen_nothing_then_folder = {"canonical": "/var/tmp/verl-lab", "parts": root,
                                "written": [{"path": "/var/tmp/verl-lab", "kind": "dir", "uid": 0}]}
    assert "changed while the box was asked" in root_only_problem("/var/tmp/verl-lab", seen_nothing_then_folder)
    seen_folder_then_nothing = {"canonical": "/var/tmp/verl-lab", "parts": [{**victim, "path": "/var/tmp/verl-lab"},
                                                                           *root],
                                "written": [{"path": "/var/tmp/verl-lab", "kind": "none", "uid": None}]}
    assert "changed while the box was asked" in root_only_problem("/var/tmp/verl-lab", seen_folder_then_nothing)


@root_only
def test_a_folder_someone_else_can_change_is_refused_with_why(shared):
    uid, gid = nobody()
    theirs = shared / "theirs"
    theirs.mkdir()
    os.chown(theirs, uid, gid)
    (shared / "open").mkdir()
    (shared / "open").chmod(0o777)                       # writable by all, not sticky
    (shared / "file").write_text("x")
    mine = shared / "mine"
    mine.mkdir()
    (shared / "via-link").symlink_to(theirs)
    (shared / "root-dir").mkdir(mode=0o700)
    subprocess.run(["runuser", "-u", "nobody", "--", "ln", "-s", str(shared / "root-dir"), str(sticky_link := shared /
                    "open" / "their-link")], check=True)      # theirs, to a folder only root can change
    cases = {str(theirs): "belongs to uid", str(theirs / "lab"): f"{theirs}, above", str(shared / "open" / "lab"):
             "has mode 777: others can rename", str(shared / "file"): "is a file, not a folder",
             str(shared / "via-link" / "lab"): f"{theirs}, above", str(shared / "via-link"): "(a link to",
             str(sticky_link): f"{sticky_link}, on the way to {sticky_link}, is a link of uid {uid}'s",
             str(sticky_link / "lab"): "is a link of uid", str(mine): None, str(mine / "not-yet"): None}
    found = chain(list(cases))
    for path, want in cases.items():
        why = root_only_problem(path, found[path])
        assert (why is None) if want is None else (want in (why or "")), (path, why)


@root_only
def test_root_makes_its_folder_in_a_sticky_one_or_stops(shared):
    uid, gid = nobody()
    sticky = shared / "tmp"
    sticky.mkdir()
    sticky.chmod(0o1777)
    victim = shared / "victim"                            # root's, 0700: what a planted link points at
    victim.mkdir(mode=0o700)
    want = sticky / "verl-lab"
    assert missing_under_shared(chain([str(want)])[str(want)]) == [str(want)]
    made = subprocess.run(["sh", "-c", root_dir_command(str(want))], capture_output=True, text=True)
    assert made.returncode == 0 and want.is_dir() and not want.is_symlink(), made.stderr
    assert (want.stat().st_uid, oct(want.stat().st_mode & 0o7777)) == (0, "0o755")
    again = subprocess.run(["sh", "-c", root_dir_command(str(want))], capture_output=True, text=True)
    assert again.returncode == 0                           # a re-run finds it as it made it
    want.rmdir()
    # someone else's link in its place, then someone else's folder: refused, the link's target untouched
    subprocess.run(["runuser", "-u", "nobody", "--", "ln", "-s", str(victim), str(want)], check=True)
    res = subprocess.run(["sh", "-c", root_dir_command(str(want))], capture_output=True, text=True)
    assert res.returncode == 1 and "is not a folder of root's alone" in res.stderr
    assert oct(victim.stat().st_mode & 0o777) == "0o700" and victim.stat().st_uid == 0
    want.unlink()
    subprocess.run(["runuser", "-u", "nobody", "--", "mkdir", "-m", "777", str(want)], check=True)
    res = subprocess.run(["sh", "-c", root_dir_command(str(want))], capture_output=True, text=True)
    assert res.returncode == 1 and want.stat().st_uid == uid


@root_only
def test_a_link_planted_over_and_over_never_gets_root_to_follow_it(shared):
    """The rename race: ``nobody`` re-plants the link as fast as it can while root makes the folder, 200 times;
    whoever wins the name, root never chmods or writes through the link (the victim stays 0700, empty)."""
    sticky = shared / "tmp"
    sticky.mkdir()
    sticky.chmod(0o1777)
    victim = shared / "victim"
    victim.mkdir(mode=0o700)
    want = sticky / "verl-lab"
    planter = subprocess.Popen(["runuser", "-u", "nobody", "--", "sh", "-c",
                                f"while :; do ln -s {victim} {want} 2>/dev/null; rm -f {want} 2>/dev/null; done"])
    outcomes = set()
    try:
        for _ in range(200):
            res = subprocess.run(["sh", "-c", root_dir_command(str(want)) + f" && touch {want}/written-by-root"],
                                 capture_output=True, text=True)
            outcomes.add(res.returncode)
            if res.returncode == 0:
                assert want.is_dir() and not want.is_symlink() and want.stat().st_uid == 0
                shutil.rmtree(want)
    finally:
        planter.terminate()
        planter.wait()
    assert oct(victim.stat().st_mode & 0o777) == "0o700" and list(victim.iterdir()) == []
    assert 1 in outcomes, outcomes            # the planter did win the name at least once, and was refused


# ---------------------------------------------------------------- reading the train user's checkpoint folder

@pytest.fixture
def planted(shared):
    """A checkpoint folder of ``nobody``'s (as the train user's is) under root-only parents, holding links to a
    root-only folder that looks like a scored export, a link to a root-only tracker, and a FIFO."""
    uid, gid = nobody()
    secret = shared / "secret"                            # root's, 0700
    (secret / "hf").mkdir(parents=True)
    (secret / "hf" / "model.safetensors").write_bytes(b"s" * 7)
    (secret / "hf.proof.json").write_text(json.dumps({"ok": True, "files": [{"name": "model.safetensors", "bytes": 7}]}))
    (secret / "hf.gsm8k.json").write_text(json.dumps({"accuracy": 0.4242, "rows": 4242}))
    (secret / "actor").mkdir()
    (secret / "actor" / "shard").write_bytes(b"z" * 4 * 2 ** 20)
    (secret / "tracker").write_text("4242")
    secret.chmod(0o700)
    ckpt = shared / "checkpoints"
    ckpt.mkdir()
    (ckpt / "global_step_9").symlink_to(secret)          # a link in the middle of every path under it
    (ckpt / "latest_checkpointed_iteration.txt").symlink_to(secret / "tracker")
    os.mkfifo(ckpt / "run-finished.json")                 # a cat of it would wait for a writer forever
    for path in (ckpt, *ckpt.iterdir()):
        os.chown(path, uid, gid, follow_symlinks=False)
    return ckpt


def run_fact(fact, timeout=30, **arg):
    start = time.monotonic()
    out = subprocess.run(["sh", "-c", fact.command(**arg)], capture_output=True, text=True, timeout=timeout).stdout
    return fact.process(out.splitlines()), time.monotonic() - start


@root_only
def test_the_checkpoint_folder_is_read_as_its_owner(planted):
    """Mutations tried: ``as_folder_owner`` reading as root (no runuser) puts step 9's secret score and its 4 MiB
    save in the answers; ``read_file`` as ``cat`` waits on the FIFO until the 60 s timeout."""
    exports, took = run_fact(RunExports(), checkpoint_dir=str(planted))
    assert exports["exports"] == [] and exports["latest_step"] is None and exports["finished_step"] is None, exports
    disk, took2 = run_fact(CheckpointDisk(), path=str(planted))
    assert disk["saves"] == [] and disk["exports"] == [] and disk["tracker"] is None, disk
    assert took < 20 and took2 < 20, (took, took2)


@root_only
def test_the_owners_own_files_are_read_as_before(planted):
    """What the train user wrote itself still counts: the same facts on its own tracker, save and scored export."""
    uid, gid = nobody()
    (planted / "latest_checkpointed_iteration.txt").unlink()
    step = planted / "global_step_3"
    for path, data in (("actor/shard", b"a" * 4096), ("hf/model.safetensors", b"m" * 7)):
        (step / path).parent.mkdir(parents=True, exist_ok=True)
        (step / path).write_bytes(data)
    (step / "hf.proof.json").write_text(json.dumps({"ok": True, "files": [{"name": "model.safetensors", "bytes": 7}]}))
    (step / "hf.gsm8k.json").write_text(json.dumps({"accuracy": 0.5, "rows": 12}))
    (planted / "latest_checkpointed_iteration.txt").write_text("3")
    subprocess.run(["chown", "-R", "--no-dereference", f"{uid}:{gid}", str(planted)], check=True)
    exports, _ = run_fact(RunExports(), checkpoint_dir=str(planted))
    assert exports["latest_step"] == 3 and [e["step"] for e in exports["exports"]] == [3]
    assert exports["exports"][0]["proof"]["ok"] is True and exports["exports"][0]["score"]["accuracy"] == 0.5
    disk, _ = run_fact(CheckpointDisk(), path=str(planted))
    assert disk["tracker"] == 3 and [s["step"] for s in disk["saves"]] == [3]


def test_the_box_programs_read_the_checkpoint_folder_without_waiting_or_following(tmp_path):
    """The launcher's ``--check`` (run as the train user by deploy/status.py's and the doctor's fact), its after-run
    and the export read the tracker, the run record and the proofs through ``read_small``: a FIFO in their place
    does not hold them, a link is not followed. Mutation tried: ``scan`` with ``open()`` (before issue 41): it
    waits on the FIFO (deploy/status.py then waits out the fact's 300 s)."""
    import threading

    from verl_lab_box import checkpoints as ck

    (tmp_path / "secret").write_text("4242")
    (tmp_path / ck.TRACKER).symlink_to(tmp_path / "secret")
    assert ck.read_small(str(tmp_path / ck.TRACKER)) is None and ck.scan(str(tmp_path))["tracker"] is None
    (tmp_path / ck.TRACKER).unlink()
    os.mkfifo(tmp_path / ck.TRACKER)
    got = []
    reader = threading.Thread(target=lambda: got.append(ck.scan(str(tmp_path))["tracker"]), daemon=True)
    reader.start()
    reader.join(10)
    assert got == [None], "scan waited on the FIFO"
    (tmp_path / ck.TRACKER).unlink()
    (tmp_path / ck.TRACKER).write_text("12\n")
    assert ck.scan(str(tmp_path))["tracker"] == 12
