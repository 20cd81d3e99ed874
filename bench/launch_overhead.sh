#!/usr/bin/env bash
# Launch overhead: wall time of launching 2 workers that exit at once, dtrain vs torchrun,
# interleaved in one run so both see the same machine noise. Prints medians and the ratio.
# Usage: bench/launch_overhead.sh [runs]   (needs build/bin/dtrain and python3-torch)
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS="${1:-15}"
DTRAIN=build/bin/dtrain
TORCHRUN=(/usr/bin/python3 -m torch.distributed.run --redirects 9:1 --tee 9:1 --nproc_per_node 2 --no_python true)
[ -x "$DTRAIN" ] || { echo "build first: scripts/build.sh" >&2; exit 2; }
now() { date +%s%N; }
d=(); t=()
for i in $(seq "$RUNS"); do
  s=$(now); "$DTRAIN" run --nproc-per-node 2 -- true >/dev/null 2>&1; d+=($(( $(now) - s )))
  s=$(now); OMP_NUM_THREADS=1 "${TORCHRUN[@]}" >/dev/null 2>&1; t+=($(( $(now) - s )))
done
python3 bench/compare_medians.py "${d[*]}" "${t[*]}"
