#!/usr/bin/env bash
# Launch overhead: wall time of launching NPROC workers that exit at once, dtrain vs torchrun,
# interleaved in one run so both see the same machine noise. Prints medians and the ratio.
# Usage: bench/launch_overhead.sh [runs]   (needs build/bin/dtrain and python3-torch)
#   NPROC=N            workers per launch (default 2)
#   DTRAIN=PATH        the dtrain binary (default build/bin/dtrain)
#   BASELINE=PATH      another dtrain binary (an older build) run in the same interleaving
#   WITH_TORCHRUN=0    leave torchrun out (it takes ~7 s a launch here)
# torchrun is timed twice: as Debian's torch 1.13 runs it by default ("torchrun", whose agent
# sleeps its 5 s monitor interval before it first looks at the workers), and tuned with
# --monitor_interval 0.1 ("torchrun-0.1", the default since torch 2.4): the peer at its best.
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS="${1:-15}"
NPROC="${NPROC:-2}"
DTRAIN="${DTRAIN:-build/bin/dtrain}"
TORCHRUN=(/usr/bin/python3 -m torch.distributed.run --redirects 9:1 --tee 9:1 --nproc_per_node "$NPROC" --no_python true)
TORCHRUN_FAST=(/usr/bin/python3 -m torch.distributed.run --redirects 9:1 --tee 9:1 --monitor_interval 0.1 --nproc_per_node "$NPROC" --no_python true)
[ -x "$DTRAIN" ] || { echo "build first: scripts/build.sh" >&2; exit 2; }
# Wall time in ns of "$@" into the array named by $1, read from $EPOCHREALTIME (bash 5):
# no extra process inside the timed span.
timed() {
  local -n out=$1; shift
  local s=${EPOCHREALTIME/./}
  "$@" >/dev/null 2>&1 || true
  local e=${EPOCHREALTIME/./}
  out+=($(( (e - s) * 1000 )))
}
d=(); b=(); t=(); f=()
for i in $(seq "$RUNS"); do
  timed d "$DTRAIN" run --nproc-per-node "$NPROC" -- true
  [ -n "${BASELINE:-}" ] && timed b "$BASELINE" run --nproc-per-node "$NPROC" -- true
  if [ "${WITH_TORCHRUN:-1}" != 0 ]; then
    timed t env OMP_NUM_THREADS=1 "${TORCHRUN[@]}"
    timed f env OMP_NUM_THREADS=1 "${TORCHRUN_FAST[@]}"
  fi
done
args=(--named dtrain "${d[*]}")
[ -n "${BASELINE:-}" ] && args+=(baseline "${b[*]}")
[ ${#t[@]} -gt 0 ] && args+=(torchrun "${t[*]}" torchrun-0.1 "${f[*]}")
python3 bench/compare_medians.py "${args[@]}"
