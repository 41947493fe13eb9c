"""LoRA in the plan (issue 35): the setting (tasks/settings/load.py), the memory model (tasks/memory/lora.py), the speed
model of a step on the GPU (tasks/speed.py), the rungs and overrides (tasks/plan/lora.py, rungs.py, overrides.py)
and a LoRA save's bytes (tasks/checkpoints.py), on plain values.

What this proves: the arithmetic, the ladder's choices and the reasons. verl 0.5.0's own Hydra config and
validation accept the LoRA plans in tests/unit/test_verl_compose.py and test_verl_validation.py (their cases
include ppo-lora and grpo-lora on both rollouts). Not proven here: any GPU number (GPU call 15's LoRA peaks are
replayed by tests/unit/test_gpu_measurements.py; patch 0013's merge: tests/unit/test_lora_merge_memory.py; the
micro-batch speed: tests/unit/test_speed_micro_batch.py; vLLM's LoRA buffers: tests/unit/test_vllm_lora.py).
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from tasks import checkpoints as ck
from tasks.memory import ModelShape, VerlWorkload, verl_gpu_budget
from tasks.memory.lora import LORA_MODULES, LoraSpec, adapter_params, lora_gpu_budget, lora_held_at_vllm_start_mib
from tasks.plan import GpuTarget, PlanError, make_plan, workload_for
from tasks.settings import SettingsError, load_settings
from tasks.speed import MICRO_LAYER_S, GpuStep, gpu_step_seconds
from tests.unit.test_plan import QWEN_3B, load_model_config, workload

MIB = 1024 * 1024
GTX1080 = GpuTarget("NVIDIA GeForce GTX 1080", "6.1", 8192)
RTX3060 = GpuTarget("NVIDIA GeForce RTX 3060", "8.6", 12288)
P40 = GpuTarget("Tesla P40", "6.1", 24576)
H200 = GpuTarget("NVIDIA H200", "9.0", 143771)


@pytest.fixture(scope="module")
def shape() -> ModelShape:
    return ModelShape.from_config(load_model_config())


def ov(plan) -> dict:
    return {o.key: o.value for o in plan.overrides}


def reason(plan, setting: str):
    return next(r for r in plan.reasons if r.setting == setting)


# ---------------------------------------------------------------- the setting

def test_the_setting_defaults_and_reaches_the_workload():
    s = load_settings("b", {"workload": {"finetune": "lora", "lora_rank": 8, "lora_alpha": 16,
                                         "target_modules": ["v_proj", "q_proj"]}})
    w = workload_for(s)
    assert (w.finetune, w.lora_rank, w.lora_alpha, w.target_modules) == ("lora", 8, 16, ("q_proj", "v_proj"))
    every = load_settings("b", {"workload": {"target_modules": list(reversed(LORA_MODULES))}})
    assert every.workload["target_modules"] == "all-linear"          # every linear layer is PEFT's all-linear
    d = workload_for(load_settings("b", {}))
    assert (d.finetune, d.lora_rank, d.lora_alpha, d.target_modules) == ("auto", 32, 32, "all-linear")


@pytest.mark.parametrize("value,key,words", [
    ({"finetune": "LoRA"}, "workload.finetune", "did you mean 'lora'?"),
    ({"finetune": "ful"}, "workload.finetune", "did you mean 'full'?"),
    ({"finetune": "qlora-4bit"}, "workload.finetune", "set it to auto (LoRA where full fine-tuning needs"),
    ({"finetun": "lora"}, "workload.finetun", "did you mean workload.finetune?"),
    ({"lora_rank": 0}, "workload.lora_rank", "is not a positive integer"),
    ({"lora_alpha": "32"}, "workload.lora_alpha", "is not a positive integer"),
    ({"target_modules": ["q_proj", "q_prj"]}, "workload.target_modules", "did you mean 'q_proj'?"),
    ({"target_modules": "attention"}, "workload.target_modules", "use 'all-linear' or names of q_proj"),
    ({"target_modules": []}, "workload.target_modules", "is not 'all-linear' or a list of module names"),
])
def test_bad_finetune_values_name_host_key_and_fix(value, key, words):
    with pytest.raises(SettingsError) as err:
        load_settings("gpu-box-7", {"workload": value})
    text = str(err.value)
    assert text.startswith(f"host gpu-box-7: {key}:") and words in text, text


# ---------------------------------------------------------------- the memory model

def test_adapter_parameters_are_peft_loras_on_every_linear_layer(shape):
    # rank x (in + out) of q, k, v, o, gate, up, down in each of the 24 layers: 32 x 22912 x 24
    h, q, kv, f = 896, 896, 128, 4864
    assert adapter_params(shape, LoraSpec(rank=32)) == 32 * (7 * h + 2 * q + 2 * kv + 3 * f) * 24 == 17_596_416
    assert adapter_params(shape, LoraSpec(rank=1)) * 32 == adapter_params(shape, LoraSpec(rank=32))
    assert adapter_params(shape, LoraSpec(rank=8, targets=("q_proj", "v_proj"))) == 8 * (2 * h + q + kv) * 24
    adapter = ck.lora_tensors(shape, 32, LORA_MODULES)
    assert sum(ck.numel(d) for _, d in adapter) == adapter_params(shape, LoraSpec(rank=32))
    with pytest.raises(ValueError, match="LoRA targets"):
        LoraSpec(targets=("lm_head",))


def _grpo(**kw) -> VerlWorkload:
    base = dict(train_dtype="fp32", rollout="hf", rollout_dtype="fp32", use_critic=False, use_ref=True,
                grad_ckpt=False, micro_batch=2, log_prob_micro_batch=8, rollout_batch=128, seq_len=512,
                prompt_len=256, response_len=256)
    return VerlWorkload(**{**base, **kw})


def test_lora_holds_the_frozen_base_and_the_adapters_states_and_no_ref(shape):
    wl = _grpo()
    full = verl_gpu_budget(shape, wl)
    lora = lora_gpu_budget(shape, wl, LoraSpec(base_dtype="fp32"))
    A, P = adapter_params(shape, LoraSpec()), shape.params("actor")
    bd = lora.breakdown
    assert bd["lora_frozen_base"] == pytest.approx(4 * P / MIB)
    assert bd["lora_adapter_states"] == pytest.approx(16 * A / MIB)           # fp32 weights, gradients, AdamW m, v
    assert bd["ref_states"] == 0 and full.breakdown["ref_states"] > 0        # ref_in_actor: no ref model
    assert bd["resident"] == pytest.approx((4 * P + 12 * A) / MIB)           # gradients only during the update
    # the actor's and the ref's log-prob passes are one module's (disable_adapter): the same phase
    assert bd["phase_ref_logprob"] == bd["phase_actor_logprob"]
    assert lora.peak_mib < full.peak_mib - 12 * P / MIB / 2
    # a bf16 base (the plan's model_dtype on bf16 cards) is half the fp32 one, with no compute copy of it
    bf = lora_gpu_budget(shape, _grpo(train_dtype="bf16", rollout_dtype="bf16"), LoraSpec(base_dtype="bf16"))
    assert bf.breakdown["lora_frozen_base"] == pytest.approx(2 * P / MIB)
    assert bf.breakdown["phase_actor_logprob"] - bf.breakdown["resident"] < \
        verl_gpu_budget(shape, _grpo(train_dtype="bf16", rollout_dtype="bf16")).breakdown["phase_actor_logprob"] \
        - verl_gpu_budget(shape, _grpo(train_dtype="bf16", rollout_dtype="bf16")).breakdown["resident"]


def test_lora_update_keeps_the_activations_but_not_the_bases_gradients(shape):
    """The backward runs through every frozen layer (the same saved activations), without the lm_head's weight
    gradient or the base's AdamW temporary; checkpointing still cuts the activations."""
    spec = LoraSpec(base_dtype="fp32")
    plain = lora_gpu_budget(shape, _grpo(micro_batch=4), spec).breakdown["actor_activations"]
    one = lora_gpu_budget(shape, _grpo(micro_batch=1), spec).breakdown["actor_activations"]
    assert plain > 3 * one - 100                                  # grows with the micro-batch
    ckpt = lora_gpu_budget(shape, _grpo(micro_batch=4, grad_ckpt=True), spec).breakdown["actor_activations"]
    assert ckpt < plain / 2
    # what the update adds over the resident states: full fine-tuning adds the base's fp32 gradients (4P) and
    # AdamW's temporary (4P) or the activations with the lm_head's weight gradient; LoRA the activations alone
    full = verl_gpu_budget(shape, _grpo(micro_batch=1)).breakdown
    lora = lora_gpu_budget(shape, _grpo(micro_batch=1), spec).breakdown
    added_full = full["phase_actor_update"] - full["resident"]
    added_lora = lora["phase_actor_update"] - lora["resident"]
    assert added_lora < added_full - 4 * shape.params("actor") / MIB / 2, (added_lora, added_full)


