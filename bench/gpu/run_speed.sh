#!/usr/bin/env bash
# The 8-12 GB cards' speed (issue 29) on the device machine, from the repository root: their plans before the
# speed work (code "speed-before") and as they are now, one at a time, then prompts/s and the ratios.
#   bash bench/gpu/run_speed.sh [-d SECONDS] [all | before | after | PROFILE ...]
# PROFILE: gtx1080-before, gtx1080-after, rtx3060-before, rtx3060-after, rtx2080ti-before, rtx2080ti-after,
# rtx2080ti-gathered (bench/gpu/ppo_profiles.py SPEED_PROFILES). Rendered here first (this machine has no
# pyinfra/jinja2):
#   .venv/bin/python bench/gpu/payload.py
#   .venv/bin/python bench/gpu/ppo_profiles.py render --only gtx1080-before,gtx1080-after,...
# Each profile runs with its own time limit (its expected seconds from the recorded step times, 2 steps and
# verl's ~65 s of start-up, with room), all within -d seconds of the start (default 560: one device call with
# the ~40 s of setup). runs.tgz comes back as with run_ppo.sh; bench/gpu/ppo_results.py RUNS --speed prints
# the full table (peak against prediction and cap, the log-prob gap, where the time went) here.
set -uo pipefail
. "$(dirname "$0")/limited_runs.sh"      # -d SECONDS (budget), specs_for
# each run's time limit: ~65 s of start-up + 2 steps (before: GPU calls 10 and 13; after: the speed model,
# tasks/speed.py) + the probe's profiling windows, with room
declare -A limit=([gtx1080-before]=480 [rtx3060-before]=360 [rtx2080ti-before]=380
                  [gtx1080-after]=260 [rtx3060-after]=200 [rtx2080ti-after]=250 [rtx2080ti-gathered]=250)
case "${1:-all}" in
  all) set -- gtx1080-after rtx3060-after rtx2080ti-after gtx1080-before rtx3060-before rtx2080ti-before ;;
  before) set -- gtx1080-before rtx3060-before rtx2080ti-before ;;
  after) set -- gtx1080-after rtx3060-after rtx2080ti-after ;;
esac
specs_for run_speed.sh "$@" || exit 2
bash bench/gpu/run_ppo.sh -d "$budget" "${specs[@]}"
OUT=${OUT:-/tmp/gpu-out}
python3 bench/gpu/ppo_results.py "$OUT/runs" --ratios "$@"
