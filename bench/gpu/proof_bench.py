"""The export's proof, today's against an earlier one, on the same exported step (runs on the device).

    python3 bench/gpu/proof_bench.py STEP_DIR --old OLD_EXPORT_PY --out JSON [--timeout S]

``STEP_DIR`` is ``global_step_N`` after the launcher's export (``actor/`` and ``hf/`` in it). Each proof runs
in a process of its own (its seconds, and its peak resident memory from ``getrusage``), today's first
(verl_lab_box/export_proof.py through export.py, on the GPU the run released), then the earlier export.py
(``OLD_EXPORT_PY``, written at render time from git: bench/gpu/ppo_profiles.py ``proof_baseline``), which
proves on the CPU. A proof cut at the timeout is recorded as such. The record is the ratio the issue asks
for: the earlier proof's seconds over today's, measured in one run on one machine.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CODE = """
import json, sys, time
sys.path.insert(0, sys.argv[1])
module = __import__(sys.argv[2])
t = time.monotonic()
found = module.prove(sys.argv[3] + "/hf", sys.argv[3] + "/actor")
print("PROOF " + json.dumps({"seconds": round(time.monotonic() - t, 2), **{k: found.get(k) for k in (
    "max_abs_logit_diff", "max_abs_logit_diff_in_export_dtype", "max_abs_logit_diff_vs_checkpoint_dtype",
    "max_abs_logit", "logit_tolerance", "proof_device", "proof_split_seconds", "checkpoint_dtype", "export_dtype")}}))
"""


def run_one(folder: str, module: str, step_dir: Path, timeout: float) -> dict:
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    start = time.monotonic()
    try:
        res = subprocess.run([sys.executable, "-c", CODE, folder, module, str(step_dir)], capture_output=True,
                             text=True, timeout=max(1.0, timeout))
    except subprocess.TimeoutExpired:
        return {"timed_out": True, "wall_seconds": round(time.monotonic() - start, 1), "timeout": round(timeout, 1)}
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    line = next((ln for ln in res.stdout.splitlines() if ln.startswith("PROOF ")), None)
    record = {"rc": res.returncode, "wall_seconds": round(time.monotonic() - start, 1),
              # ru_maxrss of the children is the largest of them so far: this child's only when it is larger
              "max_rss_kib_children_so_far": peak, "max_rss_grew": peak > before}
    if line:
        record.update(json.loads(line[len("PROOF "):]))
    else:
        record["error"] = (res.stderr or res.stdout)[-2000:]
    return record


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("step_dir", type=Path)
    ap.add_argument("--old", type=Path, required=True, help="the earlier export.py")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds for both proofs together")
    args = ap.parse_args(argv)
    deadline = time.monotonic() + args.timeout
    record = {"step_dir": str(args.step_dir), "old": str(args.old)}
    record["today"] = run_one(str(REPO / "verl_lab_box"), "export", args.step_dir, deadline - time.monotonic())
    record["before"] = run_one(str(args.old.parent), args.old.stem, args.step_dir, deadline - time.monotonic())
    today, before = record["today"].get("seconds"), record["before"].get("seconds")
    if today and before:
        record["before_over_today"] = round(before / today, 2)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(record), flush=True)
    return 0


if __name__ == "__main__":
    os.umask(0o022)
    sys.exit(main())