def test_vllm_holds_the_base_it_starts_beside(shape):
    """What the process holds when vLLM starts (its V1 accounting counts it): the frozen base unless offloaded.
    vLLM's own LoRA buffers: tests/unit/test_vllm_lora.py."""
    wl = _grpo(train_dtype="bf16", rollout="vllm", rollout_dtype="bf16")
    held = lora_held_at_vllm_start_mib(shape, wl, LoraSpec(base_dtype="bf16"))
    offloaded = lora_held_at_vllm_start_mib(shape, replace(wl, actor_param_offload=True), LoraSpec(base_dtype="bf16"))
    assert held - offloaded == pytest.approx(2 * shape.params("actor") / MIB)


def test_the_lora_model_refuses_the_offload_rungs_knobs(shape):
    with pytest.raises(ValueError, match="without the CPU-offload rung"):
        lora_gpu_budget(shape, _grpo(actor_offload_policy=True), LoraSpec())


# ---------------------------------------------------------------- the speed model

def test_a_lora_update_is_two_forwards_where_full_fine_tuning_is_three():
    """FLOPs: LoRA's backward makes input gradients only. The fixed cost per micro-batch and layer is the same for
    both (measured with LoRA: tests/unit/test_speed_micro_batch.py), so it is taken off before the ratio."""
    step = GpuStep(params=494_032_768, layers=24, train_dtype="fp32", sequences=256, micro_batch=4,
                   rollout_chunk=128, prompt_len=256, response_len=256, reference=True)
    full, lora = gpu_step_seconds(step), gpu_step_seconds(replace(step, lora=True))
    fixed = 256 // 4 * 24 * MICRO_LAYER_S
    assert (lora["update"] - fixed) / (full["update"] - fixed) == pytest.approx(2 / 3, abs=0.01)
    assert lora["rollout"] == full["rollout"] and lora["ref_log_prob"] == full["actor_log_prob"]
    assert "rollout" not in gpu_step_seconds(replace(step, rollout_chunk=0))    # vLLM's generation is not counted


