"""The training plan, table-driven over GPUs from Pascal to Hopper (``GPU_TABLE``: what each must get)."""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tasks import plan as planmod
from tasks.facts.gpu import Gpu, GpuInventory
from tasks.plan import (
    OFFLOAD_KNOBS,
    OFFLOAD_LADDER,
    GpuTarget,
    MemoryEstimate,
    PlanError,
    Workload,
    choose_precision,
    load_model_config,
    make_plan,
    memory_fit,
    offload_seconds,
    rollout_tp_choices,
)
from tasks.verl import ADDED_KEYS, DEAD_KEYS, Override, format_value

REPO = Path(__file__).resolve().parents[2]

# name, cc, memory MiB, train dtype, rollout, rollout dtype, attention, torch.compile
GPU_TABLE = [
    ("NVIDIA GeForce GTX 1080", "6.1", 8192, "fp32", "hf", "float32", "sdpa", False),
    ("NVIDIA GeForce GTX 1080 Ti", "6.1", 11264, "fp32", "hf", "float32", "sdpa", False),
    ("Tesla P40", "6.1", 24576, "fp32", "hf", "float32", "sdpa", False),
    ("Tesla V100-SXM2-16GB", "7.0", 16160, "fp32", "vllm", "float16", "sdpa", True),
    ("Tesla P100-PCIE-16GB", "6.0", 16384, "fp32", "hf", "float32", "sdpa", False),
    ("Tesla V100-SXM2-32GB", "7.0", 32768, "fp32", "vllm", "float16", "sdpa", True),
    ("Tesla T4", "7.5", 15360, "fp32", "vllm", "float16", "sdpa", True),
    ("NVIDIA GeForce RTX 2080 Ti", "7.5", 11264, "fp32", "vllm", "float16", "sdpa", True),
    ("NVIDIA GeForce RTX 3060", "8.6", 12288, "bf16", "vllm", "bfloat16", "sdpa", True),
    ("NVIDIA GeForce RTX 3080", "8.6", 10240, "bf16", "vllm", "bfloat16", "sdpa", True),
    ("NVIDIA GeForce RTX 3090", "8.6", 24576, "bf16", "vllm", "bfloat16", "sdpa", True),
    ("NVIDIA A10", "8.6", 23028, "bf16", "vllm", "bfloat16", "sdpa", True),
    ("NVIDIA GeForce RTX 4060", "8.9", 8188, "bf16", "vllm", "bfloat16", "sdpa", True),
    ("NVIDIA L4", "8.9", 23034, "bf16", "vllm", "bfloat16", "sdpa", True),
    ("NVIDIA GeForce RTX 4090", "8.9", 24564, "bf16", "vllm", "bfloat16", "sdpa", True),
    ("NVIDIA A100-SXM4-80GB", "8.0", 81920, "bf16", "vllm", "bfloat16", "sdpa", True),
    ("NVIDIA H100 80GB HBM3", "9.0", 81559, "bf16", "vllm", "bfloat16", "sdpa", True),
]
# The rung of the ladder each GPU lands on with the default workload; None: no rung fits. The 8-11 GB
# cards cannot hold the actor's AdamW step (20 bytes per parameter + the process): the actor on FSDP2
# with CPUOffloadPolicy (GPU call 7)
# with CPUOffloadPolicy (GPU call 7) when every weight trains (workload.finetune = "full"); LoRA adapters on the
# GPU alone by default ("auto": tasks/plan/lora.py)
OFFLOADED = "grpo-cpu-offload"
LORA = "grpo-lora"
SMALL = ("NVIDIA GeForce GTX 1080", "NVIDIA GeForce GTX 1080 Ti", "NVIDIA GeForce RTX 2080 Ti",
         "NVIDIA GeForce RTX 3080", "NVIDIA GeForce RTX 4060", "NVIDIA GeForce RTX 3060")
RUNG = {name: LORA for name in SMALL}
FULL_RUNG = {name: OFFLOADED for name in SMALL}
DOES_NOT_FIT = {name for name, rung in RUNG.items() if rung is None}


def workload(**kw) -> Workload:
    base = dict(model_path="/opt/verl-lab/models/Qwen--Qwen2.5-0.5B-Instruct",
                train_files="/opt/verl-lab/data/gsm8k/train.parquet",
                val_files="/opt/verl-lab/data/gsm8k/test.parquet",
                checkpoint_dir="/opt/verl-lab/train/checkpoints", total_training_steps=20,
                model_config=load_model_config())
    base.update(kw)
    return Workload(**base)


