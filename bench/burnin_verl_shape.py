"""The burn-in with verl 0.5.0's own update on the 0.5B's width and vocabulary, cut to a layer or two (CPU, slow).

tests/unit/test_burnin_learning.py runs the burn-in through verl's own worker on the tiny Qwen2 (width 64, 500
tokens); this runs the same fixture (tests/fixtures/burnin_worker_run.py: verl's ActorRolloutRefWorker and ref, the
P40's plan with GRPO and the burn-in's overrides, the product's probe, reward manager and judge) on a model folder
with Qwen2.5-0.5B's config (hidden 896, vocabulary 151,936, tied embeddings) cut to ``--layers`` layers, random
weights initialised in bf16 as bench/gpu/make_model.py makes them, the tiny model's tokenizer (the prompts are random
ids over the whole vocabulary). It prints each step's share, its standard error and the judge's verdict.

    .venv/bin/python bench/burnin_verl_shape.py [--layers 1] [--steps 5] [--response 32] [--mutation NAME]

About 10 minutes a step on one busy core at the defaults (16 prompts x 4, 48 prompt and 32 response tokens); about
6 GiB of memory.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
CONFIG = REPO / "files" / "models" / "qwen2.5-0.5b-instruct" / "config.json"

MAKE = """
import json, sys, torch
from safetensors.torch import save_file
from transformers import Qwen2Config, Qwen2ForCausalLM
dest, layers, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
cfg = json.load(open(sys.argv[4]))
cfg.update(num_hidden_layers=layers, max_window_layers=layers, torch_dtype="float32")
torch.manual_seed(seed)
torch.set_default_dtype(torch.bfloat16)
model = Qwen2ForCausalLM(Qwen2Config.from_dict(cfg))
torch.set_default_dtype(torch.float32)
state = {k: v.float().contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
save_file(state, dest + "/model.safetensors", metadata={"format": "pt"})
json.dump(cfg, open(dest + "/config.json", "w"), indent=2)
"""


def model_folder(python: str, dest: Path, layers: int, seed: int) -> Path:
    """The tiny model's folder (its tokenizer) with the 0.5B's config cut to ``layers`` and random weights."""
    from tests.unit.test_fsdp2_gather import tiny_model

    tiny_model(dest)
    subprocess.run([python, "-c", MAKE, str(dest), str(layers), str(seed), str(CONFIG)], check=True)
    return dest


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--response", type=int, default=32)
    ap.add_argument("--finetune", choices=["full", "lora"], default="full")
    ap.add_argument("--mutation", default="", help="a tests/fixtures/burnin/mutations/<name>.diff on the verl tree")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prompt", default="48,30,5,8", help="WIDTH,HEAD,TAIL,PAD: prompt ids a row, of them shared "
                    "by every prompt at its start and end (a chat template's), left padding of every other prompt "
                    "(GSM8K's chat prompts on the GPU: 97-181 tokens; 48 here, as verl computes the logits of the "
                    "prompt's positions too); 7,0,0,3 is the tiny test's")
    ap.add_argument("--timeout", type=int, default=4 * 3600)
    ap.add_argument("--keep", type=Path, default=None, help="work here (kept) instead of a temporary folder")
    a = ap.parse_args(argv)

    from tasks import verl_source
    from tasks.burnin.plan import RISES
    from tests.fixtures.standins import env as standin
    from tests.unit.test_burnin_learning import MUTATIONS, _run, burnin_run_overrides
    from tests.unit.test_hf_rollout import _tree
    from verl_lab_box.burnin import merged

    python = str(standin.test_env())
    work = a.keep or Path(tempfile.mkdtemp(prefix="burnin-shape-"))
    work.mkdir(parents=True, exist_ok=True)
    model = model_folder(python, work / "model", a.layers, a.seed)
    tree = _tree(work / "tree", verl_source.patch_files())
    if a.mutation:
        subprocess.run(["git", "apply", str(MUTATIONS / f"{a.mutation}.diff")], cwd=tree, check=True)
    mine = {"data.max_response_length": str(a.response), "data.train_batch_size": str(a.prompts),
            # the logits of a micro-batch are 152k wide: 16 sequences at a time, not the tiny test's 64
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": "16",
            "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": "16",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": "16"}
    overrides = merged(burnin_run_overrides(model, work / "run", a.finetune), [f"{k}={v}" for k, v in mine.items()])
    width, head, tail, pad = (int(x) for x in a.prompt.split(","))
    spec = {"overrides": overrides, "prompts": a.prompts, "steps": a.steps, "rises": RISES,
            "vocab": json.loads((model / "config.json").read_text())["vocab_size"],
            "prompt": {"width": width, "head": head, "tail": tail, "pad": pad}}
    print(json.dumps({k: v for k, v in vars(a).items() if k != "keep"}), flush=True)
    print("\n".join(o for o in overrides if "lr" in o or "batch" in o or "length" in o), flush=True)
    found, log, seconds = _run(python, tree, spec, work / "run", timeout=a.timeout)
    if found is None:
        print(log)
        return 1
    for s in found["steps"]:
        print(json.dumps(s), flush=True)
    print(json.dumps({"test": found["test"], "weights": found["weights"], "seconds": seconds}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
