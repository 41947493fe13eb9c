"""Host settings: the inventory's data for one box, checked and given defaults (pure), and the clusters across
hosts. A bad value is refused with the host, the key, the value and the fix, before any host changes.

What the folder decides, one module a decision, each importing only those above it:

* ``errors.py``: how a bad value is told (``SettingsError``, ``SettingsErrors``, ``Problems`` collecting every
  checker's, ``did_you_mean``);
* ``catalog.py``: ``catalog_overrides``, the mirrors and the artifact names, against files/catalog.toml;
* ``cluster.py``: the ``cluster`` setting of a box, and the clusters across hosts (``Cluster``,
  ``check_clusters``, run by tasks/hostdata.py);
* ``keys.py``: which keys of a host's data are read, and what is said of every other one (``unread_keys``);
* ``workload.py``: the ``workload`` setting, ``workload.model`` and ``gpu_override``: the plan's inputs;
* ``load.py``: ``LabSettings``, every default, the units' names, and ``load_settings``, which runs every
  checker (the tracking setting's too: tasks/tracking/setting.py) and raises what they found.

Callers import from ``tasks.settings``: every public name of its modules is handed on here.
"""

from __future__ import annotations

from tasks.settings.cluster import CLUSTER_EXAMPLE, CLUSTER_KEYS, CLUSTER_NAME_RE, Cluster, check_clusters, ipv4
from tasks.settings.errors import Problems, SettingsError, SettingsErrors, did_you_mean
from tasks.settings.keys import (
    DEPLOY_KEYS,
    DOTTED_EXAMPLE,
    NEAR_MISS_CUTOFF,
    PYINFRA_KEY_PREFIXES,
    PYINFRA_KEYS,
    SITE_PREFIX,
    expand_dotted,
    is_read_elsewhere,
    nested_keys,
    unread_keys,
)
from tasks.settings.load import (
    ARTIFACT_MODES,
    CHECKPOINT_DEFAULTS,
    DEFAULTS,
    DRIVER_BUSY,
    DRIVER_MODES,
    ENV_BACKENDS,
    KNOWN_KEYS,
    LEGACY_STAGE_NAMES,
    NESTED,
    RAY_UNIT,
    TRAIN_UNIT,
    UNIT_STATES,
    USER_RE,
    LabSettings,
    host_keys,
    load_settings,
)
from tasks.settings.workload import (
    GPU_OVERRIDE_KEYS,
    LORA_MODULES,
    WORKLOAD_ALGORITHMS,
    WORKLOAD_DEFAULTS,
    WORKLOAD_FINETUNES,
    WORKLOAD_ROLLOUTS,
    WORKLOAD_WORDS,
)

__all__ = [
    "Problems", "SettingsError", "SettingsErrors", "did_you_mean", "CLUSTER_EXAMPLE", "CLUSTER_KEYS", "CLUSTER_NAME_RE",
    "Cluster", "check_clusters", "ipv4", "DEPLOY_KEYS", "DOTTED_EXAMPLE", "NEAR_MISS_CUTOFF", "PYINFRA_KEYS",
    "PYINFRA_KEY_PREFIXES", "SITE_PREFIX", "expand_dotted", "is_read_elsewhere", "nested_keys", "unread_keys",
    "GPU_OVERRIDE_KEYS", "LORA_MODULES", "WORKLOAD_ALGORITHMS", "WORKLOAD_DEFAULTS", "WORKLOAD_FINETUNES",
    "WORKLOAD_ROLLOUTS", "WORKLOAD_WORDS", "ARTIFACT_MODES", "CHECKPOINT_DEFAULTS", "DEFAULTS", "DRIVER_BUSY",
    "DRIVER_MODES", "ENV_BACKENDS", "KNOWN_KEYS", "LEGACY_STAGE_NAMES", "NESTED", "RAY_UNIT", "TRAIN_UNIT",
    "UNIT_STATES", "USER_RE", "LabSettings", "host_keys", "load_settings",
]