# ---------------------------------------------------------------- the ladder, the reasons, the overrides

def test_auto_takes_lora_where_full_fine_tuning_needs_the_cpu_offload_rung():
    p = make_plan(GTX1080, workload())
    assert p.rung == "grpo-lora" and p.workload.lora and p.to_dict()["lora"] == {
        "rank": 32, "alpha": 32, "target_modules": "all-linear"}
    why = reason(p, "finetune")
    assert why.value == "lora" and "grpo-cpu-offload" in why.why and why.why.count("s a step") == 2, why.why
    assert "ppo short by" in why.why and "speed model" in why.why
    # every weight trained, the same card lands on the CPU-offload rung
    assert make_plan(GTX1080, workload(finetune="full")).rung == "grpo-cpu-offload"


def test_auto_keeps_full_fine_tuning_where_it_fits_on_the_gpu():
    p = make_plan(P40, workload())
    assert p.rung == "ppo" and not p.workload.lora and p.to_dict()["lora"] is None
    why = reason(p, "finetune")
    assert why.value == "full" and "fits on the GPU" in why.why and "LoRA at the same batches" in why.why
    assert not [k for k in ov(p) if "lora" in k]
    lora = make_plan(P40, workload(finetune="lora"))          # asked for: PPO with LoRA, the critic full
    assert lora.rung == "ppo-lora" and reason(lora, "finetune").why == "workload.finetune = 'lora' asks for it"
    assert ov(lora)["critic.model.lora_rank"] == 0
    assert "critic.model.fsdp_config.mixed_precision.param_dtype" in ov(lora)


