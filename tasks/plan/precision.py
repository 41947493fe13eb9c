"""Precision and rollout engine, from the GPU's compute capability: bf16 or fp32 training, vLLM or
the HF-transformers rollout and its dtype, the attention kernel, torch.compile
(``choose_precision``); which vLLM 0.8.5 engine runs there (``vllm_engine``: V1 from 8.0, V0
below); a rollout asked for that the GPU cannot run (``rollout_refusal``). docs/plan.md gives the
reason for each."""

from __future__ import annotations

from tasks.plan.terms import GpuTarget, PlanError, Precision, Reason
from tasks.verl import VERL_VERSION


def vllm_engine(gpu: GpuTarget) -> str:
    """The engine vLLM 0.8.5 runs on this GPU: ``v1`` on compute capability >= 8.0 (its default
    there), ``v0`` below (V1 refuses < 8.0: ``EngineArgs._is_v1_supported_oracle``)."""
    return "v1" if gpu.cc >= (8, 0) else "v0"


ROLLOUT_ENGINES = ("auto", "vllm", "hf")      # workload.rollout (tasks/settings/workload.py WORKLOAD_ROLLOUTS)
VLLM_MIN_CC = (7, 0)


def rollout_refusal(rollout_engine: str, gpu: GpuTarget) -> tuple[str, str] | None:
    """(why, fix) where ``rollout_engine`` cannot run on ``gpu``; None where it can. vLLM 0.8.5
    needs compute capability >= 7.0 (its installation requirements: no vLLM on Pascal)."""
    if rollout_engine not in ROLLOUT_ENGINES:
        return f"{rollout_engine!r} is not one of {', '.join(ROLLOUT_ENGINES)}", "set workload.rollout to one of them"
    if rollout_engine == "vllm" and gpu.cc < VLLM_MIN_CC:
        return (f"vLLM 0.8.5 needs compute capability >= 7.0, and {gpu.name} has {gpu.compute_capability}",
                "set workload.rollout to 'auto' or 'hf' (the HF-transformers rollout runs on every GPU)")
    return None


def choose_precision(gpu: GpuTarget, flash_attn_installed: bool = False,
                     rollout_engine: str = "auto") -> tuple[Precision, list[Reason]]:
    refusal = rollout_refusal(rollout_engine, gpu)
    if refusal:
        raise PlanError(f"workload.rollout = {rollout_engine!r}: {refusal[0]}.", fix=refusal[1], key="workload.rollout")
    cc = gpu.cc
    ccs = gpu.compute_capability
    reasons: list[Reason] = []
    if cc >= (8, 0):
        train = "bf16"
        reasons.append(Reason("train_dtype", train, f"compute capability {ccs} >= 8.0 has bf16: FSDP mixed "
                                                    "precision with bf16 params, fp32 gradient reduction"))
    else:
        train = "fp32"
        reasons.append(Reason("train_dtype", train, f"compute capability {ccs} < 8.0 has no bf16, and verl "
                                                    f"{VERL_VERSION} has no loss scaling for fp16 training: fp32"))
    if cc >= VLLM_MIN_CC and rollout_engine != "hf":
        rollout = "vllm"
        rdtype = "bfloat16" if cc >= (8, 0) else "float16"
        asked = " (workload.rollout = 'vllm')" if rollout_engine == "vllm" else ""
        reasons.append(Reason("rollout", rollout, f"vLLM runs on compute capability >= 7.0 ({ccs}){asked}; "
                                                  f"engine {vllm_engine(gpu).upper()} on this GPU"))
        reasons.append(Reason("rollout_dtype", rdtype,
                              "bf16 generation on sm80+" if rdtype == "bfloat16"
                              else f"no bf16 on {ccs}; fp16 is fast there and fine for generation"))
    elif cc >= VLLM_MIN_CC:
        rollout = "hf"
        rdtype = "bfloat16" if cc >= (8, 0) else "float16"
        reasons.append(Reason("rollout", rollout, "the HF-transformers rollout was asked for (workload.rollout = "
                                                  f"'hf') although vLLM runs on {ccs}: no vLLM share, no vLLM in "
                                                  "the env; generation is slower"))
        reasons.append(Reason("rollout_dtype", rdtype, "generation under autocast in the GPU's fast half "
                                                       "precision over the training weights"))
    else:
        rollout = "hf"
        rdtype = "float32"
        reasons.append(Reason("rollout", rollout, f"vLLM needs compute capability >= 7.0; {ccs} gets the "
                                                  f"HF-transformers rollout (verl {VERL_VERSION} still has it)"))
        reasons.append(Reason("rollout_dtype", rdtype, f"no bf16 on {ccs}, and generation runs on the fp32 "
                                                       "training weights"))
    if flash_attn_installed and cc >= (8, 0):
        attn = "flash_attention_2"
        reasons.append(Reason("attn_implementation", attn, "flash-attn is installed and the GPU is sm80+"))
    else:
        attn = "sdpa"
        why = ("PyTorch's sdpa runs on every GPU (a flash kernel on sm80+, memory-efficient/math below); "
               + ("flash-attn is not installed" if cc >= (8, 0) else f"FlashAttention 2 needs sm80+, this is {ccs}"))
        reasons.append(Reason("attn_implementation", attn, why))
    compile_ok = cc >= (7, 0)
    reasons.append(Reason("use_torch_compile", compile_ok,
                          "Triton supports this GPU" if compile_ok
                          else f"Triton refuses compute capability {ccs} < 7.0"))
    return Precision(train, rollout, rdtype, attn, compile_ok), reasons
