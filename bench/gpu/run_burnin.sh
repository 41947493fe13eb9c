#!/usr/bin/env bash
# The burn-in (issue 43, docs/burnin.md) on the device machine, from the repository root: four cards' burn-ins (the
# P40's PPO plan in fp32, the GTX 1080's offload plan, the RTX 3060's bf16 plan, the GTX 1080's LoRA plan) and one
# mutated run (the advantage's sign flipped: it must fail), side by side on the one H200, each capped as its card;
# then the read-back (reward first -> last, peaks against the plan, step seconds against the speed model, wall time).
#   bash bench/gpu/run_burnin.sh [-d SECONDS] [PROFILE ...]
# Rendered here first (this machine has no pyinfra/jinja2):
#   .venv/bin/python bench/gpu/payload.py                      # builds verl tree current-advantage-sign-flipped too
#   .venv/bin/python bench/gpu/burnin_profiles.py render
# Side by side the runs share the GPU and the CPUs: their seconds are each burn-in's under that load, not alone.
set -uo pipefail
. "$(dirname "$0")/limited_runs.sh"      # -d SECONDS (budget, default 560), specs_for
# each within the call: two verl start-ups (~65 s each alone), five steps of 64 sequences, a save, a load, the export
declare -A limit=([p40-burnin]=540 [gtx1080-burnin]=540 [rtx3060-burnin]=540 [gtx1080-lora-burnin]=540
                  [rtx3060-burnin-sign-flipped]=540)
[ $# -gt 0 ] || set -- p40-burnin gtx1080-burnin rtx3060-burnin gtx1080-lora-burnin rtx3060-burnin-sign-flipped
specs_for run_burnin.sh "$@" || exit 2
bash bench/gpu/run_ppo.sh -j "$#" -d "$budget" "${specs[@]}"
OUT=${OUT:-/tmp/gpu-out}
python3 bench/gpu/burnin_results.py "$OUT/runs" "$@"