def test_finetune_picks_the_rungs():
    too_big = replace(make_plan(H200, workload()).estimate, peak_mib=10 ** 6)
    never = lambda gpu, w, prec, choice: too_big  # noqa: E731
    for finetune, tried in (("full", "ppo short by .*, grpo short by .*, grpo-cpu-offload short"),
                            ("lora", r"Rungs tried: ppo-lora short by \d+ MiB, grpo-lora short by \d+ MiB\.")):
        with pytest.raises(PlanError, match=tried):
            make_plan(P40, workload(finetune=finetune), estimator=never)
    with pytest.raises(PlanError, match="finetune must be one of auto, full, lora") as err:
        make_plan(P40, workload(finetune="qlora"))
    assert err.value.key == "workload.finetune"


def test_lora_overrides_and_their_reasons():
    p = make_plan(RTX3060, workload())
    o = ov(p)
    assert p.rung == "grpo-lora" and p.precision.rollout == "vllm"
    assert (o["actor_rollout_ref.model.lora_rank"], o["actor_rollout_ref.model.lora_alpha"],
            o["actor_rollout_ref.model.target_modules"]) == (32, 32, "all-linear")
    assert o["actor_rollout_ref.actor.optim.lr"] == 1e-5                      # 10 x verl's 1e-6
    assert o["actor_rollout_ref.actor.fsdp_config.model_dtype"] == "bf16"     # the frozen base in the training dtype
    assert o["actor_rollout_ref.rollout.load_format"] == "safetensors"
    assert o["actor_rollout_ref.rollout.layered_summon"] is False
    assert "actor_rollout_ref.actor.fsdp_config.optimizer_offload" in o and not o[
        "actor_rollout_ref.actor.fsdp_config.optimizer_offload"]
    whys = {x.key: x.why for x in p.overrides}
    assert "LoRA Without Regret" in whys["actor_rollout_ref.actor.optim.lr"]
    assert "ref_in_actor" in whys["actor_rollout_ref.ref.fsdp_config.param_offload"]
    assert "max_lora_rank=32" in whys["actor_rollout_ref.rollout.load_format"]
    two = ov(make_plan(replace(RTX3060, count=2), workload(finetune="lora", algorithm="grpo")))
    assert two["actor_rollout_ref.rollout.layered_summon"] is True
    hf = ov(make_plan(GTX1080, workload()))                                   # fp32 card, HF rollout
    assert hf["actor_rollout_ref.actor.fsdp_config.model_dtype"] == "fp32"
    assert "actor_rollout_ref.rollout.load_format" not in hf


def test_vllm_takes_only_its_lora_ranks():
    with pytest.raises(PlanError, match="must be one of 8, 16, 32") as err:
        make_plan(RTX3060, workload(lora_rank=4))
    assert err.value.key == "workload.lora_rank"
    assert make_plan(GTX1080, workload(lora_rank=1)).rung == "grpo-lora"     # the HF rollout takes rank 1
    assert make_plan(RTX3060, workload(lora_rank=4, finetune="full")).rung == "grpo-cpu-offload"


def test_the_3b_trains_with_lora_on_24_gb_cards():
    for gpu in (P40, GpuTarget("NVIDIA GeForce RTX 3090", "8.6", 24576)):
        p = make_plan(gpu, workload(model_config=QWEN_3B))
        assert p.rung == "grpo-lora", (gpu.name, p.rung)
        assert p.estimate.peak_mib <= p.estimate.budget_mib


# ---------------------------------------------------------------- a LoRA save

def test_a_lora_save_holds_the_base_the_adapters_their_states_and_lora_adapter(shape):
    adapter = ck.lora_tensors(shape, 32, LORA_MODULES)
    A = sum(ck.numel(d) for _, d in adapter)
    full = ck.role_save(shape, "actor", "fsdp", 1, 2, 0)
    lora = ck.role_save(shape, "actor", "fsdp", 1, 2, 0, adapter)
    assert lora.model_bytes[0] - full.model_bytes[0] == 4 * A + len(adapter) * ck.MODEL_ENTRY_BYTES
    assert lora.optim_bytes[0] == 8 * A + len(adapter) * ck.OPTIM_ENTRY_BYTES        # AdamW of the adapters alone
    assert lora.rank0_bytes - full.rank0_bytes == 4 * A + len(adapter) * ck.SAFETENSORS_ENTRY_BYTES \
        + ck.LORA_CONFIG_BYTES                                                      # lora_adapter/ beside the shards
    two = ck.role_save(shape, "actor", "fsdp", 2, 2, 0, adapter)
    assert sum(two.optim_bytes) == pytest.approx(lora.optim_bytes[0] + len(adapter) * ck.OPTIM_ENTRY_BYTES, rel=0.01)
    plan = make_plan(RTX3060, workload()).to_dict()["checkpoints"]
    full_plan = make_plan(RTX3060, workload(finetune="full")).to_dict()["checkpoints"]
    assert plan["save"]["total_bytes"] < full_plan["save"]["total_bytes"] / 3        # bf16 base, no base states
    assert plan["export_bytes"] - full_plan["export_bytes"] == 4 * A + len(adapter) * ck.SAFETENSORS_ENTRY_BYTES \
        + ck.LORA_CONFIG_BYTES