def overrides_of(plan) -> dict[str, object]:
    return {o.key: o.value for o in plan.overrides}


@pytest.mark.parametrize("name,cc,mem,dtype,rollout,rdtype,attn,compile_ok", GPU_TABLE)
def test_precision_table(name, cc, mem, dtype, rollout, rdtype, attn, compile_ok):
    prec, reasons = choose_precision(GpuTarget(name, cc, mem))
    assert (prec.train_dtype, prec.rollout, prec.rollout_dtype, prec.attn_implementation,
            prec.use_torch_compile) == (dtype, rollout, rdtype, attn, compile_ok)
    assert {r.setting for r in reasons} >= {"train_dtype", "rollout", "rollout_dtype", "attn_implementation",
                                            "use_torch_compile"}
    assert all(r.why for r in reasons)


@pytest.mark.parametrize("name,cc,mem,dtype,rollout,rdtype,attn,compile_ok", GPU_TABLE)
def test_plan_table(name, cc, mem, dtype, rollout, rdtype, attn, compile_ok):
    gpu = GpuTarget(name, cc, mem)
    if name in DOES_NOT_FIT:
        with pytest.raises(PlanError) as err:
            make_plan(gpu, workload())
        msg = str(err.value)
        assert "short by" in msg and "MiB" in msg and "Change:" in msg
        return
    p = make_plan(gpu, workload())
    ov = overrides_of(p)
    assert p.rung == RUNG.get(name, "ppo") and p.to_dict()["rung"] == p.rung
    assert ov["actor_rollout_ref.rollout.name"] == rollout
    assert ov["actor_rollout_ref.rollout.dtype"] == rdtype
    assert ov["actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype"] == dtype
    assert ov["actor_rollout_ref.model.override_config._attn_implementation"] == attn
    if p.rung == "ppo":
        assert ov["algorithm.adv_estimator"] == "gae" and ov["actor_rollout_ref.rollout.n"] == 1
        assert ov["critic.model.fsdp_config.mixed_precision.param_dtype"] == dtype
        assert ov["critic.model.override_config._attn_implementation"] == attn
    else:   # GRPO: verl builds no critic, so the plan sets nothing under critic.
        assert ov["algorithm.adv_estimator"] == "grpo" and ov["actor_rollout_ref.rollout.n"] == 4
        assert not [k for k in ov if k.startswith("critic.")]
        assert ov["data.train_batch_size"] * 4 == 256 and ov["actor_rollout_ref.actor.ppo_mini_batch_size"] * 4 == 64
    if p.rung == OFFLOADED:   # FSDP2 + CPUOffloadPolicy; verl forces the actor's FSDP1 flags False, always offloads the ref
        assert ov["actor_rollout_ref.actor.strategy"] == "fsdp2"
        assert ov["actor_rollout_ref.actor.fsdp_config.offload_policy"] is True
        assert ov[planmod.OFFLOAD_KEYS["actor_param_offload"]] is False
        assert ov[planmod.OFFLOAD_KEYS["actor_optimizer_offload"]] is False
        assert ov[planmod.OFFLOAD_KEYS["ref_param_offload"]] is True
        assert p.to_dict()["workload"]["actor_offload_policy"] is True
    else:
        assert "actor_rollout_ref.actor.strategy" not in ov and "actor_rollout_ref.actor.fsdp_config.offload_policy" not in ov
    assert ov["actor_rollout_ref.actor.use_torch_compile"] is compile_ok
    assert ov["actor_rollout_ref.rollout.tensor_model_parallel_size"] == 1
    assert ov["trainer.n_gpus_per_node"] == 1 and ov["trainer.nnodes"] == 1
    assert ov["data.filter_overlong_prompts"] is True
    assert ov["trainer.total_training_steps"] == 20
    assert ov["trainer.logger"] == ["console"]
    assert ov["trainer.resume_mode"] == "auto"
    assert ov["trainer.default_local_dir"] == "/opt/verl-lab/train/checkpoints"
    # fp32 training everywhere without bf16, including the reference model's weights
    if dtype == "fp32":
        assert ov["actor_rollout_ref.ref.fsdp_config.model_dtype"] == "fp32"
    # the estimate fits the GPU
    assert 0 < p.estimate.peak_mib <= p.estimate.budget_mib < mem
    if rollout == "vllm":
        share = ov["actor_rollout_ref.rollout.gpu_memory_utilization"]
        assert 0.05 <= share <= 0.9
        assert ov["actor_rollout_ref.rollout.max_num_batched_tokens"] >= 256 + 256
        assert ov["actor_rollout_ref.rollout.engine_kwargs.vllm.max_num_seqs"] == p.memory.rollout_micro_batch
        assert 256 % p.memory.rollout_micro_batch == 0 and p.memory.rollout_micro_batch >= 64
        assert "PYTORCH_CUDA_ALLOC_CONF" not in p.env   # vLLM sleep mode refuses expandable segments
    else:
        assert "actor_rollout_ref.rollout.gpu_memory_utilization" not in ov
        assert ov["actor_rollout_ref.rollout.micro_batch_size"] >= 1
        assert ov[planmod.OFFLOAD_KEYS["actor_param_offload"]] is False
        assert p.env["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    # micro-batches divide the per-GPU mini-batch of sequences (verl asserts this)
    assert 64 % ov["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"] == 0
    assert p.rung != "ppo" or 64 % ov["critic.ppo_micro_batch_size_per_gpu"] == 0
    # every override has a reason, no dead keys, no '++', '+' only for keys verl reads by .get()
    for o in p.overrides:
        assert o.why
        assert o.key not in DEAD_KEYS
    for line in p.override_lines:
        assert not line.startswith("++")
        if line.startswith("+"):
            assert line[1:].split("=", 1)[0] in ADDED_KEYS


def test_bigger_gpu_gets_bigger_micro_batches_and_no_offload():
    t4 = make_plan(GpuTarget("Tesla T4", "7.5", 15360), workload())
    a100 = make_plan(GpuTarget("NVIDIA A100-SXM4-80GB", "8.0", 81920), workload())
    assert a100.memory.actor_micro_batch > t4.memory.actor_micro_batch
    assert not any(a100.memory.offload.values())
    assert any(t4.memory.offload.values())       # 15 GB needs optimizer offload in fp32


def test_flash_attention_only_when_installed_and_sm80():
    a100 = make_plan(GpuTarget("NVIDIA A100-SXM4-80GB", "8.0", 81920), workload(flash_attn_installed=True))
    ov = overrides_of(a100)
    assert ov["actor_rollout_ref.model.override_config._attn_implementation"] == "flash_attention_2"
    assert ov["actor_rollout_ref.model.use_remove_padding"] is True
    t4 = make_plan(GpuTarget("Tesla T4", "7.5", 15360), workload(flash_attn_installed=True))
    assert overrides_of(t4)["actor_rollout_ref.model.override_config._attn_implementation"] == "sdpa"
    a100_plain = make_plan(GpuTarget("NVIDIA A100-SXM4-80GB", "8.0", 81920), workload())
    assert overrides_of(a100_plain)["actor_rollout_ref.model.use_remove_padding"] is False


def _fake_estimator(fits_when):
    calls = []

    def est(gpu, wl, prec, choice):
        calls.append(choice)
        ok = fits_when(choice)
        return MemoryEstimate(peak_mib=1000 if ok else 5000, budget_mib=2000,
                              breakdown={"phase_actor_update": 4000 if not ok else 900},
                              vllm_gpu_memory_utilization=0.3 if prec.rollout == "vllm" else None)
    return est, calls


def test_ladder_takes_fewest_offloads_then_largest_micro_batch():
    est, calls = _fake_estimator(lambda c: c.offload["actor_optimizer_offload"] and c.actor_micro_batch <= 4)
    p = make_plan(GpuTarget("Tesla T4", "7.5", 15360), workload(), estimator=est)
    on = [k for k, v in p.memory.offload.items() if v]
    assert on == ["actor_optimizer_offload"]         # no reference model: ref offload is skipped
    assert p.memory.actor_micro_batch == 4
    assert p.memory.vllm_gpu_memory_utilization == 0.3
    # the no-offload level was tried first, with every micro-batch
    assert [c.actor_micro_batch for c in calls[:5]] == [16, 8, 4, 2, 1]
    assert not any(calls[0].offload.values())
    assert p.estimate.peak_mib == 1000


def test_ladder_starts_with_reference_when_there_is_one():
    est, calls = _fake_estimator(lambda c: c.offload["ref_param_offload"])
    p = make_plan(GpuTarget("Tesla T4", "7.5", 15360), workload(use_kl_loss=True), estimator=est)
    assert [k for k, v in p.memory.offload.items() if v] == ["ref_param_offload"]
    assert overrides_of(p)["actor_rollout_ref.ref.fsdp_config.param_offload"] is True


def test_hf_rollout_never_gets_actor_param_offload():
    est, _ = _fake_estimator(lambda c: c.offload["actor_param_offload"])
    with pytest.raises(PlanError) as err:
        make_plan(GpuTarget("Tesla P40", "6.1", 24576), workload(), estimator=est)
    assert "short by 3000 MiB" in str(err.value) and "actor_update" in str(err.value)
    # the same estimate on a vLLM GPU escalates to actor param offload
    p = make_plan(GpuTarget("Tesla T4", "7.5", 15360), workload(), estimator=est)
    assert p.memory.offload["actor_param_offload"] is True
    assert OFFLOAD_LADDER.index("actor_param_offload") > OFFLOAD_LADDER.index("critic_optimizer_offload")


def test_multi_gpu():
    p = make_plan(GpuTarget("NVIDIA GeForce RTX 3090", "8.6", 24576, count=4), workload())
    ov = overrides_of(p)
    assert ov["trainer.n_gpus_per_node"] == 4
    assert (ov["data.train_batch_size"], ov["actor_rollout_ref.actor.ppo_mini_batch_size"]) == (256, 64)
    assert (64 // 4) % ov["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"] == 0
    assert ov["actor_rollout_ref.rollout.engine_kwargs.vllm.max_num_seqs"] == 64     # this GPU's share
    # 3 GPUs: batches rounded up so every GPU gets an equal share of sequences (verl divides them)
    p3 = make_plan(GpuTarget("NVIDIA GeForce RTX 3090", "8.6", 24576, count=3), workload())
    ov3 = overrides_of(p3)
    assert (ov3["data.train_batch_size"], ov3["actor_rollout_ref.actor.ppo_mini_batch_size"]) == (258, 66)
    assert "every GPU gets an equal share" in next(r.why for r in p3.reasons if r.setting == "train_batch_size")
    g3 = make_plan(GpuTarget("NVIDIA GeForce RTX 3090", "8.6", 24576, count=3), workload(algorithm="grpo"))
    assert (g3.workload.train_batch_size, g3.workload.ppo_mini_batch_size, g3.workload.rollout_n) == (66, 18, 4)


def test_fsdp_shards_states_over_the_gpus():
    """4 x P40: each GPU holds a quarter of the FSDP states, so the same per-GPU memory buys more."""
    one = make_plan(GpuTarget("Tesla P40", "6.1", 24576), workload())
    four = make_plan(GpuTarget("Tesla P40", "6.1", 24576, 4), workload())
    assert four.estimate.breakdown["actor_states"] * 4 == pytest.approx(one.estimate.breakdown["actor_states"], abs=2)
    assert four.memory.actor_micro_batch > one.memory.actor_micro_batch
    # an 11 GB card alone trains GRPO with LoRA (or, every weight trained, with the actor offloaded to the CPU);
    # four of them train PPO
    assert make_plan(GpuTarget("NVIDIA GeForce GTX 1080 Ti", "6.1", 11264), workload()).rung == LORA
    assert make_plan(GpuTarget("NVIDIA GeForce GTX 1080 Ti", "6.1", 11264), workload(finetune="full")).rung == OFFLOADED
    assert make_plan(GpuTarget("NVIDIA GeForce GTX 1080 Ti", "6.1", 11264, 4), workload()).rung == "ppo"


def _rung_estimator(fits):
    """Fits when ``fits(workload)`` says so, whatever the memory choice."""
    def est(gpu, wl, prec, choice):
        ok = fits(wl)
        return MemoryEstimate(peak_mib=1000 if ok else 2500 + wl.max_response_length, budget_mib=2000,
                              breakdown={"phase_actor_update": 900}, vllm_gpu_memory_utilization=0.3)
    return est


def test_ladder_falls_back_to_grpo_with_its_reasons():
    p = make_plan(GpuTarget("Tesla T4", "7.5", 15360), workload(), estimator=_rung_estimator(lambda w: not w.uses_critic))
    ov = overrides_of(p)
    assert p.rung == "grpo"
    assert ov["algorithm.adv_estimator"] == "grpo" and ov["actor_rollout_ref.rollout.n"] == 4
    assert ov["actor_rollout_ref.actor.use_kl_loss"] is True and ov["actor_rollout_ref.actor.kl_loss_coef"] == 0.001
    assert ov["actor_rollout_ref.actor.kl_loss_type"] == "low_var_kl" and ov["algorithm.use_kl_in_reward"] is False
    assert ov["actor_rollout_ref.actor.entropy_coeff"] == 0
    assert (ov["data.train_batch_size"], ov["actor_rollout_ref.actor.ppo_mini_batch_size"]) == (64, 16)
    assert not [k for k in ov if k.startswith("critic.")]
    assert ov[planmod.OFFLOAD_KEYS["ref_param_offload"]] is False       # the ref exists: its offload is a choice
    rung = next(r for r in p.reasons if r.setting == "rung")
    assert "no critic" in rung.why and "ppo is short by 756 MiB" in rung.why


def test_ladder_shortens_responses_last_and_names_every_rung():
    p = make_plan(GpuTarget("Tesla T4", "7.5", 15360), workload(),
                  estimator=_rung_estimator(lambda w: w.max_response_length <= 128))
    assert p.rung == "grpo-cpu-offload-response-128" and overrides_of(p)["data.max_response_length"] == 128
    assert overrides_of(p)["actor_rollout_ref.actor.fsdp_config.offload_policy"] is True
    assert overrides_of(p)["data.max_prompt_length"] == 256         # prompts are never cut
    with pytest.raises(PlanError) as err:
        make_plan(GpuTarget("Tesla T4", "7.5", 15360), workload(), estimator=_rung_estimator(lambda w: False))
    msg = str(err.value)
    assert msg.split("short by ", 1)[1].startswith("628 MiB")       # the last rung's shortfall first
    assert ("ppo short by 756 MiB, grpo short by 756 MiB, ppo-lora short by 756 MiB, grpo-lora short by 756 MiB, "
            "grpo-cpu-offload short by 756 MiB, grpo-cpu-offload-response-192 short by 692 MiB") in msg
    assert "Change:" in msg


def test_algorithm_choice_limits_the_ladder():
    never = _rung_estimator(lambda w: False)
    with pytest.raises(PlanError, match=r"Rungs tried: ppo short by \d+ MiB, ppo-lora short by \d+ MiB\. "):
        make_plan(GpuTarget("Tesla T4", "7.5", 15360), workload(algorithm="ppo"), estimator=never)
    with pytest.raises(PlanError, match=r"Rungs tried: grpo short by \d+ MiB, grpo-cpu-offload short by \d+ MiB\. "):
        make_plan(GpuTarget("Tesla T4", "7.5", 15360), workload(algorithm="grpo", finetune="full"), estimator=never)
    with pytest.raises(PlanError, match=r"Rungs tried: ppo-lora short by \d+ MiB, grpo-lora short by \d+ MiB\. "):
        make_plan(GpuTarget("Tesla T4", "7.5", 15360), workload(finetune="lora"), estimator=never)
    p = make_plan(GpuTarget("NVIDIA H200", "9.0", 143771), workload(algorithm="grpo"))
    assert p.rung == "grpo" and p.workload.rollout_n == 4
    with pytest.raises(PlanError, match="algorithm must be one of auto, ppo, grpo"):
        make_plan(GpuTarget("NVIDIA H200", "9.0", 143771), workload(algorithm="dpo"))


def test_epochs_unless_a_step_cap():
    ov = overrides_of(make_plan(GpuTarget("Tesla P40", "6.1", 24576), workload(total_training_steps=None)))
    assert ov["trainer.total_epochs"] == 1 and "trainer.total_training_steps" not in ov
    assert ov["trainer.save_freq"] == 10


def test_bad_workloads():
    gpu = GpuTarget("Tesla T4", "7.5", 15360)
    with pytest.raises(PlanError, match="train_batch_size must be >= ppo_mini_batch_size"):
        make_plan(gpu, workload(train_batch_size=16))
    with pytest.raises(PlanError, match="total_training_steps"):
        make_plan(gpu, workload(total_training_steps=0))
    with pytest.raises(PlanError, match="total_epochs"):
        make_plan(gpu, workload(total_epochs=0))
    with pytest.raises(PlanError, match="config.json"):
        make_plan(gpu, workload(model_config={}))


def test_target_from_inventory():
    gpus = tuple(Gpu(i, "Tesla T4", "7.5", 15360, 15102, "535.104.05") for i in range(2))
    t = GpuTarget.from_inventory(GpuInventory(gpus=gpus))
    assert (t.name, t.compute_capability, t.memory_mib, t.count) == ("Tesla T4", "7.5", 15360, 2)
    with pytest.raises(PlanError, match="no usable NVIDIA GPU: the NVIDIA driver is not loaded"):
        GpuTarget.from_inventory(GpuInventory(problem="the NVIDIA driver is not loaded"))
    assert (t.mixed, t.arch_list, t.names) == ((), "7.5", ["Tesla T4"])
    with pytest.raises(PlanError, match="compute capability"):
        GpuTarget.from_inventory(GpuInventory(gpus=(Gpu(0, "Odd GPU", None, 8000, 8000, "470.1"),)))


def test_mixed_box_is_planned_for_its_weakest_gpu():
    """A P40 beside two RTX 3090s: fp32 and the HF rollout (the P40's 6.1), the 3090's 24 GiB
    (the smaller here), all three GPUs in the count, Apex built for both archs, and the plan says so."""
    gpus = (Gpu(0, "NVIDIA GeForce RTX 3090", "8.6", 24576, 24200, "535.104.05"),
            Gpu(1, "Tesla P40", "6.1", 24451, 24400, "535.104.05"),
            Gpu(2, "NVIDIA GeForce RTX 3090", "8.6", 24576, 24200, "535.104.05"))
    t = GpuTarget.from_inventory(GpuInventory(gpus=gpus))
    assert (t.name, t.compute_capability, t.memory_mib, t.count) == ("Tesla P40", "6.1", 24451, 3)
    assert t.arch_list == "6.1;8.6"
    assert t.names == ["NVIDIA GeForce RTX 3090", "Tesla P40"]
    plan = make_plan(t, workload())
    assert (plan.precision.train_dtype, plan.precision.rollout) == ("fp32", "hf")
    gpu_reason = next(r for r in plan.reasons if r.setting == "gpu")
    assert "1 x Tesla P40 (cc 6.1, 24451 MiB); 2 x NVIDIA GeForce RTX 3090 (cc 8.6, 24576 MiB)" in gpu_reason.why
    assert "weakest" in gpu_reason.why
    # the same box's memory is the smaller GPU's even where that is the newer model
    small = (Gpu(0, "Tesla P40", "6.1", 24576, 24400, "535"), Gpu(1, "NVIDIA GeForce RTX 3060", "8.6", 12288, 12000, "535"))
    t = GpuTarget.from_inventory(GpuInventory(gpus=small))
    assert (t.name, t.compute_capability, t.memory_mib, t.count) == ("Tesla P40", "6.1", 12288, 2)
    assert not any(r.setting == "gpu" for r in make_plan(GpuTarget("Tesla P40", "6.1", 24576), workload()).reasons)


# Qwen2.5-3B-Instruct's shape (its config.json): 5.9 GiB of bf16 weights for vLLM
QWEN_3B = {"hidden_size": 2048, "intermediate_size": 11008, "num_hidden_layers": 36, "num_attention_heads": 16,
           "num_key_value_heads": 2, "vocab_size": 151936, "tie_word_embeddings": True, "model_type": "qwen2",
           "max_position_embeddings": 32768}


def test_vllm_tensor_parallel_only_where_one_gpu_cannot_hold_the_rollout():
    """A 3B model on 8 GB RTX 4060s: one card cannot hold vLLM's weights and KV cache beside the
    training (no plan), two can with each engine over both (TP 2); on 12 GB one GPU holds it (TP 1)."""
    rtx4060 = ("NVIDIA GeForce RTX 4060", "8.9", 8188)
    w = workload(model_config=QWEN_3B, total_training_steps=None)
    with pytest.raises(PlanError, match="vLLM cannot hold the rollout: at most 0.9 of the GPU"):
        make_plan(GpuTarget(*rtx4060, 1), w)
    plan = make_plan(GpuTarget(*rtx4060, 2), w)
    ov = overrides_of(plan)
    assert ov["actor_rollout_ref.rollout.tensor_model_parallel_size"] == 2 and plan.memory.rollout_tp == 2
    assert ov["actor_rollout_ref.rollout.engine_kwargs.vllm.max_num_seqs"] == 2 * plan.memory.rollout_micro_batch
    why = next(o.why for o in plan.overrides if o.key.endswith("tensor_model_parallel_size"))
    assert "do not fit one GPU" in why
    one = make_plan(GpuTarget("NVIDIA GeForce RTX 3060", "8.6", 12288, 2), w)
    assert overrides_of(one)["actor_rollout_ref.rollout.tensor_model_parallel_size"] == 1
    # TP splits heads: 2 KV heads allow at most 2; 3 GPUs allow none
    assert rollout_tp_choices(GpuTarget(*rtx4060, 4), w) == [1, 2]
    assert rollout_tp_choices(GpuTarget(*rtx4060, 3), w) == [1]


def test_override_formatting():
    assert Override("trainer.logger", ["console"], "x").text() == "trainer.logger=['console']"
    assert Override("data.filter_overlong_prompts", True, "x").text() == "data.filter_overlong_prompts=True"
    assert Override("actor_rollout_ref.rollout.gpu_memory_utilization", 0.15, "x").text().endswith("=0.15")
    assert Override("critic.model.override_config._attn_implementation", "sdpa", "x").text().startswith("+critic")
    assert format_value("a b") == "'a b'"
    assert format_value("true") == "'true'"
    with pytest.raises(ValueError, match="does nothing"):
        Override("actor_rollout_ref.rollout.max_num_seqs", 8, "x")
    with pytest.raises(ValueError, match="does nothing"):
        Override("actor_rollout_ref.fsdp_config.cpu_offload", True, "x")
    with pytest.raises(ValueError, match="bare key"):
        Override("++trainer.nnodes", 1, "x")


def test_plan_json_has_what_doctor_and_launcher_read():
    p = make_plan(GpuTarget("Tesla T4", "7.5", 15360), workload())
    d = json.loads(json.dumps(p.to_dict()))
    for key in ("rollout", "train_dtype", "attn_implementation", "overrides", "env", "predicted_peak_mib",
                "reasons", "offload", "breakdown", "gpu"):
        assert key in d
    assert set(d["offload"]) == set(OFFLOAD_LADDER)
    assert {"setting", "value", "why"} <= set(d["reasons"][0])
    assert d["overrides"] == p.override_lines


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "tasks.plan", *args], cwd=REPO, capture_output=True, text=True)


