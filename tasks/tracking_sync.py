"""Offline trackers' runs: copied from the box into the controller cache, then synced from there with the
controller's keys (deploy/tracking.py), as the relay mode does for downloads the other way.

A box without internet logs wandb, SwanLab and MLflow offline (tasks/tracking.py): wandb to
``$WANDB_DIR/wandb/offline-run-*``, SwanLab to ``$SWANLAB_LOG_DIR``, MLflow to a file store. Their folders are
copied to ``<controller_cache>/tracking/boxes/<box>/<tracker>/`` (files whose size changed) and synced:

* wandb: ``python -m wandb sync <offline-run-*>`` (wandb 0.21.0's own command; it marks a run ``.synced``
  only once the run finished, so a run still training is synced again next time);
* SwanLab: ``python -m swanlab sync <run folder>`` (swanlab 0.6.8's command);
* MLflow: has no sync command; its file store stays in the cache, to be served there
  (``mlflow ui --backend-store-uri file://...``) or exported with MLflow's own tools (printed, not run).

The keys go to the sync through its environment, read from the keys file when the command runs: never in
its argv, never printed. The controller needs the tracker's package (``pip install -e '.[trackers]'``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from pyinfra import logger
from pyinfra.api import deploy
from pyinfra.operations import python

from tasks.settings import LabSettings
from tasks.tracking import KEY_VARS, Tracking, read_keys
from tasks.tracking_hub import collect

SYNC_TIMEOUT_S = 1800


def boxes_cache(settings: LabSettings, host: str) -> Path:
    return settings.controller_cache / "tracking" / "boxes" / host


def offline_folders(settings: LabSettings) -> dict[str, str]:
    """The offline trackers' folders on the box."""
    folders = settings.tracking.folders(settings.lab_root)
    return {t: folders[t] for t in settings.tracking.offline}


def sync_env(tracking: Tracking, tracker: str, keys: dict[str, str], base: dict[str, str] | None = None) -> dict:
    """The sync's environment: the controller's, the tracker's keys and server, no offline mode."""
    env = {k: v for k, v in (os.environ if base is None else base).items()
           if k not in ("WANDB_MODE", "SWANLAB_MODE")}
    env.update({name: keys[name] for name in KEY_VARS[tracker] if name in keys})
    if tracker == "wandb" and tracking.wandb_base_url:
        env["WANDB_BASE_URL"] = tracking.wandb_base_url
    return env


def sync_commands(tracker: str, root: Path) -> list[list[str]]:
    """The commands that sync what ``root`` (a box's copied folder of ``tracker``) holds; no key in them."""
    if tracker == "wandb":
        runs = sorted(str(p) for p in (root / "wandb").glob("offline-run-*") if p.is_dir())
        return [[sys.executable, "-m", "wandb", "sync", *runs]] if runs else []
    if tracker == "swanlab":
        runs = sorted(str(p) for p in root.glob("run-*") if p.is_dir())
        return [[sys.executable, "-m", "swanlab", "sync", run] for run in runs]
    return []


def mlflow_words(root: Path) -> str:
    return (f"MLflow runs copied to {root}: no sync command exists; view them with "
            f"`mlflow ui --backend-store-uri file://{root}`")


def sync(state, host, settings: LabSettings, tracker: str, root: str) -> bool:
    """At execute time, on the controller: sync a box's copied runs of ``tracker`` (after its collect)."""
    folder = Path(root)
    if tracker == "mlflow":
        host.log_styled(mlflow_words(folder), log_func=logger.info)
        return True
    commands = sync_commands(tracker, folder)
    if not commands:
        host.log_styled(f"verl-lab tracking: no {tracker} run to sync in {folder}", log_func=logger.info)
        return True
    keys = read_keys(settings.tracking.keys_file) if settings.tracking.keys_file else {}
    env = sync_env(settings.tracking, tracker, keys)
    for argv in commands:
        try:
            res = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=SYNC_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as exc:
            host.log_styled(f"verl-lab tracking: {tracker} sync failed: {exc}", fg="red", log_func=logger.error)
            return False
        out = _redact(res.stdout + res.stderr, keys)
        (folder / f"sync-{tracker}.log").write_text(out)
        if res.returncode != 0:
            host.log_styled(f"verl-lab tracking: `{' '.join(argv[1:4])} ...` exit {res.returncode}: {out[-600:]}",
                            fg="red", log_func=logger.error)
            return False
    host.log_styled(f"verl-lab tracking: {tracker} runs of {host.name} synced ({len(commands)} command(s); "
                    f"log {folder}/sync-{tracker}.log)", log_func=logger.info)
    return True


def _redact(text: str, keys: dict[str, str]) -> str:
    for value in keys.values():
        if value:
            text = text.replace(value, "<key>")
    return text


@deploy("Offline trackers' runs into the controller cache")
def collect_offline_runs(settings: LabSettings):
    from pyinfra import host

    for tracker, folder in offline_folders(settings).items():
        python.call(name=f"{tracker}'s offline runs into the controller cache", function=collect, remote_root=folder,
                    local_root=str(boxes_cache(settings, host.name) / tracker))


@deploy("Offline trackers' runs synced from the controller")
def sync_offline_runs(settings: LabSettings):
    from pyinfra import host

    for tracker in offline_folders(settings):
        python.call(name=f"{tracker}'s runs synced with the controller's keys", function=sync, settings=settings,
                    tracker=tracker, root=str(boxes_cache(settings, host.name) / tracker))
