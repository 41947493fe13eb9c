"""Render a box's training launcher for a real GPU, to run its --check on that GPU.

Runs here (it needs pyinfra, which the GPU machine lacks): reads a real `nvidia-smi` query
output (default: the H200 capture in bench/gpu/results/h200-gpu-fact.txt), plans for that GPU
with tasks/plan.py, and writes what deploy/train.py would put in <lab_root>/train (launcher,
env file, plan.json, the GPU reader) into OUT/train. On the GPU machine, copy OUT to lab_root
and run: python3 <lab_root>/train/train-launcher --check   (bench/gpu/run_preflight.sh).
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from jinja2 import Environment, StrictUndefined  # noqa: E402

from tasks.facts import gpu as gpufact  # noqa: E402
from tasks.plan import make_plan  # noqa: E402
from tasks.settings import load_settings  # noqa: E402
from tasks.train import (ENV_TEMPLATE, GPU_MODULE, LAUNCHER_TEMPLATE, TrainingLayout,  # noqa: E402
                            training_workload)
from tasks.target import decide_gpu  # noqa: E402


def query_lines(path: Path) -> str:
    """The `--format=csv,noheader,nounits` answer lines of a capture file."""
    lines = [line for line in path.read_text().splitlines()
             if line[:1].isdigit() and line.count(",") >= 5 and "MiB" not in line]
    return "\n".join(lines) + "\n"


def render(src: Path, values: dict) -> str:
    env = Environment(undefined=StrictUndefined, keep_trailing_newline=True)
    return env.from_string(src.read_text()).render(values)


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
    values = layout.values()
    train = args.out / "train"
    if train.exists():
        shutil.rmtree(train)
    train.mkdir(parents=True)
    (train / "train-launcher").write_text(render(LAUNCHER_TEMPLATE, values))
    (train / "train.env").write_text(render(ENV_TEMPLATE, values))
    (train / "plan.json").write_text(layout.plan_json())
    shutil.copy(GPU_MODULE, train / "verl_lab_gpu.py")
    d = plan.to_dict()
    print(f"planned {target.count} x {target.name}: {d['rollout']} rollout, {d['train_dtype']}, "
          f"predicted peak {d['predicted_peak_mib']} MiB -> {train}")


if __name__ == "__main__":
    main()
