"""Lay out a box's training dir for a real GPU, to run the launcher's --check on that GPU.

Runs here (it needs pyinfra, which the GPU machine lacks): reads a real `nvidia-smi` query
output (default: the H200 capture in bench/gpu/results/h200-gpu-fact.txt), plans for that GPU
with tasks/plan/, and writes what deploy/train.py would put in <lab_root>/train (launcher,
env file, plan.json, the GPU reader: tasks.train.training_wanted) into OUT/train. On the GPU machine, copy OUT to lab_root
and run: python3 <lab_root>/train/train-launcher --check   (bench/gpu/run_preflight.sh).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tasks.plan import make_plan  # noqa: E402
from tasks.settings import load_settings  # noqa: E402
from tasks.target import decide_gpu  # noqa: E402
from tasks.train import TrainingLayout, training_wanted, training_workload  # noqa: E402
from verl_lab_box import gpu as gpufact  # noqa: E402


def query_lines(path: Path) -> str:
    """The `--format=csv,noheader,nounits` answer lines of a capture file."""
    lines = [line for line in path.read_text().splitlines()
             if line[:1].isdigit() and line.count(",") >= 5 and "MiB" not in line]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--capture", type=Path, default=REPO / "bench/gpu/results/h200-gpu-fact.txt")
    ap.add_argument("--lab-root", default="/tmp/verl-lab-preflight")
    ap.add_argument("--python", default="/usr/bin/python3", help="the launcher's python on the GPU machine")
    ap.add_argument("out", type=Path)
    args = ap.parse_args()
    # the capture's query asked for memory.used too (see its first line)
    fields = ("index", "name", "compute_cap", "memory.total", "memory.used", "memory.free", "driver_version")
    inventory = gpufact.parse_gpu_query(query_lines(args.capture), fields)
    settings = load_settings("gpu-machine", {"lab_root": args.lab_root, "env_prefix": f"{args.lab_root}/env",
                                             "launcher_python": args.python})
    gpu = decide_gpu(settings, inventory)
    if gpu.target is None:
        raise SystemExit(gpu.problem)
    target, source = gpu.target, gpu.source
    plan = make_plan(target, training_workload(settings))
    layout = TrainingLayout(settings=settings, plan=plan, plan_source=source)
    train = args.out / "train"
    if train.exists():
        shutil.rmtree(train)
    train.mkdir(parents=True)
    for want in training_wanted(layout):
        if want.content is None or not want.path.startswith(layout.train_dir + "/"):
            continue                         # folders, and the unit under /etc/systemd
        path = train / os.path.relpath(want.path, layout.train_dir)
        path.write_bytes(want.content)
        path.chmod(0o755 if want.path == layout.launcher else 0o644)
    d = plan.to_dict()
    print(f"planned {target.count} x {target.name}: {d['rollout']} rollout, {d['train_dtype']}, "
          f"predicted peak {d['predicted_peak_mib']} MiB -> {train}")


if __name__ == "__main__":
    main()
