"""Did the burn-in's updates reach the weights, and only those they may? The saved actor against the model folder.

    <env>/bin/python verl_lab_burnin_weights.py --actor DIR/global_step_N/actor --model MODEL_DIR

Placed by the burn-in stage as ``<train_dir>/verl_lab_burnin_weights.py`` beside the export's proof
(``verl_lab_export_proof.py``, whose ``full_weights`` rebuilds every parameter from the ranks' shards); the
launcher's burn-in runs it with the env's Python on the step it exported. Each parameter of the checkpoint that
the model folder also holds (PEFT's names mapped back: ``base_model.model.`` and ``.base_layer.`` dropped) is
compared with the folder's tensor cast to the checkpoint's dtype:

* full fine-tuning: some parameter must differ (``weights-unmoved`` otherwise: no optimizer step reached them);
* LoRA: every base parameter must equal the folder's bit for bit, the frozen base (``lora-base-moved``
  otherwise: e.g. a rollout that merged the adapter into the weights and did not restore them), and an adapter's
  B matrix must be non-zero (it starts at zero: ``weights-unmoved`` otherwise).

Prints one JSON line: the check (``id``, ``ok``, ``words``), the counts, and the env's versions of torch,
transformers, peft, safetensors and verl (the burn-in record keeps them).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys

SIBLINGS = {"verl_lab_export_proof": ("verl_lab_export_proof.py", "export_proof.py"),
            "verl_lab_lora_export": ("verl_lab_lora_export.py", "lora_export.py")}
VERSIONED = ("torch", "transformers", "peft", "safetensors", "verl")


def sibling(name: str):
    if name in sys.modules:
        return sys.modules[name]
    here = os.path.dirname(os.path.abspath(__file__))
    path = next((os.path.join(here, n) for n in SIBLINGS[name] if os.path.isfile(os.path.join(here, n))), None)
    if path is None:
        raise ImportError(f"no {' or '.join(SIBLINGS[name])} beside {os.path.abspath(__file__)}: run deploy/burnin.py")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def folder_name(key: str) -> str:
    """A checkpoint parameter's name as the model folder has it."""
    return key.removeprefix("base_model.model.").replace(".base_layer.", ".")


def model_tensors(model_dir: str) -> dict:
    from safetensors.torch import load_file

    found = {}
    for name in sorted(os.listdir(model_dir)):
        if name.endswith(".safetensors"):
            found.update(load_file(os.path.join(model_dir, name)))
    return found


def compare(weights: dict, model: dict) -> dict:
    """Per parameter the folder also holds: whether it differs, and the largest change; LoRA's B matrices' size."""
    compared, differ, largest, b_max = 0, [], 0.0, None
    for key, value in weights.items():
        if ".lora_" in key:
            if ".lora_B" in key:
                b_max = max(b_max or 0.0, float(value.abs().max()))
            continue
        base = model.get(folder_name(key))
        if base is None or tuple(base.shape) != tuple(value.shape):
            continue
        compared += 1
        base = base.to(value.dtype)
        if not bool((base == value).all()):
            differ.append(folder_name(key))
            largest = max(largest, float((base.double() - value.double()).abs().max()))
    return {"compared": compared, "differ": len(differ), "differ_names": differ[:5], "largest_change": largest,
            "lora_b_max": b_max}


def verdict(counts: dict, lora: bool) -> dict:
    n, d = counts["compared"], counts["differ"]
    if n == 0:
        return {"id": "weights", "ok": False, "words": "no parameter of the checkpoint is in the model folder"}
    if lora:
        if d:
            return {"id": "lora-base-moved", "ok": False,
                    "words": f"{d} of {n} frozen base parameters differ from the model folder (largest "
                             f"{counts['largest_change']:.3g}: {', '.join(counts['differ_names'])}): the LoRA run's "
                             "base weights moved"}
        if not counts["lora_b_max"]:
            return {"id": "weights-unmoved", "ok": False,
                    "words": f"every LoRA B matrix is still zero: no update reached the adapter ({n} base parameters "
                             "unchanged, as they must be)"}
        return {"id": "weights", "ok": True,
                "words": f"the adapter moved (largest B entry {counts['lora_b_max']:.3g}); all {n} base parameters "
                         "equal the model folder's"}
    if not d:
        return {"id": "weights-unmoved", "ok": False,
                "words": f"all {n} parameters equal the model folder's: no update reached the weights"}
    return {"id": "weights", "ok": True,
            "words": f"{d} of {n} parameters moved from the model folder's (largest change {counts['largest_change']:.3g})"}


def versions() -> dict:
    from importlib import metadata

    found = {}
    for name in VERSIONED:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            module = sys.modules.get(name)
            found[name] = getattr(module, "__version__", None)
    import torch

    found["torch_cuda"] = torch.version.cuda
    return found


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="verl_lab_burnin_weights.py", description=__doc__.splitlines()[0])
    ap.add_argument("--actor", required=True, help="global_step_N/actor of the burn-in's checkpoint")
    ap.add_argument("--model", required=True, help="the model folder the run started from")
    args = ap.parse_args(argv)
    proof, lora_export = sibling("verl_lab_export_proof"), sibling("verl_lab_lora_export")
    try:
        weights, facts = proof.full_weights(args.actor)
    except proof.ExportError as exc:
        print(json.dumps({"id": "weights", "ok": False, "words": f"the checkpoint cannot be read: {exc}"}))
        return 1
    lora = lora_export.is_lora_checkpoint(args.actor)
    counts = compare(weights, model_tensors(args.model))
    out = {**verdict(counts, lora), "lora": lora, **counts, **facts, "versions": versions()}
    print(json.dumps(out))
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
