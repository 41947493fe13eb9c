#!/usr/bin/env bash
# The GPU harness on the device machine, from the repository root:
#   bash bench/gpu/run_ppo.sh [-j N] [-t SECONDS] PROFILE...
# Installs the payload (.gpu/, built here by bench/gpu/payload.py and bench/gpu/ppo_profiles.py),
# makes the random-weight model once, runs each profile (bench/gpu/run_profile.py), N at a time
# (default 1: one at a time, the only way its timings mean anything), and packs every log and
# probe record into $OUT/runs.tgz for bench/gpu/ppo_results.py.
set -uo pipefail
jobs=1; timeout=540
while getopts "j:t:" opt; do
  case $opt in j) jobs=$OPTARG ;; t) timeout=$OPTARG ;; *) exit 2 ;; esac
done
shift $((OPTIND - 1))
OUT=${OUT:-/tmp/gpu-out}
runs=$OUT/runs
mkdir -p "$runs"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
start=$(date +%s)
bash bench/gpu/install.sh > "$runs/install.log" 2>&1 || { tail -30 "$runs/install.log"; exit 1; }
export PYTHONPATH=${SITE:-/tmp/site}
python3 bench/gpu/make_model.py --out /tmp/model --tokenizer .gpu/tokenizer > "$runs/model.log" 2>&1 \
  || { tail -30 "$runs/model.log"; exit 1; }
unset PYTHONPATH
echo "setup took $(( $(date +%s) - start )) s"
nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv,noheader > "$runs/nvidia-smi.txt"
stop=(); [ "$jobs" = 1 ] && stop=(--ray-stop)
running=0
for p in "$@"; do
  python3 bench/gpu/run_profile.py "$p" --out "$runs" --timeout "$timeout" "${stop[@]}" &
  running=$((running + 1))
  if [ "$running" -ge "$jobs" ]; then wait -n; running=$((running - 1)); fi
done
wait
echo "all took $(( $(date +%s) - start )) s"
tar czf "$OUT/runs.tgz" -C "$OUT" runs
for p in "$@"; do echo "== $p"; tail -3 "$runs/$p/console.log" 2>/dev/null | cut -c1-300; done
