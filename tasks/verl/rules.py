"""verl 0.5.0's own checks of a training config, stated by the project (pure).

verl is not installed on the controller, so the checks verl makes when a run starts are restated
here and applied to every plan (``tasks.plan.make_plan``) before any host changes: a workload
verl would refuse is refused with verl's own words, naming the verl-lab setting to change.
Each rule cites the verl 0.5.0 code it restates; tests/unit/test_verl_rules.py runs that code
(verl's ``RayPPOTrainer.__init__``, the FSDP workers' ``__init__``, ``_build_rollout``'s
assert, ``vLLMRollout.__init__`` and ``HFRollout``'s chunking, in verl's own source tree) on the
same configs and checks verl refuses exactly what these rules refuse, with the same message.

The rules run in verl's order (a run stops at the first): ``RayPPOTrainer._validate_config``,
``_create_dataloader``, the workers' batch normalisation (actor, then critic), the rollout's
construction, then the HF rollout's chunking of a step and of validation.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

# The keys the rules read that a plan may leave at verl 0.5.0's default (verl/trainer/config/
# ppo_trainer.yaml and its actor/, critic/, ref/, rollout/, data/ files; _generated_ppo_trainer.yaml
# composes them). ("=", key): the default interpolates that key. tests/unit/test_verl_rules.py
# checks each against verl's composed config.
VERL_DEFAULTS: dict[str, Any] = {
    "data.train_batch_size": 1024,
    "data.gen_batch_size": None,           # read with data.get("gen_batch_size", train_batch_size)
    "data.max_prompt_length": 512,
    "data.max_response_length": 512,
    "algorithm.adv_estimator": "gae",
    "algorithm.use_kl_in_reward": False,
    "actor_rollout_ref.actor.strategy": "fsdp",
    "actor_rollout_ref.actor.use_dynamic_bsz": False,
    "actor_rollout_ref.actor.use_kl_loss": False,
    "actor_rollout_ref.actor.ppo_mini_batch_size": 256,
    "actor_rollout_ref.actor.ppo_micro_batch_size": None,
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": None,
    "actor_rollout_ref.actor.ulysses_sequence_parallel_size": 1,
    "actor_rollout_ref.actor.loss_agg_mode": "token-mean",
    "actor_rollout_ref.model.use_remove_padding": False,
    "actor_rollout_ref.ref.log_prob_micro_batch_size": None,
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": None,
    "actor_rollout_ref.ref.ulysses_sequence_parallel_size": ("=", "actor_rollout_ref.actor.ulysses_sequence_parallel_size"),
    "actor_rollout_ref.rollout.name": "vllm",
    "actor_rollout_ref.rollout.n": 1,
    "actor_rollout_ref.rollout.temperature": 1.0,
    "actor_rollout_ref.rollout.log_prob_micro_batch_size": None,
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": None,
    "actor_rollout_ref.rollout.tensor_model_parallel_size": 2,
    "actor_rollout_ref.rollout.max_num_batched_tokens": 8192,
    "actor_rollout_ref.rollout.max_model_len": None,
    "actor_rollout_ref.rollout.enable_chunked_prefill": True,
    "actor_rollout_ref.rollout.micro_batch_size": None,   # HFRollout: config.get("micro_batch_size", batch_size)
    "actor_rollout_ref.rollout.val_kwargs.do_sample": False,
    "actor_rollout_ref.rollout.val_kwargs.n": 1,
    "critic.strategy": "fsdp",
    "critic.rollout_n": ("=", "actor_rollout_ref.rollout.n"),
    "critic.use_dynamic_bsz": ("=", "actor_rollout_ref.actor.use_dynamic_bsz"),
    "critic.ppo_mini_batch_size": ("=", "actor_rollout_ref.actor.ppo_mini_batch_size"),
    "critic.ppo_micro_batch_size": None,
    "critic.ppo_micro_batch_size_per_gpu": ("=", "critic.ppo_micro_batch_size"),
    "critic.ulysses_sequence_parallel_size": 1,
    "critic.model.use_remove_padding": False,
    "reward_model.enable": False,
    "trainer.n_gpus_per_node": 8,
    "trainer.nnodes": 1,
}
# advantage estimators that make verl build a critic (RayPPOTrainer.__init__: GAE only)
CRITIC_ESTIMATORS = ("gae",)
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


class Config:
    """A plan's overrides over verl's defaults, read the way verl reads its config."""

    def __init__(self, overrides: Mapping[str, Any], model_config: Mapping[str, Any] | None = None,
                 train_rows: int | None = None, val_rows: int | None = None):
        self.overrides = dict(overrides)
        self.model_config = dict(model_config or {})
        self.train_rows, self.val_rows = train_rows, val_rows

    def __call__(self, key: str) -> Any:
        if key in self.overrides:
            return self.overrides[key]
        value = VERL_DEFAULTS[key]
        if isinstance(value, tuple) and value[:1] == ("=",):
            return self(value[1])
        return value

    @property
    def n_gpus(self) -> int:
        return self("trainer.n_gpus_per_node") * self("trainer.nnodes")

    @property
    def use_critic(self) -> bool:
        return self("algorithm.adv_estimator") in CRITIC_ESTIMATORS

    @property
    def use_reference(self) -> bool:                   # main_ppo maps Role.RefPolicy only then
        return bool(self("algorithm.use_kl_in_reward") or self("actor_rollout_ref.actor.use_kl_loss"))


@dataclass(frozen=True)
class Violation:
    rule: str            # the rule's id
    message: str         # verl's own message (or, for a bare assert, the assert's source line)
    where: str           # the verl 0.5.0 code that refuses it
    setting: str         # the verl-lab setting to change ("the plan's ...": the plan set it, not the user)
    fix: str = ""        # what to change, where a user setting is the cause

    def __str__(self) -> str:
        return f"verl 0.5.0 refuses it ({self.where}): {self.message}"


@dataclass(frozen=True)
class Rule:
    id: str
    where: str
    setting: str
    check: Callable[[Config], str | None]
    bare_assert: bool = False     # verl's assert carries no message: ``message`` is its source line
    fix: str = ""                 # str.format'd with the config's rows (train_rows)


RAY_TRAINER = "verl/trainer/ppo/ray_trainer.py"
WORKERS = "verl/workers/fsdp_workers.py"
VLLM_ROLLOUT = "verl/workers/rollout/vllm_rollout/vllm_rollout_spmd.py"
HF_CHUNK = "verl/protocol.py DataProto.chunk, from verl/workers/rollout/hf_rollout.py HFRollout.generate_sequences"


def _mutually_exclusive(section: str, param: str, mbs_key: str, per_gpu_key: str, when: Callable[[Config], bool]):
    def check(c: Config) -> str | None:
        if not when(c):
            return None
        mbs, per_gpu = c(mbs_key), c(per_gpu_key)
        if mbs is None and per_gpu is None:
            return f"[{section}] Please set at least one of '{section}.{param}' or '{section}.{param}_per_gpu'."
        if mbs is not None and per_gpu is not None:
            return (f"[{section}] You have set both '{section}.{param}' AND '{section}.{param}_per_gpu'. Please "
                    f"remove '{section}.{param}' because only '*_{param}_per_gpu' is supported (the former is "
                    "deprecated).")
        return None
    return check


def _assert(condition: Callable[[Config], bool | None], source: str):
    return lambda c: None if condition(c) is not False else source


def _normalised_mini(c: Config, role: str) -> int:
    """The per-GPU mini-batch a worker makes (ppo_mini_batch_size *= n; //= world // sp)."""
    if role == "actor":
        mini, n = c("actor_rollout_ref.actor.ppo_mini_batch_size"), c("actor_rollout_ref.rollout.n")
        sp = c("actor_rollout_ref.actor.ulysses_sequence_parallel_size")
    else:
        mini, n, sp = c("critic.ppo_mini_batch_size"), c("critic.rollout_n"), c("critic.ulysses_sequence_parallel_size")
    return mini * n // (c.n_gpus // sp)


def _micro_per_gpu(c: Config, role: str) -> int | None:
    prefix = "actor_rollout_ref.actor" if role == "actor" else "critic"
    sp = c(f"{prefix}.ulysses_sequence_parallel_size")
    micro = c(f"{prefix}.ppo_micro_batch_size")
    return micro // (c.n_gpus // sp) if micro is not None else c(f"{prefix}.ppo_micro_batch_size_per_gpu")


def _divisible(role: str):
    def check(c: Config) -> str | None:
        if role == "critic" and not c.use_critic:
            return None
        mini, micro = _normalised_mini(c, role), _micro_per_gpu(c, role)
        if micro is None:
            return None
        if micro == 0:
            return "integer modulo by zero"
        if mini % micro:
            return f"normalized ppo_mini_batch_size {mini} should be divisible by ppo_micro_batch_size_per_gpu {micro}"
        if mini // micro <= 0:
            return f"normalized ppo_mini_batch_size {mini} should be larger than ppo_micro_batch_size_per_gpu {micro}"
        return None
    return check


def _hf_chunks(what: str):
    """HFRollout.generate_sequences: batch // micro_batch_size equal chunks of a DataProto (its
    chunk() asserts they are equal); a rank's share of a step, and of validation (padded to the
    GPU count by RayPPOTrainer._validate)."""
    def check(c: Config) -> str | None:
        if c("actor_rollout_ref.rollout.name") != "hf":
            return None
        if what == "train":
            rows = c("data.train_batch_size") * c("actor_rollout_ref.rollout.n") // c.n_gpus
        else:
            if c.val_rows is None:
                return None
            rows = -(-c.val_rows * c("actor_rollout_ref.rollout.val_kwargs.n") // c.n_gpus)
        micro = c("actor_rollout_ref.rollout.micro_batch_size") or rows
        chunks = max(rows // micro, 1)
        if rows % chunks:
            return f"only support equal chunk. Got size of DataProto {rows} and chunk {chunks}."
        return None
    return check


def _context(c: Config) -> str | None:
    if c("actor_rollout_ref.rollout.name") != "vllm" or not c.model_config:
        return None
    total = c("data.max_prompt_length") + c("data.max_response_length")
    scaling = c.model_config.get("rope_scaling")
    if not scaling:
        if c.model_config.get("max_position_embeddings") is None:
            return "max_position_embeddings not found in model_hf_config"
        if c.model_config["max_position_embeddings"] < total:
            return "model context length should be greater than total sequence length"
        return None
    factor = scaling.get("factor", 1.0)
    if c.model_config["max_position_embeddings"] * factor < total:
        return ("model context length should be greater than total sequence length, got rope_scaling_factor="
                f"{factor} and max_position_embeddings={c.model_config['max_position_embeddings']}")
    return None


def _chunked_prefill(c: Config) -> str | None:
    if c("actor_rollout_ref.rollout.name") != "vllm":
        return None
    max_model_len = int(c("actor_rollout_ref.rollout.max_model_len")
                        or c("data.max_prompt_length") + c("data.max_response_length"))
    if c("actor_rollout_ref.rollout.max_num_batched_tokens") < max_model_len and \
            c("actor_rollout_ref.rollout.enable_chunked_prefill"):
        return ("Enable chunked prefill, max_num_batched_tokens is smaller than max_model_len, "
                "                             please increase max_num_batched_tokens or disable chunked prefill")
    return None


def _tp_divides(c: Config) -> str | None:
    tp = c("actor_rollout_ref.rollout.tensor_model_parallel_size")
    if c.n_gpus % tp:
        return f"rollout world_size: {c.n_gpus} is not divisible by infer_tp: {tp}"
    return None


def _not_dynamic(prefix: str) -> Callable[[Config], bool]:
    return lambda c: not c(f"{prefix}.use_dynamic_bsz")


RULES: tuple[Rule, ...] = (
    # RayPPOTrainer._validate_config, in its order
    Rule("minimal-batch", f"{RAY_TRAINER} _validate_config", "the plan's train_batch_size",
         lambda c: None if c("data.train_batch_size") * c("actor_rollout_ref.rollout.n") % c.n_gpus == 0 else
         f"real_train_batch_size ({c('data.train_batch_size') * c('actor_rollout_ref.rollout.n')}) must be divisible "
         f"by minimal possible batch size ({c.n_gpus})"),
    Rule("actor-micro-batch-set", f"{RAY_TRAINER} _validate_config", "the plan's micro-batches",
         _mutually_exclusive("actor_rollout_ref.actor", "micro_batch_size", "actor_rollout_ref.actor.ppo_micro_batch_size",
                             "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", _not_dynamic("actor_rollout_ref.actor"))),
    Rule("ref-micro-batch-set", f"{RAY_TRAINER} _validate_config", "the plan's micro-batches",
         _mutually_exclusive("actor_rollout_ref.ref", "log_prob_micro_batch_size",
                             "actor_rollout_ref.ref.log_prob_micro_batch_size",
                             "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu",
                             lambda c: _not_dynamic("actor_rollout_ref.actor")(c) and c.use_reference)),
    Rule("rollout-micro-batch-set", f"{RAY_TRAINER} _validate_config", "the plan's micro-batches",
         _mutually_exclusive("actor_rollout_ref.rollout", "log_prob_micro_batch_size",
                             "actor_rollout_ref.rollout.log_prob_micro_batch_size",
                             "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",
                             _not_dynamic("actor_rollout_ref.actor"))),
    Rule("critic-micro-batch-set", f"{RAY_TRAINER} _validate_config", "the plan's micro-batches",
         _mutually_exclusive("critic", "micro_batch_size", "critic.ppo_micro_batch_size",
                             "critic.ppo_micro_batch_size_per_gpu",
                             lambda c: c.use_critic and _not_dynamic("critic")(c))),
    Rule("actor-mini-batch-size", f"{RAY_TRAINER} _validate_config", "workload.ppo_mini_batch_size",
         _assert(lambda c: c("actor_rollout_ref.actor.use_dynamic_bsz")
                 or c("data.train_batch_size") >= c("actor_rollout_ref.actor.ppo_mini_batch_size"),
                 "assert config.data.train_batch_size >= config.actor_rollout_ref.actor.ppo_mini_batch_size"),
         bare_assert=True, fix="make workload.ppo_mini_batch_size at most workload.train_batch_size"),
    Rule("loss-agg-mode", f"{RAY_TRAINER} _validate_config", "the plan",
         lambda c: None if c("actor_rollout_ref.actor.loss_agg_mode") in LOSS_AGG_MODES else
         f"Invalid loss_agg_mode: {c('actor_rollout_ref.actor.loss_agg_mode')}"),
    Rule("critic-mini-batch-size", f"{RAY_TRAINER} _validate_config", "workload.ppo_mini_batch_size",
         _assert(lambda c: not c.use_critic or c("critic.use_dynamic_bsz")
                 or c("data.train_batch_size") >= c("critic.ppo_mini_batch_size"),
                 "assert config.data.train_batch_size >= config.critic.ppo_mini_batch_size"),
         bare_assert=True, fix="make workload.ppo_mini_batch_size at most workload.train_batch_size"),
    Rule("validation-temperature", f"{RAY_TRAINER} _validate_config", "the plan",
         lambda c: None if not c("actor_rollout_ref.rollout.val_kwargs.do_sample")
         or c("actor_rollout_ref.rollout.temperature") > 0 else
         "validation gen temperature should be greater than 0 when enabling do_sample"),
    # RayPPOTrainer._create_dataloader (drop_last=True: a step needs a whole batch of prompts)
    Rule("train-dataloader", f"{RAY_TRAINER} _create_dataloader", "workload.train_batch_size",
         lambda c: None if c.train_rows is None or c.train_rows // (c("data.gen_batch_size") or c("data.train_batch_size"))
         >= 1 else "Train dataloader is empty!",
         fix="make workload.train_batch_size at most the train split's {train_rows} prompts (a step takes that many "
             "whole prompts; a GRPO rung takes a quarter of it)"),
    # the workers' __init__: ActorRolloutRefWorker (actor), then CriticWorker
    Rule("actor-normalised-mini-batch", f"{WORKERS} ActorRolloutRefWorker.__init__", "workload.ppo_mini_batch_size",
         lambda c: None if _normalised_mini(c, "actor") > 0 else
         f"ppo_mini_batch_size {_normalised_mini(c, 'actor')} should be larger than 0 after normalization",
         fix="make workload.ppo_mini_batch_size at least the number of GPUs"),
    Rule("actor-micro-divides-mini", f"{WORKERS} ActorRolloutRefWorker.__init__", "workload.ppo_mini_batch_size",
         _divisible("actor")),
    Rule("critic-micro-divides-mini", f"{WORKERS} CriticWorker.__init__", "workload.ppo_mini_batch_size",
         _divisible("critic")),
    # the rollout, built in init_model
    Rule("rollout-tp-divides-world", f"{WORKERS} ActorRolloutRefWorker._build_rollout", "the plan's rollout_tp",
         _tp_divides),
    Rule("vllm-context-length", f"{VLLM_ROLLOUT} vLLMRollout.__init__", "workload.max_response_length", _context,
         fix="make workload.max_prompt_length + workload.max_response_length at most the model's context "
             "(max_position_embeddings of its config.json), or train a model with a longer one"),
    Rule("vllm-chunked-prefill", f"{VLLM_ROLLOUT} vLLMRollout.__init__", "the plan's max_num_batched_tokens",
         _chunked_prefill),
    # HFRollout.generate_sequences at each step, and in validation
    Rule("hf-rollout-chunks", HF_CHUNK,
         "the plan's rollout micro-batch", _hf_chunks("train")),
    Rule("hf-rollout-validation-chunks", HF_CHUNK,
         "the plan's rollout micro-batch", _hf_chunks("validation")),
)


def violations(overrides: Mapping[str, Any], model_config: Mapping[str, Any] | None = None,
               train_rows: int | None = None, val_rows: int | None = None) -> list[Violation]:
    """Every rule the config breaks, in the order verl checks them (a run stops at the first)."""
    c = Config(overrides, model_config, train_rows, val_rows)
    found = []
    for rule in RULES:
        message = rule.check(c)
        if message:
            found.append(Violation(rule.id, message, rule.where, rule.setting, rule.fix.format(train_rows=train_rows)))
    return found
