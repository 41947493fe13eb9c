#!/usr/bin/env bash
# Several GPUs and two Ray nodes (issue 27) on the device's nvidia-h200-x2 (two H200s), from the repository
# root, one device call per CALL (docs/training-runs.md, "Pending: issue 27", has the calls, their timeouts and
# what to read back):
#   bash bench/gpu/run_multi.sh [-d SECONDS] CALL
#     p40         p40-2gpu, then p40-1gpu: the P40 plan for a box of two cards (PPO with the critic, FSDP1 sharded
#                 over both, fp32, HF rollout; 2 steps and validation), then for one card (2 steps, the baseline):
#                 2 GPUs / 1 GPU in prompts/s
#     gtx1080     gtx1080-2gpu, then gtx1080-1gpu: the same for the GTX 1080 plan (grpo-cpu-offload, FSDP2)
#     cluster     p40-2nodes: two Ray nodes on the host formed with the product's Ray units (head 127.0.0.2 on
#                 GPU 0, worker 127.0.0.3 on GPU 1), the launcher's cluster-check, the cluster plan
#                 (trainer.nnodes=2); against p40-2gpu of the p40 call (2 nodes / 1 box): make it right after
#     checkpoint  gtx1080-2gpu-export: a 2-GPU run saves step 1, a second run resumes it, trains and saves
#                 step 2, and the launcher exports both ranks' shards, proves and scores the export
#     socket      p40-2nodes-socket: p40-2nodes with NCCL's P2P and shared-memory transports off (sockets over
#                 lo, as between machines); not part of the four, its time is not known
#     PROFILE...  any of the profiles below by name (e.g. a baseline cut by its call's deadline, alone)
# The 2-GPU run goes first: it is what the issue asks for; the baseline takes what is left of the call.
# Rendered here first (this machine has no pyinfra/jinja2):
#   .venv/bin/python bench/gpu/payload.py
#   .venv/bin/python bench/gpu/ppo_profiles.py render --only p40-1gpu,p40-2gpu,gtx1080-1gpu,gtx1080-2gpu,p40-2nodes,gtx1080-2gpu-export,p40-2nodes-socket
# Time (the call's 600 s; setup ~40-80 s when cold: install.sh and the random model; a machine still warm from
# the call before skips the install). Each run's limit below: verl's ~60-70 s start-up and its steps from the
# single-GPU runs of GPU calls 4 (the P40 plan: 45-48 s a step, 11 s of validation) and 8-10 (the GTX 1080 plan
# before the speed work: 171-213 s for its first step), and tasks/speed.py for the GTX 1080 plan as it is now
# (103 s a step on one GPU, 50 on two: never measured), with room; a run past its limit is cut and what it
# finished comes back. Expected:
#   p40         p40-2gpu ~150 s + p40-1gpu ~155 s (60 start + 48 + 45)                          ~340-390 s
#   gtx1080     gtx1080-2gpu ~200 s (65 + 2 x 50 + validation) + gtx1080-1gpu ~290 s (65 + 2 x 103 + room)
#               ~500 s warm; cold, or if the speed model is low, the baseline is cut: run `gtx1080-1gpu` alone
#   cluster     forming ~15 s + cluster-check ~10 s + p40-2nodes ~150 s                           ~190-260 s
#   checkpoint  two starts, 2 small steps, 2 saves (5.9 GB), the merge, proof and two GSM8K scores ~330 s
# -d (default 560): every run ends within this many seconds of the start, setup included.
# runs.tgz comes back as with run_ppo.sh; here: bench/gpu/ppo_results.py RUNS --multi (RUNS: the calls'
# runs.tgz unpacked into one folder, so the cluster run finds p40-2gpu to compare with).
set -uo pipefail
. "$(dirname "$0")/limited_runs.sh"      # -d SECONDS (budget), specs_for
declare -A limit=([p40-2gpu]=220 [p40-1gpu]=230 [gtx1080-2gpu]=260 [gtx1080-1gpu]=400 [p40-2nodes]=300
                  [gtx1080-2gpu-export]=480 [p40-2nodes-socket]=480)
case "${1:-}" in
  p40) set -- p40-2gpu p40-1gpu ;;
  gtx1080) set -- gtx1080-2gpu gtx1080-1gpu ;;
  cluster) set -- p40-2nodes ;;
  checkpoint) set -- gtx1080-2gpu-export ;;
  socket) set -- p40-2nodes-socket ;;
  *) [ -n "${1:-}" ] && [ -n "${limit[$1]:-}" ] || {
       echo "run_multi.sh: CALL is one of p40, gtx1080, cluster, checkpoint, socket or profile names" \
            "(${!limit[*]}); got '${1:-}'" >&2; exit 2; } ;;
esac
specs_for run_multi.sh "$@" || exit 2
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')
[ "$gpus" -ge 2 ] || { echo "run_multi.sh: these runs need 2 GPUs (nvidia-h200-x2), nvidia-smi lists ${gpus}" >&2; exit 2; }
bash bench/gpu/run_ppo.sh -d "$budget" "${specs[@]}"
OUT=${OUT:-/tmp/gpu-out}
python3 bench/gpu/ppo_results.py "$OUT/runs" --scaling "$@"
