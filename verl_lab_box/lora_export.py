"""The end product of a LoRA run: the adapter merged into the base (a full Hugging Face model) and the adapter
alone in PEFT's format, made from a verl 0.5.0 actor checkpoint after verl's own model merger, and proven.

What verl 0.5.0 saves with LoRA (``actor_rollout_ref.model.lora_rank`` > 0): the actor's shards
(``actor/model_world_size_W_rank_r.pt``) hold the whole PEFT model under PEFT's names
(``base_model.model.<module>.base_layer.weight`` for each adapted linear layer, ``...lora_A.default.weight`` and
``...lora_B.default.weight`` beside it, ``base_model.model.<name>`` for the rest), and ``save_checkpoint`` writes
``actor/lora_adapter/`` (``adapter_config.json``: the run's rank, alpha and target modules;
``adapter_model.safetensors``). verl's model merger (verl/model_merger/base_model_merger.py,
``save_lora_adapter``) takes the LoRA tensors out of the state dict into ``<target>/lora_adapter/`` and saves the
rest, renamed, as the model: the folder it writes is the **base model, without the adapter**, and its
``adapter_config.json`` says ``lora_alpha: 0`` (PEFT's scaling alpha/r is then 0: the adapter does nothing),
its adapter tensors cast to bf16. So after the merger, for a LoRA checkpoint, ``finish`` (called by export.py):

1. rewrites the folder's ``*.safetensors`` with the merged weights: each adapted layer's W + (B @ A) * scaling
   (scaling = lora_alpha / r, or / sqrt(r) with rsLoRA: PEFT's) from the shards, computed in fp32 and rounded once
   to the dtype the merger wrote, as PEFT merges fp32 adapters (peft keeps them fp32 on a bf16 or fp16 base: the
   product and the sum in fp32, one rounding); the same names, files and dtypes (its index stays true);
2. replaces the merger's ``lora_adapter/`` with the adapter from the shards in their dtype under the run's own
   ``adapter_config.json`` (verl's save, ``inference_mode`` true as PEFT saves it), its base model named by the
   catalog's repository and pinned revision (``base_model_name_or_path``, ``revision``) instead of the box's model
   folder verl wrote there, so that ``AutoPeftModelForCausalLM.from_pretrained(folder)`` finds the base anywhere;
   PEFT's ``PeftModel.from_pretrained(base, folder)`` loads it on the base model. The repository and revision are
   export.py's ``--base-model REPO@REVISION`` where given, else the stamp the data stage wrote beside the model
   folder the run trained from (``<model folder>.verified.json``, verl_lab_box/hf_snapshot.py ``stamp_path``:
   the catalog's repo and revision the folder was proven against); with neither (a checkpoint copied off its
   box) the folder's path stays, and the record and the log say so.

``prove`` then shows, on the CPU in fp32: the folder's tensors equal the merge computed here, bit for bit; the
adapter folder loads with PEFT onto the checkpoint's base weights; the merged model's logits (loaded by
transformers from the folder) equal the adapter model's (base + adapter through PEFT, merged by PEFT's own
``merge_and_unload`` and rounded to the folder's dtype) within the tolerance; the difference to the adapter model
in fp32 (the folder dtype's rounding) and to the base model (what training changed) are recorded.

Standard library at import time; torch, safetensors, transformers and peft are imported inside the functions
(the training env's Python runs them).
"""

from __future__ import annotations

import json
import os
import re
import shutil

ADAPTER_DIR = "lora_adapter"          # verl's save_checkpoint (actor/) and model merger (target/) both use it
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."     # PEFT's name for the wrapped model
ADAPTER_NAME = "default"              # verl's get_peft_model: one adapter, PEFT's default name
LOGIT_TOLERANCE = 1e-3


COMMIT = re.compile(r"[0-9a-f]{40}")     # a pinned revision, as the catalog and hf_snapshot insist
STAMP_SUFFIX = ".verified.json"     # verl_lab_box/hf_snapshot.py stamp_path: <model folder><suffix>
DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}      # safetensors' names, torch's


class LoraExportError(Exception):
    """A LoRA checkpoint cannot become a proven export; the message says which file and what to do."""


