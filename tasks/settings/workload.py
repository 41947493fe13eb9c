"""What to train, as one host's data says it: the ``workload`` setting (its keys, defaults and
values; LoRA's ``finetune`` and ``target_modules``), ``workload.model`` (a catalog model) and
``gpu_override`` (plan for this GPU instead of the box's own): the plan's inputs (tasks/plan/,
docs/plan.md). Checkers in ``tasks.settings``' form: ``check(host, *values)``, raising
``SettingsError``/``SettingsErrors``; ``load_settings`` runs them.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import Any

from tasks.facts.gpu import parse_compute_capability
from tasks.settings.errors import SettingsError, SettingsErrors, did_you_mean

# workload keys and their defaults: verl's GSM8K quick start, one epoch, the plan's fallback ladder
WORKLOAD_DEFAULTS: dict[str, Any] = {"algorithm": "auto", "model": None, "train_batch_size": 256,
                                     "ppo_mini_batch_size": 64, "max_prompt_length": 256, "max_response_length": 256,
                                     "epochs": 1, "rollout": "auto",
                                     # LoRA (tasks/plan/lora.py, docs/plan.md "LoRA"): auto trains LoRA where full
                                     # fine-tuning needs the CPU-offload rung or does not fit, full where it fits
                                     "finetune": "auto", "lora_rank": 32, "lora_alpha": 32,
                                     "target_modules": "all-linear"}
# the keys that are not positive integers
WORKLOAD_WORDS = ("algorithm", "model", "rollout", "finetune", "target_modules")
WORKLOAD_FINETUNES = ("auto", "full", "lora")
# the linear layers of a Qwen2/Llama decoder layer that LoRA may target (PEFT's "all-linear" takes them all)
LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
WORKLOAD_ALGORITHMS = ("auto", "ppo", "grpo")   # auto: PPO, else GRPO, else GRPO with shorter responses
# auto: vLLM where the GPU runs it (compute capability >= 7.0), else the HF rollout; vllm: vLLM or
# this box fails (tasks.plan.rollout_refusal); hf: the HF-transformers rollout, and no vLLM in the env
WORKLOAD_ROLLOUTS = ("auto", "vllm", "hf")
GPU_OVERRIDE_KEYS = ("name", "compute_capability", "memory_mib", "count")



def _gpu_override(host: str, value: Any) -> dict[str, Any] | None:
    if value is None:
        return None
    example = '{"name": "Tesla T4", "compute_capability": "7.5", "memory_mib": 15360, "count": 1}'
    if not isinstance(value, Mapping) or not set(GPU_OVERRIDE_KEYS[:3]) <= set(value) \
            or set(value) - set(GPU_OVERRIDE_KEYS):
        raise SettingsError(host, "gpu_override", f"{value!r} is not a GPU description", f"use e.g. {example}")
    cc = str(value["compute_capability"])
    count = value.get("count", 1)
    found = []
    try:
        parse_compute_capability(cc)
    except ValueError:
        found.append(SettingsError(host, "gpu_override", f"compute_capability {cc!r} is not like 8.6",
                                   f"use e.g. {example}"))
    for key, num in (("memory_mib", value["memory_mib"]), ("count", count)):
        if not isinstance(num, int) or isinstance(num, bool) or num < 1:
            found.append(SettingsError(host, "gpu_override", f"{key} {num!r} is not a positive integer",
                                       f"use e.g. {example}"))
    if not isinstance(value["name"], str) or not value["name"].strip():
        found.append(SettingsError(host, "gpu_override", f"name {value['name']!r} is not the GPU's name",
                                   f"use e.g. {example}"))
    if found:
        raise SettingsErrors(found)
    return {"name": value["name"], "compute_capability": cc, "memory_mib": value["memory_mib"], "count": count}


def _workload(host: str, value: Any) -> dict[str, Any]:
    example = "workload = {'algorithm': 'grpo', 'max_response_length': 192, 'epochs': 2}"
    if not isinstance(value, Mapping):
        raise SettingsError(host, "workload", f"{value!r} is not a mapping", f"use e.g. {example}")
    found = []
    for key in value:
        if key not in WORKLOAD_DEFAULTS:
            close = difflib.get_close_matches(str(key), sorted(WORKLOAD_DEFAULTS), n=1, cutoff=0.6)
            found.append(SettingsError(host, f"workload.{key}", "not a workload key",
                                       f"did you mean workload.{close[0]}?" if close
                                       else f"use one of {', '.join(WORKLOAD_DEFAULTS)}"))
    w = {**WORKLOAD_DEFAULTS, **{k: v for k, v in value.items() if k in WORKLOAD_DEFAULTS}}
    if w["algorithm"] not in WORKLOAD_ALGORITHMS:
        found.append(SettingsError(host, "workload.algorithm", f"{w['algorithm']!r} is not one of auto, ppo, grpo",
                                   f"{did_you_mean(w['algorithm'], WORKLOAD_ALGORITHMS)}set it to auto (PPO, else GRPO, else shorter responses: what fits), ppo or grpo"))
    if w["rollout"] not in WORKLOAD_ROLLOUTS:
        found.append(SettingsError(host, "workload.rollout", f"{w['rollout']!r} is not one of auto, vllm, hf",
                                   f"{did_you_mean(w['rollout'], WORKLOAD_ROLLOUTS)}set it to auto (vLLM where the GPU runs it, else the HF rollout), vllm (vLLM, "
                                   "on compute capability >= 7.0 only) or hf (the HF-transformers rollout, on any GPU)"))
    found += _finetune(host, w)
    bad = set()
    for key, default in WORKLOAD_DEFAULTS.items():
        if key not in WORKLOAD_WORDS and (not isinstance(w[key], int) or isinstance(w[key], bool) or w[key] < 1):
            bad.add(key)
            found.append(SettingsError(host, f"workload.{key}", f"{w[key]!r} is not a positive integer",
                                       f"set it to a positive integer (default {default})"))
    if not bad & {"ppo_mini_batch_size", "train_batch_size"} and w["ppo_mini_batch_size"] > w["train_batch_size"]:
        found.append(SettingsError(host, "workload.ppo_mini_batch_size", f"{w['ppo_mini_batch_size']} is more than "
                                   f"train_batch_size {w['train_batch_size']}",
                                   "make it at most workload.train_batch_size"))
    if found:
        raise SettingsErrors(found)
    return w


def _finetune(host: str, w: dict[str, Any]) -> list[SettingsError]:
    """workload.finetune and LoRA's target_modules (rank and alpha are positive integers, checked with the others)."""
    found = []
    if w["finetune"] not in WORKLOAD_FINETUNES:
        close = difflib.get_close_matches(str(w["finetune"]).strip().lower(), WORKLOAD_FINETUNES, n=1, cutoff=0.5)
        found.append(SettingsError(host, "workload.finetune", f"{w['finetune']!r} is not one of auto, full, lora",
                                   (f"did you mean {close[0]!r}? " if close else "")
                                   + "set it to auto (LoRA where full fine-tuning needs the CPU-offload rung or does "
                                   "not fit, else full), full (every weight trained) or lora (adapters only)"))
    mods = w["target_modules"]
    if mods != "all-linear":
        names = [mods] if isinstance(mods, str) else mods
        if not isinstance(names, (list, tuple)) or not names or not all(isinstance(m, str) for m in names):
            found.append(SettingsError(host, "workload.target_modules", f"{mods!r} is not 'all-linear' or a list of "
                                       "module names",
                                       f"use 'all-linear' (the default) or a list of {', '.join(LORA_MODULES)}"))
        else:
            for m in names:
                if m not in LORA_MODULES:
                    close = difflib.get_close_matches(m, LORA_MODULES, n=1, cutoff=0.6)
                    found.append(SettingsError(host, "workload.target_modules", f"{m!r} is not a linear layer of the "
                                               "model's decoder", (f"did you mean {close[0]!r}? " if close else "")
                                               + f"use 'all-linear' or names of {', '.join(LORA_MODULES)}"))
            if not found:
                w["target_modules"] = "all-linear" if set(names) == set(LORA_MODULES) \
                    else [m for m in LORA_MODULES if m in names]
    return found


def _workload_model(host: str, cat, value: Any, model_artifact: Any, set_artifact: bool) -> str:
    """workload.model: a model artifact of the catalog, by its name or its Hugging Face repo."""
    if value is None:
        return model_artifact
    found = cat.model(value)
    if found is None:
        models = {name: a for name, a in cat.artifacts.items() if a.kind == "hf-model"}
        listed = ", ".join(f"{a.repo} ({name})" for name, a in sorted(models.items()))
        raise SettingsError(host, "workload.model", f"{value!r} is not a model of files/catalog.toml",
                            f"use one of {listed}; another model needs a catalog entry (repo, revision, sha256) "
                            "and its config.json under files/models/")
    if set_artifact and model_artifact != found.name:
        raise SettingsError(host, "workload.model", f"{value!r} and model_artifact {model_artifact!r} name two "
                            "models", "set only workload.model")
    return found.name
