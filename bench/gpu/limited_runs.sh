# Sourced by the device's one-command wrappers of run_ppo.sh (run_speed.sh, run_multi.sh), run from the repository
# root: their `-d SECONDS` option (every run ends within that many seconds of the start, setup included; default
# 560: one device call) in `budget`, the caller's arguments shifted past it, and `specs_for`.
budget=560
while getopts "d:" opt; do
  case $opt in d) budget=$OPTARG ;; *) exit 2 ;; esac
done
shift $((OPTIND - 1))

# specs_for CALLER PROFILE...: `specs` = PROFILE:SECONDS for each, its time limit from the caller's `limit` array;
# returns 2 (saying why) on a profile without a limit or not rendered into .gpu/profiles, before anything runs
specs_for() {
  local caller=$1 p
  shift
  specs=()
  for p in "$@"; do
    [ -n "${limit[$p]:-}" ] || { echo "$caller: unknown profile $p (known: ${!limit[*]})" >&2; return 2; }
    [ -f ".gpu/profiles/$p/profile.json" ] || { echo "$caller: $p is not rendered (.gpu/profiles/$p)" >&2; return 2; }
    specs+=("$p:${limit[$p]}")
  done
}