def is_lora_checkpoint(actor_dir: str) -> bool:
    """verl wrote its adapter folder beside the actor's shards (a LoRA run)."""
    return os.path.isfile(os.path.join(actor_dir, ADAPTER_DIR, ADAPTER_CONFIG))


def adapter_config(actor_dir: str) -> dict:
    """The run's adapter config as verl saved it (actor/lora_adapter/adapter_config.json), checked to be one
    this merge computes exactly: LoRA, rank and alpha set, no DoRA, biases, extra trained modules or per-layer
    ranks."""
    path = os.path.join(actor_dir, ADAPTER_DIR, ADAPTER_CONFIG)
    try:
        with open(path) as fh:
            config = json.load(fh)
    except (OSError, ValueError) as exc:
        raise LoraExportError(f"{path}: {exc}: verl's save_checkpoint writes it for a LoRA run; without it the "
                              "adapter's alpha is unknown (re-save the checkpoint from the run)") from None
    problems = []
    if config.get("peft_type") != "LORA":
        problems.append(f"peft_type {config.get('peft_type')!r}, not 'LORA'")
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(rank, int) or rank <= 0:
        problems.append(f"r {rank!r} is not a positive integer")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or alpha <= 0:
        problems.append(f"lora_alpha {alpha!r} is not positive (verl's model merger writes 0: a merger's "
                        "adapter_config.json, not the run's?)")
    for key, fine in (("use_dora", False), ("fan_in_fan_out", False), ("bias", "none")):
        if config.get(key, fine) != fine:
            problems.append(f"{key} {config.get(key)!r} (only {fine!r} is merged here)")
    for key in ("modules_to_save", "rank_pattern", "alpha_pattern", "layer_replication"):
        if config.get(key):
            problems.append(f"{key} is set (not merged here)")
    if problems:
        raise LoraExportError(f"{path}: " + "; ".join(problems))
    return config


def scaling(config: dict) -> float:
    """PEFT's LoRA scaling: lora_alpha / r, or lora_alpha / sqrt(r) with rsLoRA."""
    rank, alpha = config["r"], config["lora_alpha"]
    return alpha / rank ** 0.5 if config.get("use_rslora") else alpha / rank


def split(weights: dict) -> tuple[dict, dict]:
    """The checkpoint's full weights (PEFT's names) as (base weights under the Hugging Face model's names,
    {adapted module: (lora_A weight, lora_B weight)})."""
    base, parts = {}, {}
    for key, tensor in weights.items():
        if not key.startswith(PEFT_PREFIX):
            raise LoraExportError(f"{key}: not a PEFT model's parameter (no {PEFT_PREFIX!r}): not a LoRA checkpoint")
        name = key[len(PEFT_PREFIX):]
        for which in ("lora_A", "lora_B"):
            tail = f".{which}.{ADAPTER_NAME}.weight"
            if name.endswith(tail):
                parts.setdefault(name[:-len(tail)], {})[which] = tensor
                break
        else:
            if ".lora_" in name:
                raise LoraExportError(f"{key}: a LoRA tensor this merge does not know (embedding adapters, "
                                      "a second adapter, LoRA biases?)")
            base[name.replace(".base_layer.", ".")] = tensor
    adapters = {}
    for module, pair in sorted(parts.items()):
        if set(pair) != {"lora_A", "lora_B"}:
            raise LoraExportError(f"{module}: has {sorted(pair)} only; LoRA needs both A and B")
        if f"{module}.weight" not in base:
            raise LoraExportError(f"{module}: an adapter without its base layer's weight in the checkpoint")
        adapters[module] = (pair["lora_A"], pair["lora_B"])
    if not adapters:
        raise LoraExportError("the checkpoint holds no LoRA tensors (lora_A/lora_B): not a LoRA checkpoint")
    return base, adapters


