"""Write a Qwen2.5-0.5B-Instruct-shaped model folder with random weights (runs on the device).

The device machine cannot reach the Hub, so the model verl trains there is made there:
``config.json`` copied from ``files/models/qwen2.5-0.5b-instruct/config.json``, a
``generation_config.json`` with Qwen2.5-0.5B-Instruct's real values, ``Qwen2ForCausalLM(config)``
with a fixed seed stored in bf16 like the real ``model.safetensors`` (988 MB, the same size:
the tied embedding is saved once), and the tokenizer files of ``.gpu/tokenizer`` (made by
bench/gpu/payload.py). Then it loads the folder back with ``AutoTokenizer`` and
``AutoModelForCausalLM`` (the proof that transformers reads the payload's tokenizer), applies
the chat template to one message, prints the token count and runs one forward pass.

A random model never emits EOS: every response runs to max_response_length (the worst case for
memory and time) and every reward is 0.

A model over ``save_pretrained``'s shard size (5 GB in bf16: the 3B) is written as transformers shards
it, ``model-0000N-of-0000M.safetensors`` with ``model.safetensors.index.json``, as the real 3B's
snapshot is.

Idempotent: the folder is built under a temporary name and renamed into place; an existing
folder with config.json and its weights (one file, or an index whose shards are all there) is
kept (the load check still runs).

    PYTHONPATH=/tmp/site python3 bench/gpu/make_model.py --out /tmp/qwen2.5-0.5b-random \\
        --tokenizer .gpu/tokenizer
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "files" / "models" / "qwen2.5-0.5b-instruct" / "config.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
# Qwen2.5-0.5B-Instruct's generation_config.json
GENERATION_CONFIG = {
    "bos_token_id": 151643,
    "do_sample": True,
    "eos_token_id": [151645, 151643],
    "pad_token_id": 151643,
    "repetition_penalty": 1.1,
    "temperature": 0.7,
    "top_k": 20,
    "top_p": 0.8,
    "transformers_version": "4.37.0",
}
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"   # a model over save_pretrained's shard size (5 GB: the 3B) is sharded


def has_weights(folder: Path) -> bool:
    """One ``model.safetensors``, or an index whose every shard is there."""
    if (folder / WEIGHTS).is_file():
        return True
    if not (folder / INDEX).is_file():
        return False
    shards = set(json.loads((folder / INDEX).read_text()).get("weight_map", {}).values())
    return bool(shards) and all((folder / s).is_file() for s in shards)


def weight_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.glob("*.safetensors"))


def build(out: Path, tokenizer: Path, config_path: Path, seed: int, device: str, max_shard_size: str = "5GB") -> None:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tmp = out.with_name(out.name + f".tmp-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    config = Qwen2Config.from_dict(json.loads(config_path.read_text()))
    dev = torch.device(device)
    t0 = time.time()
    torch.manual_seed(seed)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # initialise in the stored dtype: half the memory, no cast
    try:
        with dev:
            model = Qwen2ForCausalLM(config)
    finally:
        torch.set_default_dtype(default_dtype)
    model.eval()
    params = sum(p.numel() for p in model.parameters())
    print(f"make_model: Qwen2ForCausalLM {params / 1e6:.1f}M parameters on {dev} in {time.time() - t0:.1f} s",
          flush=True)
    model.save_pretrained(tmp, safe_serialization=True, max_shard_size=max_shard_size)
    del model
    # the project's config and the real generation config, not what save_pretrained wrote
    shutil.copyfile(config_path, tmp / "config.json")
    (tmp / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG, indent=2) + "\n")
    for name in TOKENIZER_FILES:
        shutil.copyfile(tokenizer / name, tmp / name)
    if out.exists():
        shutil.rmtree(out)
    for f in tmp.glob("*.safetensors"):
        os.chmod(f, 0o644)
    if not has_weights(tmp):
        raise SystemExit(f"make_model: save_pretrained left no complete weights in {tmp}")
    os.replace(tmp, out)
    size = weight_bytes(out)
    print(f"make_model: wrote {out} ({size} bytes of weights) in {time.time() - t0:.1f} s", flush=True)


def check(out: Path, device: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out)
    print(f"make_model: tokenizer {type(tok).__name__}, {len(tok)} tokens, eos {tok.eos_token!r}={tok.eos_token_id},"
          f" pad {tok.pad_token!r}={tok.pad_token_id}", flush=True)
    messages = [{"role": "user", "content": "Natalia sold clips to 48 of her friends in April, and then she sold "
                 "half as many clips in May. How many clips did Natalia sell altogether in April and May? "
                 "Let's think step by step and output the final answer after \"####\"."}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if tok.decode(ids) != text or not text.endswith("<|im_start|>assistant\n"):
        raise SystemExit(f"make_model: chat template round trip failed: {text!r}")
    print(f"make_model: chat template -> {len(ids)} tokens", flush=True)
    t0 = time.time()
    model = AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.bfloat16).to(device)
    with torch.no_grad():
        logits = model(torch.tensor([ids], device=device)).logits
    print(f"make_model: loaded {type(model).__name__} ({model.dtype}) and ran one forward pass in "
          f"{time.time() - t0:.1f} s: logits {tuple(logits.shape)}", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--tokenizer", required=True, type=Path, help="the payload's tokenizer folder (.gpu/tokenizer)")
    ap.add_argument("--config", type=Path, default=CONFIG)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    ap.add_argument("--no-check", action="store_true", help="skip loading the folder back")
    ap.add_argument("--max-shard-size", default="5GB", help="save_pretrained's shard size (its default: 5GB)")
    args = ap.parse_args(argv)
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    missing = [n for n in TOKENIZER_FILES if not (args.tokenizer / n).is_file()]
    if missing:
        print(f"make_model: {args.tokenizer} lacks {', '.join(missing)} (run bench/gpu/payload.py)", file=sys.stderr)
        return 1
    out = args.out.resolve()
    if (out / "config.json").is_file() and has_weights(out):
        print(f"make_model: {out} already has config.json and its weights: kept", flush=True)
        for name in TOKENIZER_FILES:  # a rebuilt payload tokenizer replaces the folder's copy
            have = out / name
            if not have.is_file() or have.read_bytes() != (args.tokenizer / name).read_bytes():
                shutil.copyfile(args.tokenizer / name, out / name)
                print(f"make_model: {name} updated from {args.tokenizer}", flush=True)
    else:
        build(out, args.tokenizer, args.config, args.seed, device, args.max_shard_size)
    if not args.no_check:
        check(out, device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
