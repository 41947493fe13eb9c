"""Offline trackers' runs: copied from the box into the controller cache, then synced from there with the
controller's keys (deploy/tracking.py), as the relay mode does for downloads the other way.

A box without internet logs wandb, SwanLab and MLflow offline (tasks/tracking/setting.py): wandb to
``$WANDB_DIR/wandb/offline-run-*``, SwanLab to ``$SWANLAB_LOG_DIR``, MLflow to a file store. Their folders are
copied to ``<controller_cache>/tracking/boxes/<box>/<tracker>/`` (tasks/tracking/copy.py: the bytes each file
gained, read as the train user) and synced, one run at a time, each with its own time limit (``run_timeout``):

* wandb: ``python -m wandb sync --no-sync-tensorboard --no-mark-synced <offline-run-*>`` (wandb 0.21.0's own
  command), each run once: the controller records what it synced (``SYNCED``: per run, its ``.wandb`` file's
  name and size) and syncs a run again only when that changed (a run synced while it trained, once it grew:
  under its own run id, the same run on the server). wandb's own marker (``<run>.wandb.synced``) is not used:
  only ``wandb sync --sync-all`` (its scan, ``wandb/sync/sync.py`` ``get_runs``) skips marked runs, not a run
  named on the command line (``wandb/cli/cli.py`` ``_sync_path``), and wandb 0.21.0 writes it, and exits 0,
  even when the server refused every request (tried here: a server answering 401 to all of them). What
  counts as synced: exit 0 and the run's address printed with the entity the server gave it
  (``Syncing: <url>/<entity>/<project>/runs/<id> ... done.``; the refused sync prints ``<url>//<project>/...``:
  no entity came back) (``wandb_synced``);
* SwanLab: ``python -m swanlab sync <run folder>`` (swanlab 0.6.8's command), again only once its files
  changed since the last sync;
* MLflow: has no sync command; its file store stays in the cache, to be served there
  (``mlflow ui --backend-store-uri file://...``) or exported with MLflow's own tools (printed, not run).

Every box's cache is synced, including a box no longer in the inventory (or not answering): the sync runs
once, on the first box of the run, over ``<controller_cache>/tracking/boxes/*``, with the box's own settings
where the inventory still has it, else the settings of the box that syncs.

The keys go to the sync through its environment, read from the keys file when the command runs: never in
its argv, never printed. The controller needs the tracker's package (``pip install -e '.[trackers]'``).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from pyinfra import logger
from pyinfra.api import deploy
from pyinfra.operations import python

from tasks.settings import LabSettings
from tasks.tracking.copy import collect
from tasks.tracking.setting import KEY_VARS, Tracking, read_keys

# a run's sync: a base, and more for each MiB it holds (wandb 0.21.0 sends a run's history rows and files;
# a 3- or 5-step run took 5 s against the stand-in server on this machine: tests/unit/test_tracking_sync.py)
SYNC_BASE_S = 300
SYNC_PER_MIB_S = 2
SYNCED = ".verl-lab-synced.json"      # in a tracker's cache folder: run -> what it was synced at
LOGS = ".verl-lab-sync"               # in a tracker's cache folder: one log per run
SYNCABLE = ("wandb", "swanlab", "mlflow")
WANDB_DONE = re.compile(r"^Syncing: \S+?/([^/\s]*)/([^/\s]+)/runs/([^/\s]+) \.\.\. done\.$", re.M)


def boxes_root(settings: LabSettings) -> Path:
    return settings.controller_cache / "tracking" / "boxes"


def boxes_cache(settings: LabSettings, host: str) -> Path:
    return boxes_root(settings) / host


def offline_folders(settings: LabSettings) -> dict[str, str]:
    """The offline trackers' folders on the box: what is copied (wandb: its runs, not its cache)."""
    folders = settings.tracking.folders(settings.lab_root)
    return {t: folders[t] + ("/wandb" if t == "wandb" else "") for t in settings.tracking.offline}


def local_folder(settings: LabSettings, host: str, tracker: str) -> Path:
    """Where a box's copied runs of ``tracker`` lie (wandb's under ``wandb/``, as on the box)."""
    root = boxes_cache(settings, host) / tracker
    return root / "wandb" if tracker == "wandb" else root


