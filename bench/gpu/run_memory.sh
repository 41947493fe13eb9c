#!/usr/bin/env bash
# What the device machine runs (from the repository root): the GPU facts, then the memory
# calibration. Results land in $OUT (the device tool brings them back); copy them to
# bench/gpu/results/ afterwards.
set -uo pipefail
OUT="${OUT:-/tmp/memory-out}"
mkdir -p "$OUT"
fact="$OUT/h200-gpu-fact.txt"
{
  echo '$ nvidia-smi --query-gpu=index,name,compute_cap,memory.total,memory.used,memory.free,driver_version --format=csv,noheader,nounits'
  nvidia-smi --query-gpu=index,name,compute_cap,memory.total,memory.used,memory.free,driver_version --format=csv,noheader,nounits
  echo
  echo '$ nvidia-smi -L'
  nvidia-smi -L
  echo
  echo '$ python3 bench/gpu/gpu_fact.py   # NVML through nvidia-ml-py'
  python3 bench/gpu/gpu_fact.py
} >"$fact" 2>&1
cat "$fact"
python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__, "cuda", torch.cuda.is_available())'
PYTHONUNBUFFERED=1 python3 bench/gpu/calibrate_memory.py --out "$OUT/${RESULT_NAME:-memory-h200.json}" \
  --budget-s "${BUDGET_S:-420}" "$@" 2>&1 | tee "$OUT/calibrate.log"
