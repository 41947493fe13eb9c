"""HF generate() of a LoRA model with the adapter unmerged (what verl 0.5.0's HF rollout ran before patch 0013) against
merged (what 0013 makes it run), on CPU, in one process: same model, same prompts, same number of new tokens.

    PY bench/lora_generate.py [--layers 24] [--vocab 151936] [--batch 8] [--prompt 16] [--new 32] [--rank 32]
                              [--repeat 3] [--threads 2] [--device cpu|cuda] [--dtype float32|bfloat16|float16]
                              [--verl TREE]

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
  weight): the floor, the same compute as ``merged`` on other numbers;
* ``0013``: patch 0013's own merge (``_AdapterMerge`` of verl's patched ``hf_rollout`` module, from ``--verl TREE`` or
  an installed verl; left out when neither has it) around the same generate(): the copies of the adapted weights
  to the host (made at its first merge, reused after; pinned with cudaHostRegister on a GPU), the merge in fp32
  rounded once, and the restore from the copies; its merge and restore seconds are printed apart, the first
  round's (which makes the host copies) beside the median of the later ones, and after every round the weights
  are checked bit for bit against those before it.

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
    ap.add_argument("--verl", help="a verl 0.5.0 tree with the project's patches (for the 0013 arm)")
    args = ap.parse_args()
    if args.verl:
        sys.path.insert(0, args.verl)
    try:
        from verl.workers.rollout import hf_rollout
    except ImportError:
        hf_rollout = None
    if hf_rollout is not None and not hasattr(hf_rollout, "_AdapterMerge"):
        hf_rollout = None               # a verl without patch 0013

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

    merge = hf_rollout._AdapterMerge(peft_model) if hf_rollout is not None else None
    phases: dict[str, list[float]] = {"merge": [], "restore": []}

    def generate_0013() -> float:
        """generate() inside 0013's merge; its merge and restore seconds go to ``phases``. The weights before it
        (not the first ones: the ``merged`` arm's unmerge_adapter subtracts, which drifts them in the last bits)
        are checked after it, bit for bit."""
        weights = {n: p.detach().clone() for n, p in peft_model.named_parameters()}
        context = merge.merged()
        sync()
        start = time.perf_counter()
        context.__enter__()
        sync()
        phases["merge"].append(time.perf_counter() - start)
        try:
            took = generate("0013")
        finally:
            sync()
            start = time.perf_counter()
            context.__exit__(None, None, None)
            sync()
            phases["restore"].append(time.perf_counter() - start)
        moved = [n for n, p in peft_model.named_parameters() if not torch.equal(p, weights[n])]
        assert not moved, f"0013 left {len(moved)} weights changed: {moved[:3]}"
        return took

    arms = ("unmerged", "merged", "base") + (("0013",) if merge is not None else ())
    times: dict[str, list[float]] = {arm: [] for arm in arms}
    for round_ in range(args.repeat + 1):
        for arm in arms:
            if arm == "base":
                with peft_model.disable_adapter():
                    took = generate(arm)
            elif arm == "0013":
                took = generate_0013()
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
    steady = {}
    if merge is not None:
        copies = merge.copies or []
        steady = {k: statistics.median(v[1:]) if len(v) > 1 else v[0] for k, v in phases.items()}
        print(f"  0013: merge {phases['merge'][0]:.3f} s at its first rollout (the host copies made: "
              f"{sum(c.numel() * c.element_size() for c in copies) / 2**20:.0f} MiB in {len(copies)} tensors, "
              f"pinned: {bool(hf_rollout._PINNED)}), then {steady['merge']:.3f} s; restore {steady['restore']:.3f} s; "
              f"unmerged / 0013 = {median['unmerged'] / median['0013']:.2f}x (generate() alone), "
              f"{median['unmerged'] / (median['0013'] + steady['merge'] + steady['restore']):.2f}x with its merge and "
              "restore")
    if args.device == "cpu":
        print("  CPU ratios are not GPU ratios: a GPU's HF decoding of a small model is bound by kernel launches and "
              "Python, where the adapter's extra kernels weigh more (H200, GPU call 15: 1.6-1.9x the generation time)")
    print("RESULT " + json.dumps({"seconds": median, "rounds": times, "unmerged_over_merged": ratio,
                                  "patch_0013": {"phases": phases, "steady": steady} if merge is not None else None,
                                  "args": vars(args)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