def test_cli_json():
    out = _cli("--json", "--gpu-name", "Tesla P40", "--compute-capability", "6.1", "--gpu-memory-mib", "24576")
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    assert (d["rollout"], d["train_dtype"], d["attn_implementation"]) == ("hf", "fp32", "sdpa")
    assert isinstance(d["overrides"], list) and isinstance(d["env"], dict)
    assert isinstance(d["predicted_peak_mib"], int)
    assert all({"setting", "value", "why"} <= set(r) for r in d["reasons"])
    # validation as a box runs it: the data stage's 64 rows, which HF generation chunks divide
    assert "data.val_files=/opt/verl-lab/data/gsm8k/val_small.parquet" in d["overrides"]
    chunk = next(int(o.split("=")[1]) for o in d["overrides"] if o.startswith("+actor_rollout_ref.rollout.micro_batch_size="))
    assert chunk >= 64 or 64 % (64 // chunk) == 0


def test_cli_table_and_errors():
    out = _cli("--gpu-name", "NVIDIA GeForce RTX 3090", "--compute-capability", "8.6", "--gpu-memory-mib", "24576",
               "--gpus", "2")
    assert out.returncode == 0, out.stderr
    assert "2 x NVIDIA GeForce RTX 3090" in out.stdout and "train_dtype" in out.stdout
    assert "# " in out.stdout            # each override with its reason
    bad = _cli("--gpu-name", "x", "--compute-capability", "eight", "--gpu-memory-mib", "1000")
    assert bad.returncode == 2 and "not like 8.6" in bad.stderr
    small = _cli("--gpu-name", "tiny", "--compute-capability", "8.6", "--gpu-memory-mib", "4096")
    assert small.returncode == 2 and "short by" in small.stderr


def test_plan_overrides_for_host_defaults():
    lines = planmod.plan_overrides_for_host(GpuTarget("Tesla T4", "7.5", 15360))
    assert "actor_rollout_ref.rollout.name=vllm" in lines
    assert "actor_rollout_ref.model.path=/opt/verl-lab/models/Qwen--Qwen2.5-0.5B-Instruct" in lines
    assert "trainer.default_local_dir=/opt/verl-lab/train/checkpoints" in lines


def test_offload_rung_comes_after_grpo_and_ranks_by_the_speed_model(monkeypatch):
    """The FSDP2 CPU-offload rung: tried when GRPO on FSDP1 does not fit, at full response length before
    any cut; its search takes the configuration the speed model (tasks/speed.py) ranks fastest among those the
    estimate fits. Where the gather-once knobs (patches 0007-0008) do not fit, every micro-batch moves the weights
    in twice and the gradients out, so the larger micro-batch wins even with checkpointing; where they fit, a
    mini-batch moves them once whatever its micro-batches, and the recomputation decides: no checkpointing."""
    calls = []

    def estimator(knobs_fit: bool):
        def est(gpu, wl, prec, choice):
            calls.append((wl.actor_offload_policy, choice.actor_micro_batch, choice.grad_ckpt))
            knobs = any(getattr(choice, k) for k in OFFLOAD_KNOBS if k != "fused_adamw")   # fused: no GPU memory
            ok = wl.actor_offload_policy and (knobs_fit or not knobs) \
                and (choice.actor_micro_batch <= 4 if choice.grad_ckpt else choice.actor_micro_batch <= 1)
            return MemoryEstimate(peak_mib=1000 if ok else 3000, budget_mib=2000, breakdown={"phase_actor_update": 900})
        return est

    gpu = GpuTarget("NVIDIA GeForce GTX 1080 Ti", "6.1", 11264)
    workload = functools.partial(globals()["workload"], finetune="full")     # LoRA would fit first
    p = make_plan(gpu, workload(), estimator=estimator(False))
    assert p.rung == OFFLOADED and p.workload.max_response_length == 256
    assert (p.memory.actor_micro_batch, p.memory.grad_ckpt) == (4, True)     # not micro-batch 1 without checkpointing
    assert p.memory.fused_adamw and not any(getattr(p.memory, k) for k in OFFLOAD_KNOBS if k != "fused_adamw")
    assert {c[1:] for c in calls if c[0]} >= {(m, ckpt) for m in (16, 8, 4, 2, 1) for ckpt in (False, True)}
    gated = make_plan(gpu, workload(), estimator=estimator(True))     # the update's knobs stay off until measured
    assert {k for k in OFFLOAD_KNOBS if getattr(gated.memory, k)} == set(OFFLOAD_KNOBS) - planmod.UNMEASURED_KNOBS
    monkeypatch.setattr(memory_fit, "UNMEASURED_KNOBS", frozenset())  # once every knob is measured (knob_values reads it)
    q = make_plan(gpu, workload(), estimator=estimator(True))
    assert all(getattr(q.memory, k) for k in OFFLOAD_KNOBS)                   # HF rollout: its knob too
    assert (q.memory.actor_micro_batch, q.memory.grad_ckpt) == (1, False)
    faster = offload_seconds(gpu, q.workload, q.precision, q.memory)["step"]
    assert faster < offload_seconds(gpu, p.workload, p.precision, p.memory)["step"]
    lines = q.override_lines
    for key, _ in OFFLOAD_KNOBS.values():
        assert f"+{key}=True" in lines
    assert f"+{OFFLOAD_KNOBS['rollout_gather_once'][0]}=False" in p.override_lines
    rung = next(r for r in p.reasons if r.setting == "rung")
    assert "CPUOffloadPolicy" in rung.why and "PCIe" in rung.why and "critic" in rung.why and "grpo is short by" in rung.why
    micro = next(r for r in p.reasons if r.setting == "micro_batches")
    assert "PCIe" in micro.why and "speed model" in micro.why
    speed = next(r for r in q.reasons if r.setting == "offload_speed_knobs")
    assert "s a step" in speed.why and "accumulate_grads_unsharded" in speed.value
    # algorithm = "grpo" gets the offload rung too; "ppo" never does (verl 0.5.0 cannot FSDP2-wrap the critic)
    assert make_plan(GpuTarget("NVIDIA GeForce GTX 1080 Ti", "6.1", 11264), workload(algorithm="grpo")).rung == OFFLOADED
    with pytest.raises(PlanError, match=r"Rungs tried: ppo short by \d+ MiB\. "):
        make_plan(GpuTarget("NVIDIA GeForce GTX 1080 Ti", "6.1", 11264), workload(algorithm="ppo"))
