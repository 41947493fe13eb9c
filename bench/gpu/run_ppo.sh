#!/usr/bin/env bash
# The GPU harness on the device machine, from the repository root:
#   bash bench/gpu/run_ppo.sh [-j N] [-t SECONDS] [-d SECONDS] PROFILE[:SECONDS]...
# Installs the payload (.gpu/, built here by bench/gpu/payload.py and bench/gpu/ppo_profiles.py),
# makes the random-weight model once, runs each profile (bench/gpu/run_profile.py), N at a time
# (default 1: one at a time, the only way its timings mean anything), and packs every log and
# probe record into $OUT/runs.tgz for bench/gpu/ppo_results.py (packed again after every profile,
# so a call cut at its time limit still brings back what finished).
set -uo pipefail
jobs=1; timeout=540; budget=560
# -d: every run ends within this many seconds of the start, however its own timeout reads: a
# run cut by the device call's limit instead would live on (its own session) into the next call
while getopts "j:t:d:" opt; do
  case $opt in j) jobs=$OPTARG ;; t) timeout=$OPTARG ;; d) budget=$OPTARG ;; *) exit 2 ;; esac
done
shift $((OPTIND - 1))
OUT=${OUT:-/tmp/gpu-out}
runs=$OUT/runs
mkdir -p "$runs"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
start=$(date +%s)
deadline=$((start + budget))
bash bench/gpu/install.sh > "$runs/install.log" 2>&1 || { tail -30 "$runs/install.log"; exit 1; }
export PYTHONPATH=${SITE:-/tmp/site}
python3 bench/gpu/make_model.py --out /tmp/model --tokenizer .gpu/tokenizer > "$runs/model.log" 2>&1 \
  || { tail -30 "$runs/model.log"; exit 1; }
unset PYTHONPATH
echo "setup took $(( $(date +%s) - start )) s"
nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv,noheader > "$runs/nvidia-smi.txt"
df -B1 /tmp > "$runs/disk-before.txt" 2>&1   # checkpoints go under /tmp/vl: export profiles write GBs
stop=(); [ "$jobs" = 1 ] && stop=(--ray-stop)
pack() { tar czf "$OUT/runs.tgz.part" -C "$OUT" runs && mv "$OUT/runs.tgz.part" "$OUT/runs.tgz"; }
running=0
for spec in "$@"; do
  p=${spec%%:*}; t=$timeout; [ "$p" != "$spec" ] && t=${spec#*:}
  ( python3 bench/gpu/run_profile.py "$p" --out "$runs" --timeout "$t" --deadline "$deadline" "${stop[@]}"; pack ) &
  running=$((running + 1))
  if [ "$running" -ge "$jobs" ]; then wait -n; running=$((running - 1)); fi
done
wait
df -B1 /tmp > "$runs/disk-after.txt" 2>&1
pack
echo "all took $(( $(date +%s) - start )) s"
for spec in "$@"; do p=${spec%%:*}; echo "== $p $(cat "$runs/$p/run.json" 2>/dev/null)"
  grep -E "step:[0-9]+ -" "$runs/$p/console.log" 2>/dev/null | sed -E 's/.*(step:[0-9]+).*(timing_s\/step:[0-9.]+).*/\1 \2/' | tail -6
  grep -E "Error|error:" "$runs/$p/console.log" 2>/dev/null | grep -v "^.*Warning" | tail -3 | cut -c1-300; done
