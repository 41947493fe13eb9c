"""HF generate() of a LoRA model with the adapter unmerged (what verl 0.5.0's HF rollout ran before patch 0013) against
merged (what 0013 makes it run), on CPU, in one process: same model, same prompts, same number of new tokens.

    PY bench/lora_generate.py [--layers 24] [--vocab 151936] [--batch 8] [--prompt 16] [--new 32] [--rank 32]
                              [--repeat 3] [--threads 2] [--device cpu|cuda] [--dtype float32|bfloat16|float16]

PY is a Python with torch, transformers and peft (the tests' cached one: ~/.cache/verl-lab-test/verl-deps-venv-*/
bin/python). The model is Qwen2.5-0.5B-Instruct's config (the catalog's, files/models/qwen2.5-0.5b-instruct/config.json) with random
weights, ``--layers`` decoder layers; the adapter is the plans' (rank 32, alpha 32, every linear layer of the decoder: all-linear)
with B made non-zero so that it matters. Arms:

* ``unmerged``: PEFT's LoRA layers unmerged: each adapted linear runs the base matmul, the adapter's two and PEFT's
  wrapper (dropout, scaling, add) at every decoding step;
* ``merged``: the same PeftModel after PEFT's ``merge_adapter()``: each LoRA layer calls its base layer alone, on the
  merged weight, which is the compute 0013 gives the rollout (0013 merges by its own code and restores the saved
  base tensors; this bench does not care about the bits afterwards);
* ``base``: the adapter disabled (``disable_adapter()``: each LoRA layer calls its base layer alone, on the base
  weight): the floor, the same compute as ``merged`` on other numbers.

The arms are interleaved, the median of ``--repeat`` rounds each (after one warm-up round), greedy decoding forced
to ``--new`` tokens. It prints each arm's seconds and tokens/s and the ratios unmerged / merged and merged / base (about 1:
the same compute).

CPU ratios are not GPU ratios: on a CPU the matmuls' FLOPs dominate and the adapter's extra FLOPs are small
(2 x rank x (in + out) per token against in x out), while on a GPU HF decoding of a 0.5B model is bound by kernel
launches and Python, where the adapter's extra kernels and PEFT's wrapper weigh far more (1.6-1.9x the generation
time on the H200, GPU call 15). bench/gpu/PENDING.md's issue-35 calls measure 0013 on the GPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

MODEL_CONFIG = Path(__file__).resolve().parents[1] / "files" / "models" / "qwen2.5-0.5b-instruct" / "config.json"


def model_config(layers: int, vocab: int) -> dict:
    """The catalog's Qwen2.5-0.5B-Instruct config.json, ``layers`` decoder layers and a ``vocab``-token vocabulary."""
    config = json.loads(MODEL_CONFIG.read_text())
    config.update(num_hidden_layers=layers, vocab_size=vocab)
    return config


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--alpha", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu", help="cpu, or cuda for the same comparison on a GPU")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    args = ap.parse_args()

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    config = model_config(args.layers, args.vocab)
    model = AutoModelForCausalLM.from_config(Qwen2Config(**config),
                                             torch_dtype=getattr(torch, args.dtype), attn_implementation="eager"
                                             ).to(args.device).eval()
    base = model
    peft_model = get_peft_model(model, LoraConfig(r=args.rank, lora_alpha=args.alpha, target_modules="all-linear",
                                                  lora_dropout=0.0, task_type="CAUSAL_LM")).eval()
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.02)            # a trained adapter: B is zero only at the start
    prompts = torch.randint(0, args.vocab, (args.batch, args.prompt)).to(args.device)
    mask = torch.ones_like(prompts)
    kwargs = dict(attention_mask=mask, max_new_tokens=args.new, min_new_tokens=args.new, do_sample=False,
                  num_beams=1, pad_token_id=0, eos_token_id=None, use_cache=True)

    def sync() -> None:
        if args.device != "cpu":
            torch.cuda.synchronize()

    def generate(arm: str) -> float:
        if arm == "merged":
            peft_model.merge_adapter()
        try:
            model_for_arm = base if arm == "base" else peft_model
            sync()
            start = time.perf_counter()
            with torch.no_grad():
                out = model_for_arm.generate(input_ids=prompts, **kwargs)
            sync()
            took = time.perf_counter() - start
            assert out.shape == (args.batch, args.prompt + args.new), out.shape
            return took
        finally:
            if arm == "merged":
                peft_model.unmerge_adapter()

    arms = ("unmerged", "merged", "base")
    times: dict[str, list[float]] = {arm: [] for arm in arms}
    for round_ in range(args.repeat + 1):
        for arm in arms:
            if arm == "base":
                with peft_model.disable_adapter():
                    took = generate(arm)
            else:
                took = generate(arm)
            if round_:                               # round 0 warms up
                times[arm].append(took)
    median = {arm: statistics.median(t) for arm, t in times.items()}
    tokens = args.batch * args.new
    print(f"model: Qwen2.5-0.5B's shape, {args.layers} layers, vocab {args.vocab}, {args.dtype} random weights on "
          f"{args.device}; LoRA rank "
          f"{args.rank}, alpha {args.alpha}, all-linear; batch {args.batch}, prompt {args.prompt}, {args.new} new tokens;"
          f" {args.threads} CPU threads, median of {args.repeat}")
    for arm in arms:
        print(f"  {arm:9s} {median[arm]:7.3f} s  {tokens / median[arm]:8.1f} tokens/s")
    ratio = median["unmerged"] / median["merged"]
    print(f"  unmerged / merged = {ratio:.2f}x   merged / base = {median['merged'] / median['base']:.2f}x")
    if args.device == "cpu":
        print("  CPU ratios are not GPU ratios: a GPU's HF decoding of a small model is bound by kernel launches and "
              "Python, where the adapter's extra kernels weigh more (H200, GPU call 15: 1.6-1.9x the generation time)")
    print("RESULT " + json.dumps({"seconds": median, "rounds": times, "unmerged_over_merged": ratio,
                                  "args": vars(args)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