def merged_weights(weights: dict, config: dict, dtype=None) -> dict:
    """The Hugging Face model's weights with every adapter merged: W + (B @ A) * scaling as PEFT's merge computes it
    for fp32 adapters (the product, its scaling and the sum in fp32), rounded once to ``dtype`` (a torch dtype;
    default: W's own). The other weights as they are."""
    base, adapters = split(weights)
    scale = scaling(config)
    merged = dict(base)
    for module, (a, b) in adapters.items():
        w = base[f"{module}.weight"]
        if tuple(b.shape[:1]) + tuple(a.shape[1:]) != tuple(w.shape) or a.shape[0] != b.shape[1]:
            raise LoraExportError(f"{module}: lora_B {tuple(b.shape)} @ lora_A {tuple(a.shape)} does not make the "
                                  f"base weight's {tuple(w.shape)}")
        delta = b.float() @ a.float()
        merged[f"{module}.weight"] = delta.mul_(scale).add_(w).to(dtype or w.dtype)
    return merged


def adapter_tensors(weights: dict) -> dict:
    """The adapter alone under PEFT's saved names (the adapter name dropped, as PEFT's save_pretrained does)."""
    _, adapters = split(weights)
    out = {}
    for module, (a, b) in adapters.items():
        out[f"{PEFT_PREFIX}{module}.lora_A.weight"] = a.contiguous()
        out[f"{PEFT_PREFIX}{module}.lora_B.weight"] = b.contiguous()
    return out


def _safetensors_files(folder: str) -> list[str]:
    return sorted(os.path.join(folder, n) for n in os.listdir(folder) if n.endswith(".safetensors"))


