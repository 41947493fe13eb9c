"""The ``workload`` setting (tasks/settings.py): checked before any host changes, and what the
plan makes of it (tasks/plan.py ``workload_for``)."""

from __future__ import annotations

import pytest

from tasks.plan import GpuTarget, make_plan, workload_for
from tasks.settings import WORKLOAD_DEFAULTS, SettingsError, load_settings


def overrides(settings, gpu=GpuTarget("NVIDIA H200", "9.0", 143771)) -> dict:
    return {o.key: o.value for o in make_plan(gpu, workload_for(settings)).overrides}


def test_default_is_one_epoch_of_the_ladder_with_no_step_cap():
    s = load_settings("box1", {})
    assert s.train_steps is None and s.workload == WORKLOAD_DEFAULTS
    assert WORKLOAD_DEFAULTS == {"algorithm": "auto", "model": None, "train_batch_size": 256, "ppo_mini_batch_size": 64,
                                 "max_prompt_length": 256, "max_response_length": 256, "epochs": 1}
    assert s.model_artifact == "qwen_model" and workload_for(s).experiment_name == "qwen2.5-0.5b-gsm8k"
    ov = overrides(s)
    assert ov["trainer.total_epochs"] == 1 and "trainer.total_training_steps" not in ov
    assert ov["algorithm.adv_estimator"] == "gae"          # the ladder's first rung fits an H200


def test_workload_values_reach_the_plan():
    s = load_settings("box1", {"workload": {"algorithm": "grpo", "max_response_length": 192, "epochs": 3,
                                            "train_batch_size": 512, "ppo_mini_batch_size": 128},
                               "train_steps": 40})
    ov = overrides(s)
    assert ov["algorithm.adv_estimator"] == "grpo" and ov["actor_rollout_ref.rollout.n"] == 4
    assert (ov["data.train_batch_size"], ov["actor_rollout_ref.actor.ppo_mini_batch_size"]) == (128, 32)
    assert ov["data.max_response_length"] == 192 and ov["trainer.total_epochs"] == 3
    assert ov["trainer.total_training_steps"] == 40
    assert overrides(load_settings("b", {"workload": {"algorithm": "ppo"}}))["algorithm.adv_estimator"] == "gae"


@pytest.mark.parametrize("workload, key, fix", [
    ({"algorithm": "dpo"}, "workload.algorithm", "set it to auto"),
    ({"algoritm": "grpo"}, "workload.algoritm", "did you mean workload.algorithm?"),
    ({"epoch": 2}, "workload.epoch", "did you mean workload.epochs?"),
    ({"colour": "red"}, "workload.colour", "use one of algorithm, model, train_batch_size"),
    ({"epochs": 0}, "workload.epochs", "positive integer (default 1)"),
    ({"max_response_length": "256"}, "workload.max_response_length", "positive integer (default 256)"),
    ({"train_batch_size": True}, "workload.train_batch_size", "positive integer"),
    ({"train_batch_size": 32}, "workload.ppo_mini_batch_size", "at most workload.train_batch_size"),
    ({"model": "Qwen/Qwen2.5-7B-Instruct"}, "workload.model", "use one of Qwen/Qwen2.5-0.5B-Instruct (qwen_model)"),
    ({"model": 3}, "workload.model", "needs a catalog entry (repo, revision, sha256)"),
])
def test_bad_workload_values_name_host_key_and_fix(workload, key, fix):
    with pytest.raises(SettingsError) as err:
        load_settings("gpu-box-7", {"workload": workload})
    text = str(err.value)
    assert text.startswith(f"host gpu-box-7: {key}:"), text
    assert fix in text and err.value.key == key, text


def test_a_workload_that_is_no_mapping_or_a_near_miss_of_its_name():
    with pytest.raises(SettingsError, match=r"host b: workload: 'grpo' is not a mapping. Fix: use e.g."):
        load_settings("b", {"workload": "grpo"})
    with pytest.raises(SettingsError, match="did you mean workload"):
        load_settings("b", {"workloads": {}})
    with pytest.raises(SettingsError, match="leave it unset to train workload.epochs"):
        load_settings("b", {"train_steps": 0})
