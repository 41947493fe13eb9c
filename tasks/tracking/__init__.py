"""Training curves and trackers (docs/tracking.md): which of verl 0.5.0's trackers a box's run logs to, what
the train stage places for them, and the lab's TensorBoard on one hub box, filled through the controller.

What the folder decides, one module a decision:

* ``setting.py``: the ``tracking`` setting (``Tracking``, ``check_tracking``; checked by tasks/settings/ with
  every other setting) and the trackers' keys (``read_keys``);
* ``events.py``: the lab's own scalars beside verl's (GSM8K scores, the predicted and measured peak) as a
  TensorBoard event file (pure);
* ``train.py``: what the train stage places for the trackers: their folders, the environment, the keys file
  (``tracking_wanted``; tasks/train.py turns it into files);
* the stages, each a ``@deploy`` run by deploy/tracking.py and imported by its path, never here (no module
  below the stages imports a stage, and this ``__init__`` runs whenever any module of the folder is
  imported): ``copy.py`` (the copy's programs placed; ``collect`` and ``push`` at execute time), ``hub.py``
  (the hub's served folder and its TensorBoard unit: ``install_tracking_hub``) and ``sync.py`` (offline
  wandb, SwanLab and MLflow runs synced from the controller).

The box's side is verl_lab_box/tracking_copy.py and tracking_apply.py. Every public name of ``setting``,
``events`` and ``train`` is handed on here.
"""

from __future__ import annotations

from tasks.tracking.events import (
    MEASURED_TAG,
    PREDICTED_TAG,
    SCORE_TAG,
    TAG_PREFIX,
    TEXT_TAG,
    crc32c,
    masked_crc,
    record,
    scalar_value,
    summary_digest,
    summary_events,
    summary_file_name,
    summary_points,
    summary_text,
    text_value,
)
from tasks.tracking.setting import (
    DEFAULTS,
    EXAMPLE,
    EXTRA_PACKAGES,
    KEY_VARS,
    MODES,
    REMOTE,
    REQUIRED_KEY,
    TENSORBOARD_PORT,
    TRACKERS,
    VERL_BACKENDS,
    Tracking,
    TrackingProblems,
    check_tracking,
    read_keys,
    run_name,
)
from tasks.tracking.train import (
    KEYS_FILE,
    box_gets_keys,
    keys_digest,
    keys_for_box,
    keys_text,
    run_name_of,
    tracking_paths,
    tracking_root,
    tracking_values,
    tracking_wanted,
)

__all__ = [
    "DEFAULTS", "EXAMPLE", "EXTRA_PACKAGES", "KEY_VARS", "MODES", "REMOTE", "REQUIRED_KEY", "TENSORBOARD_PORT",
    "TRACKERS", "VERL_BACKENDS", "Tracking", "TrackingProblems", "check_tracking", "read_keys", "run_name",
    "MEASURED_TAG", "PREDICTED_TAG", "SCORE_TAG", "TAG_PREFIX", "TEXT_TAG", "crc32c", "masked_crc", "record",
    "scalar_value", "summary_digest", "summary_events", "summary_file_name", "summary_points", "summary_text",
    "text_value", "KEYS_FILE", "box_gets_keys", "keys_digest", "keys_for_box", "keys_text", "run_name_of",
    "tracking_paths", "tracking_root", "tracking_values", "tracking_wanted",
]
