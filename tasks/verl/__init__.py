"""verl 0.5.0 as the lab pins it: its config, its own checks restated, and its source on the box.

* ``config.py``: what verl 0.5.0's Hydra config accepts, as data: the plan's ``Override`` objects turned into
  Hydra override strings (``override_lines``), the keys not in the base config and the dead ones (pure);
* ``rules.py``: verl 0.5.0's own checks of a training config, restated with the code each cites
  (``violations``, ``RULES``), applied to every plan before any host changes (pure);
* ``source.py``: the env stage's verl source: the pinned tag cloned and patched with files/patches/verl-0.5.0/
  (its operations and ``@deploy``, ``verl_source``, run by tasks/env.py), imported by its path, never here:
  no module below the stages imports a stage, and this ``__init__`` runs whenever any module of the folder is
  imported.

Every public name of ``config`` and ``rules`` is handed on here.
"""

from __future__ import annotations

from tasks.verl.config import ADDED_KEYS, CONFIG_NAME, DEAD_KEYS, VERL_VERSION, Override, format_value, override_lines
from tasks.verl.rules import (
    CRITIC_ESTIMATORS,
    HF_CHUNK,
    LOSS_AGG_MODES,
    RAY_TRAINER,
    RULES,
    VERL_DEFAULTS,
    VLLM_ROLLOUT,
    WORKERS,
    Config,
    Rule,
    Violation,
    violations,
)

__all__ = [
    "ADDED_KEYS", "CONFIG_NAME", "DEAD_KEYS", "VERL_VERSION", "Override", "format_value", "override_lines",
    "CRITIC_ESTIMATORS", "HF_CHUNK", "LOSS_AGG_MODES", "RAY_TRAINER", "RULES", "VERL_DEFAULTS", "VLLM_ROLLOUT",
    "WORKERS", "Config", "Rule", "Violation", "violations",
]