def sync_env(tracking: Tracking, tracker: str, keys: dict[str, str], base: dict[str, str] | None = None) -> dict:
    """The sync's environment: the controller's, the tracker's keys and server, no offline mode."""
    env = {k: v for k, v in (os.environ if base is None else base).items()
           if k not in ("WANDB_MODE", "SWANLAB_MODE")}
    env.update({name: keys[name] for name in KEY_VARS[tracker] if name in keys})
    if tracker == "wandb" and tracking.wandb_base_url:
        env["WANDB_BASE_URL"] = tracking.wandb_base_url
    return env


def _tree_bytes(folder: Path) -> tuple[int, int]:
    files = [p for p in folder.rglob("*") if p.is_file() and not p.is_symlink()]
    return sum(p.stat().st_size for p in files), len(files)


def run_fingerprint(tracker: str, run: Path) -> str | None:
    """What a run holds now, to tell whether it changed since its last sync; None: not a run to sync
    (wandb: a folder without exactly one ``.wandb`` file)."""
    if tracker == "wandb":
        logs = [p for p in run.iterdir() if p.name.endswith(".wandb") and p.is_file()]
        if len(logs) != 1:
            return None
        return f"{logs[0].name}:{logs[0].stat().st_size}"
    size, count = _tree_bytes(run)
    return f"{count}:{size}"


def runs_to_sync(tracker: str, root: Path, synced: dict) -> list[tuple[Path, str]]:
    """The runs under a box's copied folder of ``tracker`` not synced as they are now."""
    if tracker == "wandb":
        runs = sorted(p for p in (root / "wandb").glob("offline-run-*") if p.is_dir())
    elif tracker == "swanlab":
        runs = sorted(p for p in root.glob("run-*") if p.is_dir())
    else:
        return []
    out = []
    for run in runs:
        fingerprint = run_fingerprint(tracker, run)
        if fingerprint and synced.get(run.name) != fingerprint:
            out.append((run, fingerprint))
    return out


def wandb_paths_outside(run: Path) -> list[str]:
    """The paths a wandb offline run names for upload (its ``files`` records, its artifacts' local files)
    that lie outside its own folder. ``wandb sync`` (0.21.0) uploads a files record's path joined to the
    run's ``files/`` folder as it is (``sender.send_files`` -> ``dir_watcher.update_policy``, ``..`` kept):
    a run the box's train user crafted (``files`` path ``../../../../root/.ssh/id_ed25519``) would have the
    controller upload its own file to the tracker's server (tried: wandb asks the server for an upload URL
    of ``../../../../secret``). Read with wandb's own record reader."""
    from wandb.proto import wandb_internal_pb2
    from wandb.sdk.internal import datastore

    logs = [p for p in run.iterdir() if p.name.endswith(".wandb") and p.is_file()]
    if len(logs) != 1:
        return []
    inside = os.path.realpath(run) + os.sep
    files_dir = os.path.join(os.path.realpath(run), "files")
    store = datastore.DataStore()
    try:
        store.open_for_scan(str(logs[0]))
    except Exception:                       # not a wandb log: wandb's sync, with the same reader, reads none of it
        return []
    outside = []
    try:
        while True:
            try:
                data = store.scan_data()
            except Exception:               # an incomplete last block, or bytes wandb's sync cannot read past either
                break
            if data is None:
                break
            record = wandb_internal_pb2.Record()
            record.ParseFromString(data)
            kind = record.WhichOneof("record_type")
            if kind == "files":
                paths = [f.path for f in record.files.files]
            elif kind == "artifact":
                paths = [e.local_path for e in record.artifact.manifest.contents if e.local_path]
            else:
                continue
            outside += [p for p in paths if not os.path.normpath(os.path.join(files_dir, p)).startswith(inside)]
    finally:
        store.close()
    return outside


def sync_argv(tracker: str, run: Path) -> list[str]:
    """One run's sync; no key in it."""
    if tracker == "wandb":
        return [sys.executable, "-m", "wandb", "sync", "--no-sync-tensorboard", "--no-mark-synced", str(run)]
    return [sys.executable, "-m", "swanlab", "sync", str(run)]


def wandb_synced(output: str) -> bool:
    """Whether ``wandb sync``'s output says the server took the run: its address with an entity."""
    return any(m.group(1) for m in WANDB_DONE.finditer(output))


