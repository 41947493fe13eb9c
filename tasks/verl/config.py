"""What verl 0.5.0's Hydra config (``verl/trainer/config/ppo_trainer.yaml``) accepts, as data.

Pure. The training plan speaks in ``Override`` objects; this module turns them into Hydra
override strings and knows which keys are not in the base config (they need ``+`` and are
read by verl with ``.get()`` under a parent that is), and which keys look right but are dead.

The unit tests compose every plan with verl 0.5.0's own config files (from its PyPI wheel),
so a key that is not real fails there, not on a GPU box.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

VERL_VERSION = "0.5.0"
CONFIG_NAME = "ppo_trainer"

# Keys absent from the base config that verl 0.5.0 reads (each needs a leading "+"), mapped
# to the base-config node verl reads them from. The anchor must exist in the composed config.
ADDED_KEYS: dict[str, str] = {
    # update_model_config(actor config, override_config) -> config attribute
    "actor_rollout_ref.model.override_config._attn_implementation": "actor_rollout_ref.model.override_config",
    # the critic's override_config, read by the project's verl patch for the attention choice
    "critic.model.override_config._attn_implementation": "critic.model.override_config",
    # fsdp_config.get("mixed_precision") / fsdp_config.get("model_dtype") in fsdp_workers.py
    **{f"{role}.fsdp_config.mixed_precision.{field}": f"{role}.fsdp_config"
       for role in ("actor_rollout_ref.actor", "actor_rollout_ref.ref", "critic.model")
       for field in ("param_dtype", "reduce_dtype", "buffer_dtype")},
    **{f"{role}.fsdp_config.model_dtype": f"{role}.fsdp_config"
       for role in ("actor_rollout_ref.actor", "actor_rollout_ref.ref", "critic.model")},
    # every key under engine_kwargs.vllm is passed to vllm.LLM(...)
    "actor_rollout_ref.rollout.engine_kwargs.vllm.max_num_seqs": "actor_rollout_ref.rollout.engine_kwargs.vllm",
    # HFRollout reads config.get("micro_batch_size", batch_size)
    "actor_rollout_ref.rollout.micro_batch_size": "actor_rollout_ref.rollout",
    # the project's patches 0007-0008: HFRollout reads config.get("gather_once"), DataParallelPPOActor its
    # config's fsdp_config.get("gather_once") / .get("accumulate_grads_unsharded")
    "actor_rollout_ref.rollout.gather_once": "actor_rollout_ref.rollout",
    **{f"actor_rollout_ref.{role}.fsdp_config.gather_once": f"actor_rollout_ref.{role}.fsdp_config"
       for role in ("actor", "ref")},
    "actor_rollout_ref.actor.fsdp_config.accumulate_grads_unsharded": "actor_rollout_ref.actor.fsdp_config",
    # the project's patch 0009: fsdp_workers builds the actor's AdamW with fused=True on optim_config.get("fused")
    "actor_rollout_ref.actor.optim.fused": "actor_rollout_ref.actor.optim",
}

# Keys that exist (or can be created) but do nothing in 0.5.0: a plan must never emit them.
DEAD_KEYS: dict[str, str] = {
    "actor_rollout_ref.fsdp_config.cpu_offload": "not a verl key; offload is actor_rollout_ref.actor.fsdp_config.param_offload / optimizer_offload",
    "actor_rollout_ref.fsdp_config.offload_params": "not a verl key; use actor_rollout_ref.actor.fsdp_config.param_offload",
    "actor_rollout_ref.rollout.max_num_seqs": "never passed to vLLM in 0.5.0; use +actor_rollout_ref.rollout.engine_kwargs.vllm.max_num_seqs",
}

# Hydra's unquoted value grammar; anything else gets single quotes.
_PLAIN = re.compile(r"^[A-Za-z0-9_./\-+@:]+$")


def format_value(value: Any) -> str:
    """A Python value as a Hydra override value (True/False, numbers, ['a','b'], strings)."""
    if isinstance(value, bool):
        return "True" if value else "False"
    if value is None:
        return "null"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(format_value(v) if not isinstance(v, str) else _quoted(v) for v in value) + "]"
    text = str(value)
    if _PLAIN.match(text) and text.lower() not in ("true", "false", "null", "none"):
        return text
    return _quoted(text)


def _quoted(text: str) -> str:
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


@dataclass(frozen=True)
class Override:
    """One Hydra override with the reason the plan set it."""

    key: str
    value: Any
    why: str

    def __post_init__(self):
        if self.key in DEAD_KEYS:
            raise ValueError(f"{self.key} does nothing in verl {VERL_VERSION}: {DEAD_KEYS[self.key]}")
        if self.key.startswith(("+", "~")):
            raise ValueError(f"{self.key}: give the bare key; the '+' is added from ADDED_KEYS")

    @property
    def added(self) -> bool:
        """True when the key is not in the base config and needs a leading '+'."""
        return self.key in ADDED_KEYS

    @property
    def anchor(self) -> str | None:
        return ADDED_KEYS.get(self.key)

    def text(self) -> str:
        return ("+" if self.added else "") + f"{self.key}={format_value(self.value)}"


def override_lines(overrides: list[Override]) -> list[str]:
    keys = [o.key for o in overrides]
    dupes = sorted({k for k in keys if keys.count(k) > 1})
    if dupes:
        raise ValueError(f"the plan sets these keys twice: {', '.join(dupes)}")
    return [o.text() for o in overrides]
