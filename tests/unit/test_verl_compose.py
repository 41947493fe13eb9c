"""Every override the plan generates, composed by verl 0.5.0's own Hydra config.

The config files come from verl's PyPI wheel (``pip download verl==0.5.0 --no-deps``, cached
under ~/.cache/verl-lab-test/verl-0.5.0). A key that is not in the config fails the compose;
a value that lands elsewhere fails the per-key comparison; a ``+`` key must hang under a node
verl really reads.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

hydra = pytest.importorskip("hydra", reason="hydra-core is in the test extra")
from hydra import compose, initialize_config_dir  # noqa: E402
from hydra.errors import ConfigCompositionException  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from tasks.plan import DOC_GPUS, DOC_MIXED, GpuTarget, PlanError, make_plan  # noqa: E402
from tasks.verl import ADDED_KEYS, CONFIG_NAME, VERL_VERSION  # noqa: E402
from tests.lab.cachelock import locked  # noqa: E402
from tests.unit.test_plan import QWEN_3B, workload  # noqa: E402

CACHE = Path(os.environ.get("VERL_LAB_TEST_CACHE", Path.home() / ".cache" / "verl-lab-test")) / f"verl-{VERL_VERSION}"


@pytest.fixture(scope="session")
def verl_config_dir() -> Path:
    config_dir = CACHE / "verl" / "trainer" / "config"
    with locked(CACHE.with_name(CACHE.name + ".lock")):     # other runs and xdist workers share the cache
        if not (config_dir / f"{CONFIG_NAME}.yaml").is_file():
            _unpack_verl_config()
    assert (config_dir / f"{CONFIG_NAME}.yaml").is_file()
    return config_dir


def _unpack_verl_config() -> None:
    dl = CACHE / "download"
    dl.mkdir(parents=True, exist_ok=True)
    if not list(dl.glob("verl-*")):
        out = subprocess.run([sys.executable, "-m", "pip", "download", f"verl=={VERL_VERSION}", "--no-deps",
                              "--only-binary", ":all:", "-d", str(dl)], capture_output=True, text=True)
        if out.returncode != 0:
            pytest.fail(f"cannot download verl {VERL_VERSION} from PyPI:\n{out.stderr[-2000:]}")
    (wheel,) = dl.glob("verl-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        for member in zf.namelist():
            if member.startswith("verl/trainer/config/"):
                zf.extract(member, CACHE)


def _compose(config_dir: Path, overrides: list[str]):
    with initialize_config_dir(config_dir=str(config_dir), version_base=None):
        return compose(config_name=CONFIG_NAME, overrides=overrides)


@pytest.fixture(scope="session")
def base_config(verl_config_dir):
    return _compose(verl_config_dir, [])


_MISSING = object()


def _plans():
    """Every GPU of docs/plan.md's table that gets a plan with the default workload (on the rung it
    lands on; the others are test_plan.py's DOES_NOT_FIT), and each rung and batch rule forced on
    a few: (label, gpu, workload changes)."""
    cases = [(f"{count} x {name}", GpuTarget(name, cc, mem, count), {}) for name, cc, mem, count in DOC_GPUS]
    p40, t4 = GpuTarget("Tesla P40", "6.1", 24576), GpuTarget("Tesla T4", "7.5", 15360)
    rtx3090 = ("NVIDIA GeForce RTX 3090", "8.6", 24576)
    cases += [
        ("A100 flash-attn", GpuTarget("NVIDIA A100-SXM4-80GB", "8.0", 81920), {"flash_attn_installed": True}),
        ("4x3090 with KL", GpuTarget(*rtx3090, 4), {"use_kl_loss": True}),
        ("3x3090 rounded batches", GpuTarget(*rtx3090, 3), {}),
        ("3x3090 GRPO", GpuTarget(*rtx3090, 3), {"algorithm": "grpo"}),
        ("P40 long run", p40, {"total_training_steps": 500}),
        ("P40 one epoch", p40, {"total_training_steps": None}),
        ("P40 GRPO (HF rollout, n=4)", p40, {"algorithm": "grpo"}),
        ("4xP40 GRPO", GpuTarget("Tesla P40", "6.1", 24576, 4), {"algorithm": "grpo"}),
        ("T4 GRPO", t4, {"algorithm": "grpo"}),
        ("T4 GRPO 128-token responses", t4, {"algorithm": "grpo", "max_response_length": 128}),
        ("P40 + RTX 3090 box (mixed)", DOC_MIXED, {}),
        ("2 x RTX 4060, a 3B model (vLLM TP 2)", GpuTarget("NVIDIA GeForce RTX 4060", "8.9", 8188, 2),
         {"model_config": QWEN_3B}),
        # LoRA (tasks/plan/lora.py); the 8-12 GB cards above get grpo-lora by default
        ("P40 PPO with LoRA (HF rollout, the critic full)", p40, {"finetune": "lora"}),
        ("RTX 3090 PPO with LoRA (vLLM)", GpuTarget(*rtx3090), {"finetune": "lora"}),
        ("2 x RTX 3060 GRPO with LoRA (vLLM, layered summon)", GpuTarget("NVIDIA GeForce RTX 3060", "8.6", 12288, 2),
         {"finetune": "lora", "algorithm": "grpo"}),
        ("RTX 3060 LoRA on q_proj and v_proj", GpuTarget("NVIDIA GeForce RTX 3060", "8.6", 12288),
         {"finetune": "lora", "target_modules": ("q_proj", "v_proj")}),
        ("RTX 3090, the 3B with LoRA", GpuTarget(*rtx3090), {"finetune": "lora", "model_config": QWEN_3B}),
    ]
    return [case for case in cases if _plan(case) is not None]


def _plan(case):
    try:
        return make_plan(case[1], workload(**case[2]))
    except PlanError:
        return None


@pytest.mark.parametrize("label,gpu,extra", _plans(), ids=[c[0] for c in _plans()])
def test_plan_composes_with_verl_config(verl_config_dir, base_config, label, gpu, extra):
    plan = make_plan(gpu, workload(**extra))
    lines = plan.override_lines
    assert not any(line.startswith("++") for line in lines), "'++' silently creates dead keys"
    cfg = _compose(verl_config_dir, lines)
    for o in plan.overrides:
        got = OmegaConf.select(cfg, o.key, default=_MISSING)
        assert got is not _MISSING, f"{o.key} is not in the composed config"
        if OmegaConf.is_config(got):
            got = OmegaConf.to_container(got)
        want = list(o.value) if isinstance(o.value, tuple) else o.value
        assert got == want and type(got) is type(want), f"{o.key}: composed {got!r}, planned {want!r}"
        in_base = OmegaConf.select(base_config, o.key, default=_MISSING) is not _MISSING
        if o.added:
            assert not in_base, f"{o.key} is in the base config: it needs no '+'"
            anchor = OmegaConf.select(base_config, o.anchor, default=_MISSING)
            assert anchor is not _MISSING and OmegaConf.is_dict(anchor), \
                f"+{o.key}: its parent {o.anchor} is not a node of verl {VERL_VERSION}'s config"
        else:
            assert in_base, f"{o.key} is not a verl {VERL_VERSION} key"
    # the whole config still resolves (interpolations such as critic.ppo_mini_batch_size)
    resolved = OmegaConf.to_container(cfg, resolve=True)
    planned = {o.key: o.value for o in plan.overrides}
    assert resolved["critic"]["ppo_mini_batch_size"] == planned["actor_rollout_ref.actor.ppo_mini_batch_size"]
    assert resolved["critic"]["rollout_n"] == planned["actor_rollout_ref.rollout.n"]
    assert resolved["critic"]["model"]["tokenizer_path"] == planned["actor_rollout_ref.model.path"]
    assert resolved["actor_rollout_ref"]["ref"]["use_torch_compile"] == planned["actor_rollout_ref.actor.use_torch_compile"]
    # verl's own batch-size rules (ray_trainer._validate_config, fsdp_workers normalisation)
    a = resolved["actor_rollout_ref"]["actor"]
    n_gpus = resolved["trainer"]["n_gpus_per_node"] * resolved["trainer"]["nnodes"]
    mini_per_gpu = a["ppo_mini_batch_size"] * resolved["actor_rollout_ref"]["rollout"]["n"] // n_gpus
    assert mini_per_gpu % a["ppo_micro_batch_size_per_gpu"] == 0
    assert resolved["data"]["train_batch_size"] >= a["ppo_mini_batch_size"]
    r = resolved["actor_rollout_ref"]["rollout"]
    assert r["max_num_batched_tokens"] >= r["prompt_length"] + r["response_length"]
    assert r["log_prob_micro_batch_size_per_gpu"] is not None
    assert (resolved["critic"]["ppo_micro_batch_size_per_gpu"] is not None) == plan.workload.uses_critic
    # verl's own validation and worker checks of these plans: tests/unit/test_verl_validation.py


def test_every_added_key_has_a_real_anchor(base_config):
    for key, anchor in ADDED_KEYS.items():
        assert OmegaConf.select(base_config, key, default=_MISSING) is _MISSING, key
        assert OmegaConf.is_dict(OmegaConf.select(base_config, anchor, default=None)), anchor
        assert key.startswith(anchor + ".")


@pytest.mark.parametrize("bad", [
    "actor_rollout_ref.fsdp_config.cpu_offload=True",       # the popular recipe's dead key
    "actor_rollout_ref.actor.fsdp_config.offload=True",     # a typo
    "+trainer.nnodes=1",                                     # '+' on a key that exists
])
def test_the_judge_can_fail(verl_config_dir, bad):
    with pytest.raises(ConfigCompositionException):
        _compose(verl_config_dir, [bad])


def test_double_plus_is_what_the_plan_must_avoid(verl_config_dir):
    """'++' creates a key nothing reads, without error: why the plan never emits it."""
    cfg = _compose(verl_config_dir, ["++actor_rollout_ref.fsdp_config.cpu_offload=True"])
    assert cfg.actor_rollout_ref.fsdp_config.cpu_offload is True