def test_lora_offloads_the_frozen_base_only_where_vllm_generates():
    """The adapters' AdamW states are megabytes: never an offload step; the base's param offload is the only actor
    step, and never with the HF rollout (verl 0.5.0 does not reload the actor before HF generation)."""
    from tasks.plan import choose_precision, offload_levels

    w = replace(workload(finetune="lora", algorithm="grpo"), lora=True, algorithm="grpo")
    for gpu, steps in ((RTX3060, ["actor_param_offload"]), (GTX1080, [])):
        prec, _ = choose_precision(gpu)
        levels = offload_levels(w, prec)
        taken = [k for k in levels[-1] if levels[-1][k]]
        assert taken == steps, (gpu.name, taken)


# ---------------------------------------------------------------- the GPU harness's LoRA call (plumbing only)

def test_the_lora_bench_runs_the_lora_profiles_against_the_full_plans(tmp_path):
    """bench/gpu/run_lora.sh: its time limits name exactly the LoRA profiles and the full plans they are compared
    with, each card's call runs its full plan then its LoRA plan, within one device call's budget; it stops before
    any run on a profile it does not know or one not rendered (the runs need the GPU)."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    sys.path.insert(0, str(repo / "bench" / "gpu"))
    import ppo_profiles

    script = (repo / "bench" / "gpu" / "run_lora.sh").read_text()
    limits = {k: int(v) for k, v in re.findall(r"\[([a-z0-9.-]+)\]=(\d+)", script)}
    lora = {p.name: p for p in ppo_profiles.LORA_PROFILES}
    assert set(limits) == set(lora) | {p.compare_with for p in lora.values() if p.compare_with}
    assert all(p.finetune == "lora" for p in lora.values())
    assert all(ppo_profiles.BY_NAME[p.compare_with].finetune == "full" for p in lora.values() if p.compare_with)
    for card in ("gtx1080", "rtx2080ti", "rtx3060"):
        line = next(x for x in script.splitlines() if x.strip().startswith(f"{card})"))
        assert line.split("--", 1)[1].split()[:2] == [f"{card}-after", f"{card}-lora"]
        assert limits[f"{card}-after"] + limits[f"{card}-lora"] + 40 <= 560       # setup ~40 s, one call
    run = lambda *a: subprocess.run(["bash", str(repo / "bench/gpu/run_lora.sh"), *a], cwd=tmp_path,  # noqa: E731
                                    capture_output=True, text=True)
    assert run().returncode == 2
    unknown = run("gtx1080-sideways")
    assert unknown.returncode == 2 and "unknown profile gtx1080-sideways" in unknown.stderr
    missing = run("gtx1080")
    assert missing.returncode == 2 and "not rendered" in missing.stderr


def test_the_plan_cli_shows_a_cards_full_and_lora_plans(capsys):
    """`python -m tasks.plan --finetune full|lora`: the same card's two plans, the rung in each header."""
    from tasks.plan import main

    card = ["--gpu-name", "NVIDIA GeForce GTX 1080", "--compute-capability", "6.1", "--gpu-memory-mib", "8192"]
    heads = {}
    for finetune in ("full", "lora", "auto"):
        assert main([*card, "--finetune", finetune]) == 0
        heads[finetune] = capsys.readouterr().out.splitlines()[1]
    assert heads["full"].startswith("rung grpo-cpu-offload: predicted peak") and "MiB of host RAM" in heads["full"]
    assert heads["lora"].startswith("rung grpo-lora: predicted peak") and heads["auto"] == heads["lora"]
    assert main([*card, "--finetune", "lora", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["workload"]["finetune"] == "lora"
    with pytest.raises(SystemExit):
        main([*card, "--finetune", "qlora"])
    assert "invalid choice: 'qlora'" in capsys.readouterr().err
