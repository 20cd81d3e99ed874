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
python3 - "${d[*]}" "${t[*]}" <<'PY'
import statistics, sys
d = [int(x) / 1e6 for x in sys.argv[1].split()]
t = [int(x) / 1e6 for x in sys.argv[2].split()]
md, mt = statistics.median(d), statistics.median(t)
print(f"{'launcher':<10} {'runs':>5} {'median_ms':>10} {'min_ms':>8} {'max_ms':>8}")
print(f"{'dtrain':<10} {len(d):>5} {md:>10.1f} {min(d):>8.1f} {max(d):>8.1f}")
print(f"{'torchrun':<10} {len(t):>5} {mt:>10.1f} {min(t):>8.1f} {max(t):>8.1f}")
print(f"ratio (torchrun / dtrain median): {mt / md:.1f}x")
PY
