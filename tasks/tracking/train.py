"""What the training stage places for verl's trackers (pure; tasks/train.py turns it into files).

* the trackers' folders under ``<lab_root>/tracking`` (the train user's, 0750), which the unit may write
  (its ``ReadWritePaths``);
* the non-secret environment (``TENSORBOARD_DIR``, ``WANDB_MODE``, ...) rendered into ``train.env``;
* the keys of an online run, in ``<train_dir>/tracking-keys.env``: owned by the train user, mode 0400, read
  by systemd as a second ``EnvironmentFile`` (so they reach verl's process environment, never its argv, a
  log, plan.json or train.env, which is 0640), placed by an operation that prints none of its bytes (not
  ``files.put``, whose ``--diff`` prints them: tasks/placed.py ``secret_file``). An offline run gets no key:
  the controller syncs it; nor does a Ray cluster's worker: verl's trackers run on the head alone.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from pathlib import Path

from tasks.placed import Wanted, wanted_dir, wanted_file
from tasks.tracking.setting import Tracking, read_keys

KEYS_FILE = "tracking-keys.env"


def tracking_root(lab_root: str) -> str:
    return f"{lab_root}/tracking"


def run_name_of(overrides) -> str:
    """The trackers' run name: the plan's ``trainer.experiment_name``."""
    return next(o.value for o in overrides if o.key == "trainer.experiment_name")


def keys_for_box(tracking: Tracking, worker: bool = False) -> dict[str, str]:
    """The keys the box gets (read from the controller's keys file; only an online run needs them, and
    not on a Ray cluster's ``worker``: verl makes its trackers in the TaskRunner, on the head)."""
    if not tracking.online or tracking.keys_file is None or worker:
        return {}
    return tracking.keys_on_box(read_keys(Path(tracking.keys_file)))


def keys_text(keys: Mapping[str, str]) -> str:
    return "".join(f"{name}={value}\n" for name, value in sorted(keys.items()))


def keys_digest(keys: Mapping[str, str]) -> str:
    """Changes when a key changes (the unit then restarts with it); the keys themselves never leave
    the keys file."""
    return hashlib.sha256(keys_text(keys).encode()).hexdigest()[:16] if keys else ""


def tracking_values(tracking: Tracking, lab_root: str, train_dir: str, run_name: str,
                    keys: Mapping[str, str]) -> dict:
    """The template values: train.env's tracker environment, the unit's keys file and writable folders."""
    folders = tracking.folders(lab_root)
    return {
        "tracking_env": tracking.environment(lab_root, run_name),
        "tracking_keys_file": f"{train_dir}/{KEYS_FILE}" if keys else None,
        "tracking_keys_digest": keys_digest(keys),
        "tracking_paths": [tracking_root(lab_root)] if folders else [],
    }


def box_gets_keys(tracking: Tracking) -> bool:
    """Known from the settings alone (the names the keys file holds): whether the box gets a keys file."""
    return bool(tracking.online and tracking.keys_on_box(dict.fromkeys(tracking.key_names, "")))


def tracking_paths(lab_root: str, train_dir: str, tracking: Tracking) -> list[str]:
    """The paths ``tracking_wanted`` places (asked in the stage's one bundle, before the plan)."""
    folders = tracking.folders(lab_root)
    return ([tracking_root(lab_root), *folders.values()] if folders else []) + \
        ([f"{train_dir}/{KEYS_FILE}"] if box_gets_keys(tracking) else [])


def tracking_wanted(tracking: Tracking, lab_root: str, train_dir: str, user: str,
                    keys: Mapping[str, str]) -> list[Wanted]:
    folders = tracking.folders(lab_root)
    if not folders:
        return []
    # the trackers' parent is root's (the train user reads it, writes only its own folders inside): root places
    # those folders (mkdir, chmod, chown) by names the train user cannot swap for links (docs/architecture.md,
    # "Security", rule a)
    out = [wanted_dir(tracking_root(lab_root), "Trackers' folder (root's; each tracker's inside is the train user's)",
                      mode="750", user="root", group=user)]
    out += [wanted_dir(path, f"{name} folder", mode="750", user=user, group=user) for name, path in folders.items()]
    if keys:
        # secret: placed by an operation whose bytes pyinfra never prints (files.put's --diff would)
        out.append(wanted_file(f"{train_dir}/{KEYS_FILE}", "Tracker keys (the train user's alone)", keys_text(keys),
                               mode="400", user=user, group=user, secret=True))
    return out
