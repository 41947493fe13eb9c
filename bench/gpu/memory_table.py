"""Print the predicted-vs-measured table (markdown) for docs/memory.md from recorded results.

    python bench/gpu/memory_table.py bench/gpu/results/memory-h200.json bench/gpu/results/memory-h200-fresh.json
"""

import json
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tasks.memory import ModelShape, generate_peak, train_step_peak  # noqa: E402


def rows(paths):
    shape = ModelShape.from_config(json.loads(
        (REPO / "files/models/qwen2.5-0.5b-instruct/config.json").read_text()))
    for path in paths:
        data = json.loads(Path(path).read_text())
        for t in data["train"]:
            if "error" in t:
                continue
            est = train_step_peak(shape, t["role"], t["dtype"], t["attn"], t["grad_ckpt"],
                                  t["micro_batch"], t["seq_len"])
            yield t["case"], t["split"], est.peak_mib, t["measured"]["peak"]
        for g in data["generate"]:
            if "error" in g:
                continue
            est = generate_peak(shape, g["batch"], g["prompt_len"], g["new_tokens"], g["dtype"],
                                g["attn"])
            yield g["case"], g["split"], est.peak_mib, g["measured"]["peak"]


def main(argv) -> int:
    table = list(rows(argv))
    print("| case | split | predicted MiB | measured MiB | error % |")
    print("|---|---|---:|---:|---:|")
    errs: dict[str, list[float]] = {}
    for case, split, pred, meas in table:
        err = 100.0 * (pred - meas) / meas
        errs.setdefault(split, []).append(err)
        print(f"| {case} | {split} | {pred:.0f} | {meas:.0f} | {err:+.1f} |")
    print()
    print("| split | cases | mean abs error % | max abs error % | mean signed error % |")
    print("|---|---:|---:|---:|---:|")
    for split, es in errs.items():
        print(f"| {split} | {len(es)} | {statistics.mean(abs(e) for e in es):.1f} | "
              f"{max(abs(e) for e in es):.1f} | {statistics.mean(es):+.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
