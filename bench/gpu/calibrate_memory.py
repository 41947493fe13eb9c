"""Measure GPU memory of training steps and generation, against tasks.memory's estimates.

Runs on a CUDA machine with torch and transformers (the device machine: torch 2.11,
transformers 5.17). The model is built from ``files/models/qwen2.5-0.5b-instruct/config.json``
with random weights (``from_config``), so no download is needed.

What one training case measures (the definition ``tasks.memory.train_step_peak`` estimates):

* ``base`` = ``torch.cuda.memory_allocated()`` before the model is built;
* the model is built on the GPU in fp32 (``AutoModelForCausalLM`` for the actor,
  ``AutoModelForTokenClassification`` with ``num_labels=1`` for the critic), ``train()`` mode,
  ``attn_implementation`` given explicitly, optional ``gradient_checkpointing_enable()``;
* ``torch.optim.AdamW(model.parameters(), lr=1e-5)`` with torch's defaults (foreach on CUDA);
* ``steps`` times: forward under ``torch.autocast("cuda", dtype)`` (none for fp32) with
  ``use_cache=False`` (as verl calls it), ``loss = logits.float().mean()``, ``loss.backward()``
  outside autocast, ``optimizer.step()``, ``optimizer.zero_grad(set_to_none=True)``;
* ``peak`` = ``torch.cuda.max_memory_allocated() - base`` over all steps. The peak of each
  phase (forward, backward, optimizer step) and the memory held after each phase are recorded
  too, per step, so that the parts of the estimate can be checked one by one.

One generation case: the model built directly in the generation dtype, ``eval()``, and
``model.generate(input_ids, attention_mask=ones, max_new_tokens=n, min_new_tokens=n,
do_sample=False)`` under ``torch.no_grad()``; ``peak`` = max allocated minus ``base``,
weights included.

Usage (from the repository root; bench/gpu/run_memory.sh is what the device runs)::

    python bench/gpu/calibrate_memory.py --out results.json [--only N] [--budget-s 420]
    python bench/gpu/calibrate_memory.py --dry-run   # CPU, tiny config: checks the API calls only
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import os
import platform
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tasks.memory import ModelShape, generate_peak, train_step_peak  # noqa: E402

MIB = 1024 * 1024
CONFIG = REPO / "files/models/qwen2.5-0.5b-instruct/config.json"

# The grid. "split" was fixed before any measurement: "fit" cases may tune the estimator's
# constants, "holdout" cases are never used for that and report the honest error.
TRAIN_CASES = [
    # role,    dtype,  attn,   ckpt,  mb, seq,  split
    ("actor", "bf16", "sdpa", False, 1, 256, "fit"),
    ("actor", "bf16", "sdpa", False, 2, 512, "fit"),
    ("actor", "bf16", "sdpa", False, 4, 1024, "fit"),
    ("actor", "bf16", "sdpa", False, 8, 512, "holdout"),
    ("actor", "bf16", "sdpa", False, 8, 1024, "fit"),
    ("actor", "bf16", "sdpa", False, 4, 256, "holdout"),
    ("actor", "bf16", "sdpa", True, 2, 1024, "fit"),
    ("actor", "bf16", "sdpa", True, 8, 1024, "fit"),
    ("actor", "bf16", "sdpa", True, 8, 512, "holdout"),
    ("actor", "bf16", "sdpa", True, 4, 256, "fit"),
    ("actor", "bf16", "eager", False, 1, 1024, "fit"),
    ("actor", "bf16", "eager", False, 4, 512, "holdout"),
    ("actor", "bf16", "eager", False, 8, 1024, "fit"),
    ("actor", "bf16", "eager", False, 2, 256, "fit"),
    ("actor", "bf16", "eager", True, 4, 1024, "holdout"),
    ("actor", "bf16", "eager", True, 8, 1024, "fit"),
    ("actor", "fp32", "sdpa", False, 1, 512, "fit"),
    ("actor", "fp32", "sdpa", False, 4, 1024, "holdout"),
    ("actor", "fp32", "sdpa", False, 8, 512, "fit"),
    ("actor", "fp32", "sdpa", False, 8, 1024, "fit"),
    ("actor", "fp32", "sdpa", True, 8, 1024, "fit"),
    ("actor", "fp32", "sdpa", True, 2, 512, "holdout"),
    ("actor", "fp32", "eager", False, 2, 1024, "fit"),
    ("actor", "fp32", "eager", False, 8, 512, "holdout"),
    ("actor", "fp32", "eager", False, 4, 256, "fit"),
    ("actor", "fp32", "eager", True, 8, 1024, "fit"),
    ("actor", "fp16", "sdpa", False, 4, 1024, "holdout"),
    ("actor", "fp16", "sdpa", False, 8, 256, "fit"),
    ("actor", "fp16", "eager", True, 8, 512, "holdout"),
    ("critic", "bf16", "sdpa", False, 8, 1024, "fit"),
    ("critic", "bf16", "sdpa", False, 4, 512, "holdout"),
    ("critic", "bf16", "sdpa", False, 1, 256, "fit"),
    ("critic", "bf16", "sdpa", True, 8, 1024, "fit"),
    ("critic", "fp32", "sdpa", False, 8, 1024, "holdout"),
    ("critic", "fp32", "sdpa", False, 2, 512, "fit"),
    ("critic", "bf16", "eager", False, 4, 1024, "fit"),
    ("critic", "fp32", "eager", True, 8, 1024, "holdout"),
]

# A second grid, measured only after the constants were set from the first one: new shapes,
# some beyond the first grid (micro-batch 16/32, seq 2048), all "fresh" (never fitted on).
FRESH_TRAIN_CASES = [
    ("actor", "bf16", "sdpa", False, 3, 768, "fresh"),
    ("actor", "bf16", "sdpa", False, 16, 1024, "fresh"),
    ("actor", "bf16", "sdpa", False, 2, 2048, "fresh"),
    ("actor", "bf16", "sdpa", True, 16, 2048, "fresh"),
    ("actor", "bf16", "sdpa", True, 32, 512, "fresh"),
    ("actor", "bf16", "eager", False, 2, 2048, "fresh"),
    ("actor", "bf16", "eager", True, 8, 2048, "fresh"),
    ("actor", "fp32", "sdpa", True, 4, 2048, "fresh"),
    ("actor", "fp32", "eager", False, 1, 2048, "fresh"),
    ("actor", "fp16", "sdpa", True, 16, 1024, "fresh"),
    ("critic", "bf16", "sdpa", True, 16, 2048, "fresh"),
    ("critic", "bf16", "sdpa", False, 6, 1024, "fresh"),
    ("critic", "fp32", "sdpa", True, 8, 512, "fresh"),
    ("critic", "bf16", "eager", True, 4, 2048, "fresh"),
]
FRESH_GENERATE_CASES = [
    (256, 128, 128, "bf16", "sdpa", "fresh"),
    (8, 1024, 512, "bf16", "sdpa", "fresh"),
    (32, 512, 64, "fp32", "sdpa", "fresh"),
    (64, 256, 256, "fp16", "sdpa", "fresh"),
    (4, 1024, 32, "bf16", "eager", "fresh"),
]

GENERATE_CASES = [
    # batch, prompt, new, dtype, attn, split
    (1, 128, 64, "bf16", "sdpa", "fit"),
    (16, 256, 256, "bf16", "sdpa", "fit"),
    (64, 512, 256, "bf16", "sdpa", "holdout"),
    (32, 128, 512, "bf16", "sdpa", "fit"),
    (128, 256, 128, "bf16", "sdpa", "fit"),
    (16, 256, 128, "fp32", "sdpa", "fit"),
    (64, 128, 256, "fp32", "sdpa", "holdout"),
    (32, 512, 128, "fp16", "sdpa", "holdout"),
    (16, 512, 64, "bf16", "eager", "fit"),
]


def _torch_dtype(torch, name):
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[name]


def _load_config(transformers, path: Path, role: str, attn: str):
    cfg = transformers.AutoConfig.from_pretrained(str(path.parent))
    if role == "critic":
        cfg.num_labels = 1
    cfg._attn_implementation = attn
    return cfg


def _build(transformers, torch, cfg, role, attn, dtype, device):
    cls = (transformers.AutoModelForTokenClassification if role == "critic"
           else transformers.AutoModelForCausalLM)
    with torch.device(device):
        try:
            model = cls.from_config(cfg, attn_implementation=attn, dtype=dtype)
        except TypeError:  # transformers 4.x spells it torch_dtype
            model = cls.from_config(cfg, attn_implementation=attn, torch_dtype=dtype)
    dtypes = {p.dtype for p in model.parameters()}
    if dtypes != {dtype}:
        raise RuntimeError(f"model built in {dtypes}, wanted {dtype}")
    if model.config._attn_implementation != attn:
        raise RuntimeError(f"attention is {model.config._attn_implementation}, wanted {attn}")
    return model


class Meter:
    """torch.cuda memory readings relative to a base; all zeros on the CPU (dry run)."""

    def __init__(self, torch, cuda: bool):
        self.torch, self.cuda = torch, cuda
        self.base = 0

    def sync(self):
        if self.cuda:
            self.torch.cuda.synchronize()

    def start(self):
        gc.collect()
        if self.cuda:
            self.torch.cuda.empty_cache()
            self.sync()
            self.base = self.torch.cuda.memory_allocated()
            self.torch.cuda.reset_peak_memory_stats()

    def now(self) -> float:
        return (self.torch.cuda.memory_allocated() - self.base) / MIB if self.cuda else 0.0

    def peak(self) -> float:
        self.sync()
        return (self.torch.cuda.max_memory_allocated() - self.base) / MIB if self.cuda else 0.0

    def phase(self):
        """Close a phase: return its peak; the next phase's peak starts from what is held now."""
        p = self.peak()
        if self.cuda:
            self.torch.cuda.reset_peak_memory_stats()
        return p