def write_merged(export: str, merged: dict, adapted_modules) -> int:
    """Rewrite each ``*.safetensors`` of the merger's folder with the merged weights: the same tensor names,
    files, dtypes and metadata; returns the tensors replaced. Every tensor of the files must have a merged
    counterpart and every adapted module's weight must be in a file."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    files = _safetensors_files(export)
    if not files:
        raise LoraExportError(f"{export} holds no *.safetensors: did verl's model merger run?")
    seen = set()
    for path in files:
        with safe_open(path, "pt") as fh:
            metadata = fh.metadata()
            stored = {key: fh.get_tensor(key) for key in fh.keys()}
        unknown = sorted(set(stored) - set(merged))
        if unknown:
            raise LoraExportError(f"{path} holds {unknown[:5]}, which the checkpoint does not: another model's folder?")
        out = {key: merged[key].to(t.dtype).contiguous() for key, t in stored.items()}
        for key, t in stored.items():
            if tuple(t.shape) != tuple(out[key].shape):
                raise LoraExportError(f"{path}: {key} has shape {tuple(t.shape)}, the checkpoint "
                                      f"{tuple(out[key].shape)}")
        part = path + ".part"
        save_file(out, part, metadata=metadata)
        os.replace(part, path)
        seen.update(stored)
    adapted = {f"{module}.weight" for module in adapted_modules}
    if adapted - seen:
        raise LoraExportError(f"{export}'s files lack the adapted weights {sorted(adapted - seen)[:5]}")
    return len(seen)


def folder_dtype(export: str):
    """The torch dtype of the merger's folder (every tensor's: safetensors headers)."""
    import torch
    from safetensors import safe_open

    found = set()
    for path in _safetensors_files(export):
        with safe_open(path, "pt") as fh:
            found.update(fh.get_slice(key).get_dtype() for key in fh.keys())
    if len(found) != 1 or not found <= set(DTYPES):
        raise LoraExportError(f"{export} holds tensors of {sorted(found) or 'no'} dtype(s): verl's merger writes one "
                              "(bf16)")
    return getattr(torch, DTYPES[found.pop()])


def base_model(config: dict, given: str | None = None) -> dict:
    """The base model the adapter names: {"repo", "revision", "source"} from ``given`` ("REPO@REVISION", export.py's
    ``--base-model``), else the data stage's stamp beside the model folder in the run's adapter config
    (``base_model_name_or_path``: the folder verl trained from); else the folder itself (revision None)."""
    if given:
        repo, _, revision = given.partition("@")
        if repo.count("/") != 1 or not COMMIT.fullmatch(revision):
            raise LoraExportError(f"--base-model {given!r}: give the catalog's repository and pinned revision, "
                                  "REPO@COMMIT (e.g. Qwen/Qwen2.5-0.5B-Instruct@<its 40-digit commit>)")
        return {"repo": repo, "revision": revision, "source": "--base-model"}
    folder = str(config.get("base_model_name_or_path") or "")
    stamp = folder.rstrip("/") + STAMP_SUFFIX
    try:
        with open(stamp) as fh:
            found = json.load(fh)
        if found.get("repo") and found.get("revision") and found.get("repo_type", "model") == "model":
            return {"repo": found["repo"], "revision": found["revision"], "source": stamp}
    except (OSError, ValueError, AttributeError):
        pass
    return {"repo": folder, "revision": None, "source": None}


def write_adapter(dest: str, weights: dict, config: dict, base: dict | None = None) -> dict:
    """The adapter alone in PEFT's format in ``dest`` (replaced): adapter_model.safetensors (the shards' tensors,
    their dtype) and adapter_config.json (the run's, ``inference_mode`` true as PEFT's save_pretrained writes, its
    base model ``base``'s repo and revision where known)."""
    from safetensors.torch import save_file

    tensors = adapter_tensors(weights)
    if os.path.isdir(dest):
        shutil.rmtree(dest)
    os.makedirs(dest)
    save_file(tensors, os.path.join(dest, ADAPTER_WEIGHTS), metadata={"format": "pt"})
    named = {"base_model_name_or_path": base["repo"], "revision": base["revision"]} if base and base["source"] else {}
    with open(os.path.join(dest, ADAPTER_CONFIG), "w") as fh:
        # runtime_config: PEFT keeps it out of saved configs (it warns on loading one)
        json.dump({**{k: v for k, v in config.items() if k != "runtime_config"}, "inference_mode": True, **named},
                  fh, indent=2, sort_keys=True)
        fh.write("\n")
    return {"adapter_tensors": len(tensors), "adapter_params": sum(t.numel() for t in tensors.values()),
            "adapter_bytes": sum(os.path.getsize(os.path.join(dest, n)) for n in os.listdir(dest))}


def verl_adapter_gap(actor_dir: str, weights: dict) -> float | None:
    """The largest difference between verl's own actor/lora_adapter tensors and the shards' (None: verl saved
    none); a save verl got wrong shows here."""
    from safetensors.torch import load_file

    path = os.path.join(actor_dir, ADAPTER_DIR, ADAPTER_WEIGHTS)
    if not os.path.isfile(path):
        return None
    saved, want = load_file(path), adapter_tensors(weights)
    if set(saved) != set(want):
        raise LoraExportError(f"{path} names other tensors than the shards' adapter ({len(saved)} against "
                              f"{len(want)}): a checkpoint of another run?")
    return max(float((saved[k].float() - want[k].float()).abs().max()) for k in want)


def finish(actor_dir: str, export: str, weights: dict, base_model_given: str | None = None) -> dict:
    """After verl's model merger wrote ``export`` from ``actor_dir``: the merged weights into its files, the
    adapter (PEFT's format) into ``export/lora_adapter``. ``weights``: the checkpoint's full weights
    (export.full_weights); ``base_model_given``: export.py's ``--base-model``. Returns facts for the proof's
    record."""
    config = adapter_config(actor_dir)
    merged = merged_weights(weights, config, folder_dtype(export))
    replaced = write_merged(export, merged, split(weights)[1])
    del merged
    base = base_model(config, base_model_given)
    if not base["source"]:
        print(f"verl-lab export: the adapter's base model stays {base['repo']!r} (a folder of this box): no "
              f"--base-model and no {base['repo'].rstrip('/')}{STAMP_SUFFIX} (the data stage's stamp); "
              "AutoPeftModelForCausalLM will not find it elsewhere", flush=True)
    facts = write_adapter(os.path.join(export, ADAPTER_DIR), weights, config, base)
    return {"lora_rank": config["r"], "lora_alpha": config["lora_alpha"], "lora_scaling": scaling(config),
            "lora_modules": len(split(weights)[1]), "merged_tensors": replaced,
            "adapter_base_model": base["repo"], "adapter_base_revision": base["revision"],
            "adapter_base_model_from": base["source"],
            "verl_adapter_max_abs_diff": verl_adapter_gap(actor_dir, weights), **facts}


def _logits(model, inputs: list) -> list:
    import torch

    with torch.no_grad():
        return [model(input_ids=ids, use_cache=False).logits.float() for ids in inputs]


def _max_diff(a: list, b: list) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


def prove(export: str, actor_dir: str, weights: dict, prompts: list[str],
          tolerance: float = LOGIT_TOLERANCE) -> dict:
    """The merged folder holds the merge of the checkpoint's base and adapter bit for bit in its dtype, its
    adapter folder loads with PEFT, and the merged model's logits equal the adapter model's (PEFT) within
    ``tolerance``. Raises LoraExportError with what differs; returns the measured differences."""
    import torch
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = adapter_config(actor_dir)
    dtype = folder_dtype(export)
    merged = merged_weights(weights, config, dtype)
    stored = {}
    for path in _safetensors_files(export):
        stored.update(load_file(path))
    worst, worst_key = 0.0, None
    for key, t in stored.items():
        if key not in merged:
            raise LoraExportError(f"{export} holds {key}, which the checkpoint does not")
        d = float((t.float() - merged[key].to(dtype).float()).abs().max()) if t.numel() else 0.0
        if d > worst:
            worst, worst_key = d, key
    if worst > 0:
        raise LoraExportError(f"{export}'s {worst_key} differs from the checkpoint's merged weight (in {dtype}) by "
                              f"{worst:.3g}: not the merged model (verl's merger alone writes the base)")
    del stored

    tokenizer = AutoTokenizer.from_pretrained(export)
    inputs = [tokenizer(tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                                      tokenize=False), return_tensors="pt",
                        add_special_tokens=False)["input_ids"] for p in prompts]
    loaded = AutoModelForCausalLM.from_pretrained(export, torch_dtype=torch.float32, attn_implementation="eager")
    got = _logits(loaded.eval(), inputs)
    del loaded
    base, _ = split(weights)
    hf_config = AutoConfig.from_pretrained(os.path.join(actor_dir, "huggingface"))
    model = AutoModelForCausalLM.from_config(hf_config, torch_dtype=torch.float32, attn_implementation="eager")
    model.load_state_dict({k: v.to(torch.float32) for k, v in base.items()}, strict=True)
    base_logits = _logits(model.eval(), inputs)
    adapter_dir = os.path.join(export, ADAPTER_DIR)
    try:
        peft_model = PeftModel.from_pretrained(model, adapter_dir)
    except (OSError, RuntimeError, ValueError, KeyError) as exc:
        raise LoraExportError(f"PEFT cannot load {adapter_dir}: {type(exc).__name__}: {exc}") from None
    adapter_logits = _logits(peft_model.eval(), inputs)
    unmerged = peft_model.merge_and_unload()           # PEFT's own merge, in fp32
    with torch.no_grad():
        for p in unmerged.parameters():
            p.copy_(p.to(dtype).to(torch.float32))      # rounded as the folder's dtype rounds it
    peft_merged = _logits(unmerged.eval(), inputs)
    diff = _max_diff(got, peft_merged)
    if diff > tolerance:
        raise LoraExportError(f"the merged model's logits differ from the adapter model's (PEFT's merge, in "
                              f"{dtype}) by {diff:.3g}, more than {tolerance}")
    # the keys of export.prove's record, so that the proof file and its log line read the same for both
    return {"export_dtype": str(dtype).removeprefix("torch."), "tensors": len(merged),
            "max_abs_weight_diff": worst, "max_abs_weight_diff_key": worst_key,
            "prompts": len(inputs), "prompt_tokens": sum(int(i.shape[1]) for i in inputs),
            "max_abs_logit_diff": diff, "logit_tolerance": tolerance,
            # against the adapter model in the checkpoint's fp32: the folder dtype's rounding
            "max_abs_logit_diff_vs_checkpoint_dtype": _max_diff(got, adapter_logits),
            "lora_max_abs_logit_diff_adapter_vs_base": _max_diff(adapter_logits, base_logits)}


def export_and_prove(actor_dir: str, export: str, weights: dict, prompts: list[str],
                     base_model_given: str | None = None) -> dict:
    """``finish`` then ``prove``: what export.py calls after verl's merger for a LoRA checkpoint."""
    facts = finish(actor_dir, export, weights, base_model_given)
    return {**facts, **prove(export, actor_dir, weights, prompts)}
