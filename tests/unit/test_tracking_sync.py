"""The offline trackers' sync on the controller (tasks/tracking/sync.py): each run once, each with its own
time limit, every box's cached runs (a box gone from the inventory too), and what counts as synced. The
last two tests run the real wandb 0.21.0 (this env's) against the stand-in server
(tests/fixtures/standins/wandb_server.py): a run synced, then not again, then again once it grew, under its
one run id; and a sync the server refused (401 to every request), which wandb reports as done (exit 0,
``... done.``) but the controller does not record. The rest runs the sync's plumbing with ``subprocess.run``
recorded (a stand-in for the trackers' commands: it proves which commands run, with what time and
environment, not what a tracker does)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tasks.settings import load_settings
from tasks.tracking import Tracking
from tasks.tracking import sync as ts
from tests.fixtures.standins.wandb_server import WandbServer

KEY = "k" * 40


class Host:
    name = "box1"

    def __init__(self):
        self.said: list[str] = []

    def log_styled(self, text, **_):
        self.said.append(text)


def offline_run(root: Path, name: str, size: int = 10) -> Path:
    run = root / "wandb" / f"offline-run-20261205_0101{name}-{name}"
    run.mkdir(parents=True)
    (run / f"run-{name}.wandb").write_bytes(b"w" * size)
    return run


def settings(tmp_path, host: str, **tracking) -> object:
    keys = tmp_path / "keys.env"
    keys.write_text(f"WANDB_API_KEY={KEY}\n")
    keys.chmod(0o600)
    return load_settings(host, {"controller_cache": str(tmp_path / "cache"),
                                "tracking": {"trackers": ["wandb"], "keys_file": str(keys), **tracking}})


def test_runs_to_sync_each_once_and_again_when_grown(tmp_path):
    root = tmp_path / "wandb-copy"
    a, b = offline_run(root, "aaaa"), offline_run(root, "bbbb")
    (root / "wandb" / "offline-run-broken").mkdir()           # no .wandb file: not a run
    todo = ts.runs_to_sync("wandb", root, {})
    assert [r.name for r, _ in todo] == [a.name, b.name]
    synced = dict((r.name, fp) for r, fp in todo)
    assert ts.runs_to_sync("wandb", root, synced) == []
    with (a / "run-aaaa.wandb").open("ab") as f:
        f.write(b"more")
    assert [r.name for r, _ in ts.runs_to_sync("wandb", root, synced)] == [a.name]


def test_sync_argv_holds_no_key_and_each_run_gets_its_own_time(tmp_path):
    run = offline_run(tmp_path, "cccc", size=3 << 20)
    argv = ts.sync_argv("wandb", run)
    assert argv == [sys.executable, "-m", "wandb", "sync", "--no-sync-tensorboard", "--no-mark-synced", str(run)]
    assert ts.run_timeout(run) == ts.SYNC_BASE_S + 3 * ts.SYNC_PER_MIB_S


def test_wandb_synced_reads_the_entity_the_server_gave():
    # wandb 0.21.0's lines, against the stand-in: taken, and refused (401: no entity came back)
    assert ts.wandb_synced("Find logs at: /tmp/x\nSyncing: http://127.0.0.1:43909/lab/p/runs/jtsdpg8z ... done.\n")
    assert not ts.wandb_synced("Syncing: http://127.0.0.1:40039//p/runs/jtsdpg8z ... done.\n")
    assert not ts.wandb_synced("")


def test_sync_every_boxs_runs_one_command_each_a_gone_box_with_the_syncers_settings(tmp_path, monkeypatch):
    own = settings(tmp_path, "box1", wandb_base_url="http://own:1")
    other = settings(tmp_path, "box2", wandb_base_url="http://other:2")
    boxes = ts.boxes_root(own)
    r_own = offline_run(boxes / "box1" / "wandb", "a111")
    r_other = offline_run(boxes / "box2" / "wandb", "b222")
    r_gone1, r_gone2 = offline_run(boxes / "gone" / "wandb", "c333"), offline_run(boxes / "gone" / "wandb", "d444")
    calls = []

    def run(argv, env, capture_output, text, timeout):
        calls.append((argv[-1], env.get("WANDB_BASE_URL"), env.get("WANDB_API_KEY"), timeout))
        if argv[-1] == str(r_gone1):
            raise subprocess.TimeoutExpired(argv, timeout, output=b"half", stderr=b"")
        entity = "lab"
        return subprocess.CompletedProcess(argv, 0, f"Syncing: {env['WANDB_BASE_URL']}/{entity}/p/runs/x ... done.\n",
                                           "")

    monkeypatch.setattr(ts.subprocess, "run", run)
    host = Host()
    # "gone": not in the inventory any more; box2's own settings name its own server
    assert ts.sync(None, host, own, {"box1": own, "box2": other}) is False      # one run timed out
    assert [(Path(c[0]).name, c[1], c[2]) for c in calls] == [
        (r_own.name, "http://own:1", KEY), (r_other.name, "http://other:2", KEY),
        (r_gone1.name, "http://own:1", KEY), (r_gone2.name, "http://own:1", KEY)]
    assert all(c[3] == ts.SYNC_BASE_S for c in calls)
    assert "stopped after" in (boxes / "gone" / "wandb" / ts.LOGS / f"{r_gone1.name}.log").read_text()
    calls.clear()
    assert ts.sync(None, host, own, {"box1": own, "box2": other}) is False      # only the one not synced
    assert [Path(c[0]).name for c in calls] == [r_gone1.name]
    assert not any(KEY in said for said in host.said)


@pytest.fixture
def wandb_run(tmp_path):
    """An offline run made by the real wandb package (this env's 0.21.0), as a box's copy holds it."""
    root = tmp_path / "copy"
    # the box's train.env values for wandb (tasks/tracking/setting.py), its folder moved here
    box_env = Tracking(trackers=("wandb",)).environment("/opt/verl-lab", "box2-run")
    assert box_env["WANDB_MODE"] == "offline" and box_env["WANDB_RUN_GROUP"] == "box2-run"
    env = {**os.environ, **box_env, "WANDB_DIR": str(root), "WANDB_CONFIG_DIR": str(root / "config"),
           "WANDB_CACHE_DIR": str(root / "cache"), "WANDB_SILENT": "true"}
    env.pop("WANDB_API_KEY", None)
    code = ("import wandb; r = wandb.init(project='verl-lab', name='box2-run')\n"
            "for i in range(1, 4): r.log({'critic/score/mean': i / 10}, step=i)\nr.finish()")
    subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True, timeout=300)
    (run,) = (root / "wandb").glob("offline-run-*")
    return root, run


def test_real_wandb_sync_once_then_again_when_grown_same_run_grouped(wandb_run, tmp_path):
    root, run = wandb_run
    with WandbServer() as server:
        tracking = settings(tmp_path, "box2", wandb_base_url=server.url).tracking
        host = Host()
        assert ts.sync_tracker(host, tracking, "wandb", root, "box2")
        first = server.runs()
        assert len(first) == 1 and [r["_step"] for r in server.history_rows()] == [1, 2, 3]
        # a restart's run is another wandb run of the same name: the group (WANDB_RUN_GROUP) holds them together
        assert server.buckets()[0].get("groupName") == "box2-run"
        assert server.keys_used() == {KEY}
        assert ts.sync_tracker(host, tracking, "wandb", root, "box2")        # unchanged: not again
        assert server.runs() == first and len(server.history_rows()) == 3
        with next(run.glob("*.wandb")).open("ab") as f:       # grew (as a run still training does)
            f.write(b"\0" * 8)
        ts.sync_tracker(host, tracking, "wandb", root, "box2")
        assert server.runs() == first                          # synced again: the same run, no other
        # and its rows sent again from line 0: they replace the first sync's lines on the server
        assert server.history_offsets() == [0, 0]


def test_real_wandb_sync_refused_by_the_server_is_not_recorded(wandb_run, tmp_path):
    root, run = wandb_run
    with WandbServer() as server:
        tracking = settings(tmp_path, "box2", wandb_base_url=server.url).tracking
        server.refusing = True
        host = Host()
        assert ts.sync_tracker(host, tracking, "wandb", root, "box2") is False
        log = (root / ts.LOGS / f"{run.name}.log").read_text()
        assert "... done." in log                      # what wandb itself said
        assert not (root / ts.SYNCED).exists() and not list(run.glob("*.synced"))
        server.refusing = False
        assert ts.sync_tracker(host, tracking, "wandb", root, "box2")
        assert len(server.runs()) == 1


def add_files_record(run: Path, path: str) -> None:
    """Rewrite a wandb offline run's log with one more ``files`` record naming ``path`` (before its exit),
    with wandb's own record writer: what a train user's code could make wandb write."""
    from wandb.proto import wandb_internal_pb2
    from wandb.sdk.internal import datastore

    (log,) = run.glob("*.wandb")
    store, records = datastore.DataStore(), []
    store.open_for_scan(str(log))
    while (data := store.scan_data()) is not None:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(data)
        records.append(record)
    store.close()
    extra = wandb_internal_pb2.Record()
    item = extra.files.files.add()
    item.path, item.policy = path, wandb_internal_pb2.FilesItem.PolicyType.NOW
    exits = [r for r in records if r.WhichOneof("record_type") == "exit"]
    log.unlink()
    writer = datastore.DataStore()
    writer.open_for_write(str(log))
    for record in [r for r in records if r not in exits] + [extra] + exits:
        writer.write(record)
    writer.close()


def test_a_run_naming_files_outside_its_folder_is_not_synced(wandb_run, tmp_path):
    """Mutation: without ``wandb_paths_outside``'s check, wandb asks the server for an upload URL of the
    controller's file (RunUploadUrls with ``../../../../secret``)."""
    root, run = wandb_run
    secret = tmp_path / "secret"
    secret.write_text("the controller's own file\n")
    add_files_record(run, os.path.relpath(secret, run / "files"))
    assert ts.wandb_paths_outside(run) == [os.path.relpath(secret, run / "files")]
    with WandbServer() as server:
        tracking = settings(tmp_path, "box2", wandb_base_url=server.url).tracking
        host = Host()
        synced = ts.sync_tracker(host, tracking, "wandb", root, "box2")
        asked = [f for r in server.requests for f in (r["body"].get("variables") or {}).get("files") or []]
        assert not any("secret" in f for f in asked), asked
        assert synced is False and server.requests == [] and "names files outside its folder" in " ".join(host.said)