def train_case(torch, transformers, cfg_path, role, dtype, attn, ckpt, mb, seq, steps, device):
    meter = Meter(torch, device == "cuda")
    meter.start()
    cfg = _load_config(transformers, cfg_path, role, attn)
    model = _build(transformers, torch, cfg, role, attn, torch.float32, device)
    model.train()
    ckpt_kwargs = None
    if ckpt:
        model.gradient_checkpointing_enable()
        func = getattr(model.model.layers[0], "_gradient_checkpointing_func", None)
        ckpt_kwargs = dict(getattr(func, "keywords", {}) or {})
    weights = meter.now()
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    ids = torch.randint(0, cfg.vocab_size, (mb, seq), device=device)
    ac_dtype = None if dtype == "fp32" else _torch_dtype(torch, dtype)
    per_step = []
    meter.phase()
    t0 = time.time()
    for _ in range(steps):
        rec = {"start": meter.now()}
        if ac_dtype is None:
            loss = model(input_ids=ids, use_cache=False).logits.float().mean()
        else:
            with torch.autocast(device_type=device, dtype=ac_dtype):
                loss = model(input_ids=ids, use_cache=False).logits.float().mean()
        rec["fwd_peak"], rec["after_fwd"] = meter.phase(), meter.now()
        loss.backward()
        del loss
        rec["bwd_peak"], rec["after_bwd"] = meter.phase(), meter.now()
        opt.step()
        rec["opt_peak"], rec["after_opt"] = meter.peak(), meter.now()
        opt.zero_grad(set_to_none=True)
        meter.phase()   # the next forward's peak starts from here, gradients freed
        rec["after_zero"] = meter.now()
        per_step.append(rec)
    meter.sync()
    seconds = time.time() - t0
    foreach = opt.defaults.get("foreach")
    fused = opt.defaults.get("fused")
    del opt, model, ids
    peak = max(max(r["fwd_peak"], r["bwd_peak"], r["opt_peak"]) for r in per_step)
    return {"weights": weights, "n_params": n_params, "peak": peak, "steps": per_step,
            "ckpt_kwargs": ckpt_kwargs, "adamw_foreach": foreach, "adamw_fused": fused,
            "seconds": round(seconds, 2)}


