"""The ``workload`` setting (tasks/settings/load.py): checked before any host changes, and what the
plan makes of it (tasks/plan/workload.py ``workload_for``)."""

from __future__ import annotations

import json

import pytest

from tasks.plan import GpuTarget, make_plan, workload_for
from tasks.settings import WORKLOAD_DEFAULTS, SettingsError, load_settings

H200 = GpuTarget("NVIDIA H200", "9.0", 143771)


def overrides(settings, gpu=H200) -> dict:
    return {o.key: o.value for o in make_plan(gpu, workload_for(settings)).overrides}


def test_default_is_one_epoch_of_the_ladder_with_no_step_cap():
    s = load_settings("box1", {})
    assert s.train_steps is None and s.workload == WORKLOAD_DEFAULTS
    assert WORKLOAD_DEFAULTS == {"algorithm": "auto", "model": None, "train_batch_size": 256, "ppo_mini_batch_size": 64,
                                 "max_prompt_length": 256, "max_response_length": 256, "epochs": 1, "rollout": "auto",
                                 "finetune": "auto", "lora_rank": 32, "lora_alpha": 32, "target_modules": "all-linear"}
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
    ({"temperature": 0.7}, "workload.temperature", "use one of algorithm, model, train_batch_size"),
    ({"epochs": 0}, "workload.epochs", "positive integer (default 1)"),
    ({"max_response_length": "256"}, "workload.max_response_length", "positive integer (default 256)"),
    ({"train_batch_size": True}, "workload.train_batch_size", "positive integer"),
    ({"train_batch_size": 32}, "workload.ppo_mini_batch_size", "at most workload.train_batch_size"),
    ({"model": "Qwen/Qwen2.5-7B-Instruct"}, "workload.model", "Qwen/Qwen2.5-3B-Instruct (qwen_3b_model), Qwen/Qwen2.5-0.5B-Instruct (qwen_model)"),
    ({"model": 3}, "workload.model", "needs a catalog entry (repo, revision, sha256)"),
    ({"rollout": "sglang"}, "workload.rollout", "set it to auto (vLLM where the GPU runs it, else the HF rollout), "
                                                "vllm (vLLM, on compute capability >= 7.0 only) or hf"),
    ({"rollout": "HF"}, "workload.rollout", "'HF' is not one of auto, vllm, hf"),
    ({"rollot": "hf"}, "workload.rollot", "did you mean workload.rollout?"),
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


def test_workload_model_names_a_catalog_model_by_repo_or_artifact_name():
    for value in ("Qwen/Qwen2.5-1.5B-Instruct", "qwen/qwen2.5-1.5b-instruct", "qwen_1_5b_model"):
        s = load_settings("b", {"workload": {"model": value}})
        assert s.model_artifact == "qwen_1_5b_model"
        assert s.model_dir.endswith("/models/Qwen--Qwen2.5-1.5B-Instruct")
        w = workload_for(s)
        assert w.model_config["hidden_size"] == 1536 and w.experiment_name == "qwen2.5-1.5b-gsm8k"
        assert w.model_path == s.model_dir
    with pytest.raises(SettingsError, match="name two models. Fix: set only workload.model"):
        load_settings("b", {"workload": {"model": "Qwen/Qwen2.5-3B-Instruct"}, "model_artifact": "qwen_model"})


def test_every_catalog_model_has_its_shape_and_pinned_weights():
    """The plan reads each model's config.json from files/models before anything is downloaded;
    every weight file is pinned by sha256 and size."""
    from tasks.catalog import default_catalog
    from tasks.memory import ModelShape
    from tasks.plan import catalog_model_config, catalog_models

    models = catalog_models(default_catalog())
    assert [a.repo for a in models] == ["microsoft/Phi-3-mini-4k-instruct", "Qwen/Qwen2.5-3B-Instruct",
                                        "Qwen/Qwen2.5-1.5B-Instruct", "Qwen/Qwen2.5-0.5B-Instruct"]
    billions = {a.repo: ModelShape.from_config(catalog_model_config(a)).params("actor") / 1e9 for a in models}
    assert 3.7 < billions["microsoft/Phi-3-mini-4k-instruct"] < 3.9 and 3.0 < billions["Qwen/Qwen2.5-3B-Instruct"] < 3.2
    assert 1.5 < billions["Qwen/Qwen2.5-1.5B-Instruct"] < 1.6 and 0.45 < billions["Qwen/Qwen2.5-0.5B-Instruct"] < 0.5
    for a in models:
        weights = {n: f for n, f in a.extra["files"].items() if n.endswith(".safetensors")}
        assert weights, a.name
        for name, f in weights.items():
            assert len(f["sha256"]) == 64 and f["size"] > 10**8, (a.name, name)
        # the shape the plan reads is the revision's own config.json, byte for byte
        import hashlib

        from tasks.plan import model_config_path
        pinned = a.extra["files"].get("config.json")
        if a.name != "qwen_model":
            assert pinned, f"{a.name}: config.json is not pinned"
        if pinned:
            data = model_config_path(a.repo).read_bytes()
            assert len(data) == pinned["size"], a.name
            assert hashlib.sha256(data).hexdigest() == pinned.get("sha256", hashlib.sha256(data).hexdigest()), a.name
        # bf16 weights: 2 bytes a parameter, the embedding stored once where tied
        assert abs(sum(f["size"] for f in weights.values()) / 2e9 - billions[a.repo]) < 0.05 * billions[a.repo], a.name


