#!/usr/bin/env bash
# LoRA (issue 35) on the device machine, from the repository root: each 8-12 GB card's LoRA plan against the same
# card's full plan (its *-after profile) one at a time in one call, the 3B with LoRA on 24 GB cards, and one LoRA
# run to its end; then prompts/s against each run's compare_with.
#   bash bench/gpu/run_lora.sh [-d SECONDS] [gtx1080 | rtx2080ti | rtx3060 | 3b | export | i42a | i42b | i42-export
#                                            | PROFILE ...]
# Rendered here first (this machine has no pyinfra/jinja2), with i35verl's LoRA patches in the payload's verl tree:
#   .venv/bin/python bench/gpu/payload.py
#   .venv/bin/python bench/gpu/ppo_profiles.py render --only gtx1080-after,gtx1080-lora,...
# Each profile runs with its own time limit (~65 s of start-up + its steps by the speed model, with room), all
# within -d seconds of the start (default 560: one device call with the ~40 s of setup). runs.tgz comes back as
# with run_ppo.sh; here, bench/gpu/ppo_results.py RUNS --speed and --markdown give peaks against the prediction.
set -uo pipefail
. "$(dirname "$0")/limited_runs.sh"      # -d SECONDS (budget), specs_for
# the full plans' limits as run_speed.sh's; the LoRA runs: 2 steps of the speed model's 28-55 s on the H200
# (tasks/speed.py gpu_step_seconds) + start-up + the probe's windows; the 3B: HF generation of a 3B model (fp32 on
# the P40 plan) is about 6x the 0.5B's FLOPs; the export: 3 steps of 16 prompts, three saves, merge, proof, scores
# issue 42's runs (one step of 16 prompts each: bench/gpu/ppo_profiles.py I42_*): ~60 s of start-up + the speed
# model's step at 16 prompts (generation one chunk: 20-38 s; the rest a quarter of the plan's) with room; the export:
# one step, the save, verl's merger, the LoRA merge and proof, two GSM8K scorings of 256 rows (~190 s)
declare -A limit=([gtx1080-after]=260 [rtx2080ti-after]=250 [rtx3060-after]=200
                  [gtx1080-lora]=260 [rtx2080ti-lora]=250 [rtx3060-lora]=200
                  [p40-3b-lora]=540 [rtx3090-3b-lora]=540 [gtx1080-lora-export]=500
                  [gtx1080-full-i42]=150 [gtx1080-lora-i42]=130 [rtx3060-full-i42]=140 [rtx3060-lora-i42]=120
                  [rtx2080ti-full-i42]=150 [rtx2080ti-lora-i42]=130 [rtx3060-lora-export]=250)
jobs=1
case "${1:-}" in
  gtx1080) set -- gtx1080-after gtx1080-lora ;;
  rtx2080ti) set -- rtx2080ti-after rtx2080ti-lora ;;
  rtx3060) set -- rtx3060-after rtx3060-lora ;;
  3b) set -- p40-3b-lora rtx3090-3b-lora; jobs=2 ;;     # side by side: peaks are what they show, not speed
  export) set -- gtx1080-lora-export ;;
  i42a) set -- gtx1080-full-i42 gtx1080-lora-i42 rtx3060-full-i42 rtx3060-lora-i42 ;;    # issue 42, one at a time
  i42b) set -- rtx2080ti-full-i42 rtx2080ti-lora-i42 rtx3060-lora-export ;;
  i42-export) set -- rtx3060-lora-export ;;
  "") echo "run_lora.sh: CALL is one of gtx1080, rtx2080ti, rtx3060, 3b, export, i42a, i42b, i42-export or profile" \
           "names (${!limit[*]})" >&2
      exit 2 ;;
esac
specs_for run_lora.sh "$@" || exit 2
bash bench/gpu/run_ppo.sh -j "$jobs" -d "$budget" "${specs[@]}"
OUT=${OUT:-/tmp/gpu-out}
python3 bench/gpu/ppo_results.py "$OUT/runs" --scaling "$@"
python3 bench/gpu/lora_pairs.py "$OUT/runs" "$@"
