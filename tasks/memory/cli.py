"""``python -m tasks.memory``: one training step's or one generation's estimate, readable or JSON."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tasks.memory.generate import generate_peak
from tasks.memory.shape import ATTNS, DEFAULT_CONFIG, DTYPES, ROLES, Estimate, ModelShape
from tasks.memory.train_step import train_step_peak

# ---- CLI -------------------------------------------------------------------------------------

def _print_readable(est: Estimate, title: str) -> None:
    print(title)
    for k, v in est.breakdown.items():
        print(f"  {k:26} {v:12.1f} MiB")
    print(f"  {'peak (allocated)':26} {est.peak_mib:12.1f} MiB   (CUDA context not included)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tasks.memory", description="GPU memory estimate")
    ap.add_argument("--json", action="store_true", help="print JSON")
    ap.add_argument("--model-config", default=str(DEFAULT_CONFIG))
    ap.add_argument("--role", choices=ROLES + ("generate",), default="actor")
    ap.add_argument("--dtype", choices=DTYPES, default="bf16")
    ap.add_argument("--attn", choices=ATTNS, default="sdpa")
    ap.add_argument("--grad-ckpt", action="store_true")
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    args = ap.parse_args(argv)
    try:
        cfg = json.loads(Path(args.model_config).read_text())
        shape = ModelShape.from_config(cfg)
        if args.role == "generate":
            est = generate_peak(shape, args.batch, args.prompt_len, args.new_tokens, args.dtype,
                                args.attn)
            title = (f"generate {args.dtype} {args.attn} batch={args.batch} "
                     f"prompt={args.prompt_len} new={args.new_tokens}")
        else:
            est = train_step_peak(shape, args.role, args.dtype, args.attn, args.grad_ckpt,
                                  args.micro_batch, args.seq_len)
            title = (f"train {args.role} {args.dtype} {args.attn} grad_ckpt={args.grad_ckpt} "
                     f"micro_batch={args.micro_batch} seq_len={args.seq_len}")
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(est.as_json()))
    else:
        _print_readable(est, title)
    return 0


if __name__ == "__main__":
    sys.exit(main())