def test_a_model_the_gpu_cannot_train_is_refused_naming_those_that_fit():
    from tasks.plan import PlanError, make_plan, plan_naming_models_that_fit

    s = load_settings("b", {"workload": {"model": "Qwen/Qwen2.5-3B-Instruct"}})
    rtx4060 = GpuTarget("NVIDIA GeForce RTX 4060", "8.9", 8188)
    with pytest.raises(PlanError) as err:
        plan_naming_models_that_fit(lambda w: make_plan(rtx4060, w), workload_for(s), s.catalog, s.model_artifact)
    text = str(err.value)
    assert "does not fit 1 x NVIDIA GeForce RTX 4060" in text
    assert ("Models of the catalog that fit, largest first: Qwen/Qwen2.5-1.5B-Instruct (rung grpo-cpu-offload); "
            "Qwen/Qwen2.5-0.5B-Instruct (rung grpo-lora): set workload.model") in text
    tiny = GpuTarget("NVIDIA GeForce GT 1030", "6.1", 2048)
    with pytest.raises(PlanError, match=r"No model of the catalog fits: the smallest, Qwen/Qwen2.5-0.5B-Instruct, "
                                        r"is short by \d+ MiB too"):
        plan_naming_models_that_fit(lambda w: make_plan(tiny, w), workload_for(s), s.catalog, s.model_artifact)
    # a model that fits is planned as it is
    plan = plan_naming_models_that_fit(lambda w: make_plan(GpuTarget("NVIDIA H200", "9.0", 143771), w),
                                       workload_for(s), s.catalog, s.model_artifact)
    assert plan.workload.model_config["num_hidden_layers"] == 36


RTX3090 = GpuTarget("NVIDIA GeForce RTX 3090", "8.6", 24576)
T4 = GpuTarget("Tesla T4", "7.5", 15360)
P40 = GpuTarget("Tesla P40", "6.1", 24576)


def test_workload_rollout_hf_plans_the_hf_rollout_on_a_vllm_card():
    """The escape hatch: the plan, its memory estimate, micro-batches and reasons follow the HF
    rollout; nothing of vLLM is left in it (no share, no engine pin, no max_num_seqs)."""
    auto, hf = (make_plan(RTX3090, workload_for(load_settings("b", {"workload": {"rollout": r}}))) for r in ("auto", "hf"))
    assert (auto.precision.rollout, hf.precision.rollout) == ("vllm", "hf")
    ov = {o.key: o.value for o in hf.overrides}
    assert ov["actor_rollout_ref.rollout.name"] == "hf" and ov["actor_rollout_ref.rollout.dtype"] == "bfloat16"
    assert not [k for k in ov if "gpu_memory_utilization" in k or "engine_kwargs.vllm" in k or "max_num_batched" in k]
    assert ov["actor_rollout_ref.rollout.micro_batch_size"] == hf.memory.rollout_micro_batch
    assert "VLLM_USE_V1" not in hf.env and hf.env["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert hf.memory.vllm_gpu_memory_utilization is None and "vllm_kv_wanted" not in hf.estimate.breakdown
    assert "rollout" in hf.estimate.breakdown and hf.estimate.breakdown["rollout"] != auto.estimate.breakdown["rollout"]
    why = {r.setting: r.why for r in hf.reasons}
    assert "workload.rollout = 'hf'" in why["rollout"] and "sequences per HF generate() call" in why["rollout_micro_batch"]
    name_why = next(o.why for o in hf.overrides if o.key == "actor_rollout_ref.rollout.name")
    assert name_why == "workload.rollout = 'hf' asks for it"
    assert make_plan(P40, workload_for(load_settings("b", {"workload": {"rollout": "hf"}}))).precision.rollout == "hf"


def test_workload_rollout_vllm_is_vllm_from_7_0_and_refused_below_with_the_reason():
    from tasks.plan import PlanError, rollout_refusal

    vllm = load_settings("b", {"workload": {"rollout": "vllm"}})
    t4 = make_plan(T4, workload_for(vllm))
    assert t4.precision.rollout == "vllm" and t4.env["VLLM_USE_V1"] == "0"
    assert "workload.rollout = 'vllm'" in next(r.why for r in t4.reasons if r.setting == "rollout")
    assert rollout_refusal("vllm", T4) is None and rollout_refusal("hf", P40) is None and rollout_refusal("auto", P40) is None
    with pytest.raises(PlanError) as err:
        make_plan(P40, workload_for(vllm))
    assert str(err.value) == ("workload.rollout = 'vllm': vLLM 0.8.5 needs compute capability >= 7.0, and Tesla P40 has "
                              "6.1. Change: set workload.rollout to 'auto' or 'hf' (the HF-transformers rollout runs "
                              "on every GPU)")
    assert err.value.key == "workload.rollout"
    assert rollout_refusal("sglang", T4)[0] == "'sglang' is not one of auto, vllm, hf"


def test_plan_cli_takes_the_rollout(capsys):
    from tasks.plan import main

    args = ["--json", "--gpu-name", RTX3090.name, "--compute-capability", "8.6", "--gpu-memory-mib", "24576"]
    assert main(args + ["--rollout", "hf"]) == 0
    assert json.loads(capsys.readouterr().out)["rollout"] == "hf"
    assert main(args) == 0 and json.loads(capsys.readouterr().out)["rollout"] == "vllm"
    assert main(["--gpu-name", "Tesla P40", "--compute-capability", "6.1", "--gpu-memory-mib", "24576",
                 "--rollout", "vllm"]) == 2
    assert "no plan: workload.rollout = 'vllm': vLLM 0.8.5 needs compute capability >= 7.0" in capsys.readouterr().err