def generate_case(torch, transformers, cfg_path, batch, prompt, new, dtype, attn, device):
    meter = Meter(torch, device == "cuda")
    meter.start()
    cfg = _load_config(transformers, cfg_path, "actor", attn)
    model = _build(transformers, torch, cfg, "actor", attn, _torch_dtype(torch, dtype), device)
    model.eval()
    weights = meter.now()
    ids = torch.randint(0, cfg.vocab_size, (batch, prompt), device=device)
    mask = torch.ones_like(ids)
    meter.phase()
    t0 = time.time()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new,
                             min_new_tokens=new, do_sample=False,
                             pad_token_id=cfg.eos_token_id, eos_token_id=cfg.eos_token_id)
    peak = meter.peak()
    seconds = time.time() - t0
    if tuple(out.shape) != (batch, prompt + new):
        raise RuntimeError(f"generate returned {tuple(out.shape)}, wanted {(batch, prompt + new)}")
    del out, model, ids, mask
    return {"weights": weights, "peak": max(peak, weights), "seconds": round(seconds, 2)}


def environment(torch, transformers) -> dict:
    env = {"python": platform.python_version(), "torch": torch.__version__,
           "transformers": transformers.__version__}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env.update(gpu=props.name, total_mib=props.total_memory // MIB,
                   cc=f"{props.major}.{props.minor}", cuda=torch.version.cuda)
        free, total = torch.cuda.mem_get_info()
        env["free_mib_at_start"] = free // MIB
        env["flash_sdp"] = torch.backends.cuda.flash_sdp_enabled()
        env["mem_efficient_sdp"] = torch.backends.cuda.mem_efficient_sdp_enabled()
        env["cudnn_sdp"] = torch.backends.cuda.cudnn_sdp_enabled()
    from transformers.modeling_utils import PreTrainedModel
    src = inspect.getsource(PreTrainedModel.gradient_checkpointing_enable)
    env["gc_default_line"] = next((ln.strip() for ln in src.splitlines()
                                   if "use_reentrant" in ln and "=" in ln), None)
    return env


