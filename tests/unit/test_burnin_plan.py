"""What a box's burn-in runs (tasks/burnin/plan.py), for the four plans the GPU call burns in: the P40's PPO (fp32),
the GTX 1080's full fine-tune on the CPU-offload rung, the RTX 3060's bf16 full fine-tune (HF rollout, the same
rung), the GTX 1080's LoRA (its default).

Each burn-in's overrides, merged over the plan's as the box merges them (verl_lab_box/burnin.py ``merged``): verl
0.5.0's own checks restated (tasks/verl/rules.py) pass, and verl's Hydra config composes them with every key landing
where verl reads it (the burn-in's reward manager and its kwargs included); the real run's folder, tracker and
validation are replaced, not added beside; its learning rate follows the model's width.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from omegaconf import OmegaConf

from tasks.burnin.plan import (
    BURNIN_LR_WIDTH,
    BURNIN_UNIT,
    MANAGER,
    BurninSpec,
    burnin_lr,
    burnin_paths,
    burnin_plan,
    overrides,
)
from tasks.burnin.stage import burnin_wanted
from tasks.plan import GpuTarget, load_model_config, make_plan
from tasks.verl import violations
from tests.unit.test_plan import workload
from tests.unit.test_train_launcher import layout_for, settings_for
from tests.unit.test_verl_compose import _compose, verl_config_dir  # noqa: F401 - the fixture
from verl_lab_box.burnin import merged, override_key

TRAIN = "/opt/verl-lab/train"
P40 = GpuTarget("Tesla P40", "6.1", 24576)
GTX1080 = GpuTarget("NVIDIA GeForce GTX 1080", "6.1", 8192)
RTX3060 = GpuTarget("NVIDIA GeForce RTX 3060", "8.6", 12288)
CARDS = {"p40": (P40, {}, "ppo"), "gtx1080": (GTX1080, {"finetune": "full"}, "grpo-cpu-offload"),
         "rtx3060": (RTX3060, {"finetune": "full", "rollout_engine": "hf"}, "grpo-cpu-offload"),
         "gtx1080-lora": (GTX1080, {}, "grpo-lora")}


def plan_of(card):
    gpu, extra, rung = CARDS[card]
    plan = make_plan(gpu, workload(**extra))
    assert plan.rung == rung, plan.rung
    return plan


def typed(value: str):
    """An override's value as the plan's own overrides carry it (verl_rules reads numbers and booleans)."""
    for cast in (int, float):
        try:
            return cast(value)
        except ValueError:
            pass
    return {"True": True, "False": False}.get(value, value)


def run_overrides(plan, spec=None, which=0):
    bp = burnin_plan(plan, TRAIN, "box1", spec or BurninSpec())
    return merged(plan.override_lines, bp["overrides"] + bp["runs"][which]["overrides"]), bp


@pytest.mark.parametrize("card", CARDS)
@pytest.mark.parametrize("prompts", [None, 16])
def test_verls_own_checks_pass_the_burnins_config(card, prompts):
    plan = plan_of(card)
    for which in (0, 1):
        lines, _ = run_overrides(plan, BurninSpec(prompts=prompts), which)
        config = {k: typed(v) for k, v in (line.lstrip("+").split("=", 1) for line in lines)}
        found = violations(config, plan.workload.model_config,
                           plan.workload.train_rows, plan.workload.val_rows)
        assert found == [], (card, prompts, [v.message for v in found])


@pytest.mark.parametrize("card", CARDS)
def test_verls_config_composes_it(verl_config_dir, card):  # noqa: F811
    plan = plan_of(card)
    lines, bp = run_overrides(plan, BurninSpec(prompts=16), 1)
    cfg = _compose(verl_config_dir, lines)
    assert cfg.reward_model.reward_manager == MANAGER
    assert OmegaConf.to_container(cfg.reward_model.reward_kwargs) == {
        "model_path": plan.workload.model_path, "records": f"{TRAIN}/burnin/records", "coordinate": 0}
    assert cfg.trainer.default_local_dir == f"{TRAIN}/burnin/checkpoints" and list(cfg.trainer.logger) == ["console"]
    assert (cfg.trainer.total_training_steps, cfg.trainer.resume_mode, cfg.trainer.save_freq) == (5, "auto", 5)
    assert cfg.trainer.test_freq == -1 and cfg.trainer.val_before_train is False
    assert cfg.actor_rollout_ref.actor.optim.lr == bp["lr"]["burnin"]
    assert cfg.data.train_batch_size == 16
    # the plan's micro-batches stay
    assert cfg.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu == plan.memory.actor_micro_batch


@pytest.mark.parametrize("card", CARDS)
def test_the_runs_folder_tracker_and_validation_are_replaced_not_doubled(card):
    plan = plan_of(card)
    lines, _ = run_overrides(plan)
    keys = [override_key(line) for line in lines]
    assert len(keys) == len(set(keys)), [k for k in keys if keys.count(k) > 1]
    assert not any(line.startswith("trainer.default_local_dir=") and "/burnin/" not in line for line in lines)
    assert any(line == "trainer.logger=['console']" for line in lines)


def test_the_learning_rate_follows_the_width_and_lora_is_ten_times():
    full, lora = plan_of("gtx1080"), plan_of("gtx1080-lora")
    assert burnin_lr(full) == pytest.approx(3e-4) and burnin_lr(lora) == pytest.approx(3e-3)
    wide = replace(full, workload=replace(full.workload, model_config={**load_model_config(), "hidden_size": 2048}))
    assert burnin_lr(wide) == pytest.approx(BURNIN_LR_WIDTH["full"] / 2048, rel=1e-2)
    why = next(o["why"] for o in overrides(lora, TRAIN, "box1", BurninSpec()) if "optim.lr" in o["override"])
    assert "1e-05" in why          # the LoRA plan's own rate, named


def test_fewer_prompts_keep_the_updates_a_step():
    plan = plan_of("gtx1080")       # 64 prompts, mini-batches of 16: four updates a step
    lines, _ = run_overrides(plan, BurninSpec(prompts=16))
    assert "data.train_batch_size=16" in lines and "actor_rollout_ref.actor.ppo_mini_batch_size=4" in lines


def test_its_numbers_and_measures():
    bp = burnin_plan(plan_of("p40"), TRAIN, "box1")
    assert (bp["saved_step"], bp["steps"], bp["critic"]) == (2, 5, True)
    assert [r["last_step"] for r in bp["runs"]] == [2, 5]
    assert set(bp["predicted"]["phases_mib"]) >= {"phase_rollout", "phase_actor_update", "phase_critic_update"}
    assert bp["predicted"]["cap_mib"] == 24576 and bp["predicted"]["peak_mib"] <= bp["predicted"]["budget_mib"]
    model = bp["speed_model"]
    assert model["burnin"]["step"] == model["configured"]["step"] > 0        # the plan's own batch
    assert bp["folder"] == burnin_paths(TRAIN)["folder"] and bp["train_unit"] == "verl-lab-train.service"


@pytest.mark.parametrize("spec", [dict(first_steps=0), dict(first_steps=3, total_steps=3), dict(total_steps=2)])
def test_a_burnin_too_short_to_judge_is_refused(spec):
    with pytest.raises(ValueError):
        BurninSpec(**spec)


def test_its_unit_is_the_training_units_sandbox_with_the_burnin_command():
    lay = layout_for(settings_for())
    wanted = {w.path: w for w in burnin_wanted(lay, "{}")}
    unit = wanted[f"/etc/systemd/system/{BURNIN_UNIT}"].content.decode()
    from tasks.train import training_wanted

    train_unit = next(w for w in training_wanted(lay) if w.path.endswith("verl-lab-train.service")).content.decode()
    sandbox = [line for line in train_unit.splitlines() if line.split("=")[0] in (
        "User", "Group", "EnvironmentFile", "NoNewPrivileges", "ProtectSystem", "PrivateTmp", "ProtectHome",
        "CapabilityBoundingSet", "RestrictAddressFamilies", "ProtectProc", "UMask", "KillMode")]
    assert len(sandbox) >= 12 and all(line in unit.splitlines() for line in sandbox)
    assert f"ExecStart={lay.settings.launcher_python} {lay.launcher} --burnin" in unit
    assert "Restart=no" in unit and "[Install]" not in unit and "[Install]" in train_unit
    rw = next(line for line in unit.splitlines() if line.startswith("ReadWritePaths="))
    assert rw == next(line for line in train_unit.splitlines() if line.startswith("ReadWritePaths=")) + \
        f" {lay.train_dir}/burnin"
    owners = {w.path: (w.user, w.group, w.mode) for w in wanted.values()}
    assert owners[f"{lay.train_dir}/burnin"] == ("verl", "verl", "750")            # the train user's folder
    assert owners[f"{lay.train_dir}/burnin-probe/sitecustomize.py"][0] == "root"   # the code it runs: root's