def run_timeout(run: Path) -> int:
    size, _ = _tree_bytes(run)
    return SYNC_BASE_S + SYNC_PER_MIB_S * (size >> 20)


def mlflow_words(root: Path) -> str:
    return (f"MLflow runs copied to {root}: no sync command exists; view them with "
            f"`mlflow ui --backend-store-uri file://{root}`")


def _redact(text: str, keys: dict[str, str]) -> str:
    for value in keys.values():
        if value:
            text = text.replace(value, "<key>")
    return text


def _load(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def sync_tracker(host, tracking: Tracking, tracker: str, root: Path, box: str) -> bool:
    """Sync a box's copied runs of ``tracker`` that changed since their last sync, one command each."""
    if tracker == "mlflow":
        host.log_styled(mlflow_words(root), log_func=logger.info)
        return True
    record_path = root / SYNCED
    synced = _load(record_path)
    todo = runs_to_sync(tracker, root, synced)
    if not todo:
        host.log_styled(f"verl-lab tracking: {box}'s {tracker} runs: none to sync", log_func=logger.info)
        return True
    keys = read_keys(tracking.keys_file) if tracking.keys_file else {}
    env = sync_env(tracking, tracker, keys)
    logs = root / LOGS
    logs.mkdir(exist_ok=True)
    ok = True
    for run, fingerprint in todo:
        outside = wandb_paths_outside(run) if tracker == "wandb" else []
        if outside:
            ok = False
            host.log_styled(f"verl-lab tracking: {box}'s {tracker} run {run.name} not synced: it names files outside "
                            f"its folder for upload ({', '.join(outside[:3])}); made on the box, not by verl's "
                            "tracker as it runs", fg="red", log_func=logger.error)
            continue
        argv, limit = sync_argv(tracker, run), run_timeout(run)
        try:
            res = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=limit)
            out, code = _redact(res.stdout + res.stderr, keys), res.returncode
        except subprocess.TimeoutExpired as exc:
            said = "".join(t.decode(errors="replace") if isinstance(t, bytes) else t
                           for t in (exc.stdout, exc.stderr) if t)
            out, code = _redact(said, keys) + f"\nverl-lab: stopped after {limit} s", None
        except OSError as exc:
            out, code = str(exc), None
        (logs / f"{run.name}.log").write_text(out)
        if code == 0 and tracker == "wandb" and not wandb_synced(out):
            code = "0, but the server gave the run no entity (refused?)"
        if code != 0:
            ok = False
            host.log_styled(f"verl-lab tracking: {box}'s {tracker} run {run.name} not synced "
                            f"(exit {code if code is not None else 'none'}; log {logs}/{run.name}.log): "
                            f"{out[-400:]}", fg="red", log_func=logger.error)
            continue
        synced[run.name] = fingerprint
        record_path.write_text(json.dumps(synced, indent=1, sort_keys=True))
    host.log_styled(f"verl-lab tracking: {box}'s {tracker} runs synced: {len(todo)} tried, "
                    f"{'all' if ok else 'not all'} done (logs {logs})", log_func=logger.info)
    return ok


def sync(state, host, own: LabSettings, known: dict[str, LabSettings]) -> bool:
    """At execute time, on the controller, once per run (after every box's collect): every box's cached
    offline runs, ``known`` the inventory's boxes' settings (others: ``own``'s)."""
    root = boxes_root(own)
    ok = True
    for folder in sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else []:
        settings = known.get(folder.name)
        trackers = settings.tracking.offline if settings else tuple(t for t in SYNCABLE if (folder / t).is_dir())
        tracking = (settings or own).tracking
        for tracker in trackers:
            copied = folder / tracker
            if copied.is_dir():
                ok = sync_tracker(host, tracking, tracker, copied, folder.name) and ok
    return ok


@deploy("Offline trackers' runs into the controller cache")
def collect_offline_runs(settings: LabSettings):
    from pyinfra import host

    for tracker, folder in offline_folders(settings).items():
        python.call(name=f"{tracker}'s offline runs into the controller cache", function=collect, settings=settings,
                    remote_root=folder, local_root=str(local_folder(settings, host.name, tracker)))


@deploy("Offline trackers' runs synced from the controller")
def sync_offline_runs(settings: LabSettings, known: dict[str, LabSettings]):
    python.call(name="Every box's offline runs synced with the controller's keys (each once)", function=sync,
                own=settings, known=known)