def warm(torch):
    """Run the kinds of kernels the cases use (fp32/bf16/fp16 matmuls, sdpa, autocast, backward)."""
    for dt in (torch.float32, torch.bfloat16, torch.float16):
        a = torch.randn(256, 256, device="cuda", dtype=dt, requires_grad=True)
        (a @ a).sum().backward()
        q = torch.randn(1, 4, 64, 64, device="cuda", dtype=dt, requires_grad=True)
        torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()
    lin = torch.nn.Linear(256, 256, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        lin(torch.randn(8, 256, device="cuda")).float().sum().backward()
    del a, q, lin
    gc.collect()
    torch.cuda.synchronize()


def cuda_context_mib(torch) -> float | None:
    """GPU memory the process holds beyond what PyTorch's allocator has reserved."""
    try:
        import pynvml
        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        procs = pynvml.nvmlDeviceGetComputeRunningProcesses(h)
        mine = [p for p in procs if p.pid == os.getpid()]
        used = mine[0].usedGpuMemory if mine and mine[0].usedGpuMemory else None
        if used is None:
            info = pynvml.nvmlDeviceGetMemoryInfo(h)
            used = info.used
        return (used - torch.cuda.memory_reserved()) / MIB
    except Exception:  # noqa: BLE001 - a reading we can do without
        free, total = torch.cuda.mem_get_info()
        return (total - free - torch.cuda.memory_reserved()) / MIB


class _NoEstimate:
    def __init__(self, why: str):
        self.peak_mib, self.breakdown = 0.0, {"error": why}


def predicted_train(shape, role, dtype, attn, ckpt, mb, seq):
    return train_step_peak(shape, role=role, dtype=dtype, attn=attn, grad_ckpt=ckpt,
                           micro_batch=mb, seq_len=seq)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="memory-calibration.json")
    ap.add_argument("--config", default=str(CONFIG))
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--budget-s", type=float, default=420.0, help="stop starting new cases after this")
    ap.add_argument("--only", type=int, default=None, help="run only the first N cases of each grid")
    ap.add_argument("--grid", choices=("main", "fresh"), default="main")
    ap.add_argument("--no-warmup", action="store_true",
                    help="do not allocate cuBLAS workspaces before the first case")
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny model, two cases: checks the calls")
    args = ap.parse_args(argv)

    import torch
    import transformers

    cfg_path = Path(args.config)
    device = "cuda"
    train_cases, gen_cases = TRAIN_CASES, GENERATE_CASES
    if args.grid == "fresh":
        train_cases, gen_cases = FRESH_TRAIN_CASES, FRESH_GENERATE_CASES
    if args.dry_run:
        device = "cpu"
        tiny = json.loads(cfg_path.read_text())
        tiny.update(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                    num_attention_heads=4, num_key_value_heads=2, vocab_size=512)
        tmp = Path("/tmp/calibrate-memory-dry/config.json")
        tmp.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(tiny))
        cfg_path = tmp
        train_cases = [c for c in TRAIN_CASES if c[0] == "critic"][:1] + [
            ("actor", "bf16", "eager", True, 2, 16, "fit"), ("actor", "fp32", "sdpa", False, 2, 16, "fit")]
        gen_cases = [(2, 8, 4, "fp32", "sdpa", "fit")]
        train_cases = [c[:4] + (2, 16, c[6]) for c in train_cases]
    elif not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 2
    if args.only is not None:
        train_cases, gen_cases = train_cases[: args.only], gen_cases[: args.only]

    shape = ModelShape.from_config(json.loads(cfg_path.read_text()))
    result = {"environment": environment(torch, transformers), "config": str(args.config),
              "steps": args.steps, "train": [], "generate": [], "skipped": []}
    if device == "cuda":
        torch.zeros(1, device="cuda")
        result["environment"]["cuda_context_mib"] = cuda_context_mib(torch)
        if not args.no_warmup:
            # cuBLAS/cuDNN workspaces come with the first matmuls of a process and stay:
            # make them before any base reading, so every case is measured alike
            before = torch.cuda.memory_allocated()
            warm(torch)
            result["environment"]["workspace_mib"] = (torch.cuda.memory_allocated() - before) / MIB
    out_path = Path(args.out)
    t_start = time.time()

    def save():
        out_path.write_text(json.dumps(result, indent=1))

    print(f"{'case':52} {'pred':>9} {'meas':>9} {'err%':>7}  split")
    for role, dtype, attn, ckpt, mb, seq, split in train_cases:
        name = f"train {role} {dtype} {attn} ckpt={int(ckpt)} mb={mb} seq={seq}"
        if time.time() - t_start > args.budget_s:
            result["skipped"].append(name)
            continue
        try:
            m = train_case(torch, transformers, cfg_path, role, dtype, attn, ckpt, mb, seq,
                           args.steps, device)
        except Exception as exc:  # noqa: BLE001 - one failing case must not lose the others
            result["train"].append({"case": name, "error": repr(exc)[:500]})
            print(f"{name:52} ERROR {exc!r}"[:200], flush=True)
            save()
            continue
        try:
            est = predicted_train(shape, role, dtype, attn, ckpt, mb, seq)
        except Exception as exc:  # noqa: BLE001 - keep the measurement even if the estimate breaks
            est = _NoEstimate(repr(exc))
        err = 100.0 * (est.peak_mib - m["peak"]) / m["peak"] if m["peak"] else 0.0
        result["train"].append({"case": name, "role": role, "dtype": dtype, "attn": attn,
                                "grad_ckpt": ckpt, "micro_batch": mb, "seq_len": seq,
                                "split": split, "measured": m, "predicted_mib": est.peak_mib,
                                "predicted_breakdown": est.breakdown, "error_pct": err})
        print(f"{name:52} {est.peak_mib:9.0f} {m['peak']:9.0f} {err:7.1f}  {split}", flush=True)
        save()
    for batch, prompt, new, dtype, attn, split in gen_cases:
        name = f"generate {dtype} {attn} b={batch} p={prompt} n={new}"
        if time.time() - t_start > args.budget_s:
            result["skipped"].append(name)
            continue
        try:
            m = generate_case(torch, transformers, cfg_path, batch, prompt, new, dtype, attn, device)
        except Exception as exc:  # noqa: BLE001
            result["generate"].append({"case": name, "error": repr(exc)[:500]})
            print(f"{name:52} ERROR {exc!r}"[:200], flush=True)
            save()
            continue
        try:
            est = generate_peak(shape, batch=batch, prompt_len=prompt, new_tokens=new,
                                dtype=dtype, attn=attn)
        except Exception as exc:  # noqa: BLE001
            est = _NoEstimate(repr(exc))
        err = 100.0 * (est.peak_mib - m["peak"]) / m["peak"] if m["peak"] else 0.0
        result["generate"].append({"case": name, "batch": batch, "prompt_len": prompt,
                                   "new_tokens": new, "dtype": dtype, "attn": attn, "split": split,
                                   "measured": m, "predicted_mib": est.peak_mib,
                                   "predicted_breakdown": est.breakdown, "error_pct": err})
        print(f"{name:52} {est.peak_mib:9.0f} {m['peak']:9.0f} {err:7.1f}  {split}", flush=True)
        save()
    if device == "cuda":
        result["environment"]["cuda_context_mib_at_end"] = cuda_context_mib(torch)
    result["seconds"] = round(time.time() - t_start, 1)
    save()
    print(f"done in {result['seconds']} s; skipped {len(result['skipped'])}; wrote {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
