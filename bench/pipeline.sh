#!/usr/bin/env bash
# Pipeline parallelism on the CPU: samples/s and the measured bubble fraction for P = 1 and
# P = 2 stages x M = 1, 2, 4, 8 micro-batches (schedule 1f1b; gpipe with BENCH_SCHEDULE=gpipe),
# one replica, 1 BLAS thread per worker. Model: MLP 64-W-W-W-W-W-10 (W = BENCH_WIDTH, 1024),
# split into two stages of equal compute, not only equal parameters: stage 0 = 64-W-W-W
# (its first layer has no input gradient to compute, and it is tiny), stage 1 = W-W-W-10.
# The (P-1)/(M+P-1) theory assumes equal stages; with unequal ones the faster stage waits
# for the slower one and that shows as bubble too. Batch BENCH_BATCH (256) per step.
# P = 1 is the data-parallel trainer with one worker (no micro-batches: M does not apply).
# Each configuration REPEATS times; prints medians and the ideal (P-1)/(M+P-1).
# DTRAIN_TRACE_DIR=DIR also writes a Chrome trace per rank of the last configuration run.
# Usage: bench/pipeline.sh [steps] [repeats]
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS="${1:-20}"; REPEATS="${2:-3}"; SCHEDULE="${BENCH_SCHEDULE:-1f1b}"
W="${BENCH_WIDTH:-1024}"; BATCH="${BENCH_BATCH:-256}"
[ -x build/bin/dtrain ] || { echo "build first: scripts/build.sh" >&2; exit 2; }
T="$(mktemp -d)"; trap 'rm -rf "$T"' EXIT
run() {  # stages micro -> "samples/s bubble span/ideal"
  cat > "$T/s.json" <<JSON
{"nproc_per_node": $1, "env": {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"},
 "trainer": {"model": {"layers": [64, $W, $W, $W, $W, $W, 10]}, "data": {"train_samples": 1000000, "eval_samples": 0},
  "batch_size": $BATCH, "max_steps": $STEPS, "optimizer": {"lr": 0.005, "momentum": 0.9}, "device": "cpu",
  "log_every_steps": 1000000, "parallel": {"pipeline_stages": $1, "micro_batches": $2, "schedule": "$SCHEDULE"}}}
JSON
  build/bin/dtrain run "$T/s.json" --summary-json "$T/sum.json" >/dev/null 2>&1
  # span/ideal: the measured step span (from the bubble and the stages' compute) over the
  # ideal schedule's for these stages, (M+P-1)/M x the slowest stage's compute.
  python3 - "$T/sum.json" "$1" "$2" <<'PY'
import json, sys
t = json.load(open(sys.argv[1]))["trainer"]
P, M = int(sys.argv[2]), int(sys.argv[3])
if P == 1:
    print(f"{t['samples_per_s']:.0f} 0 1"); sys.exit()
ms = t["stage_ms"]
span = sum(ms) / (P * (1 - t["bubble_fraction"]))
print(f"{t['samples_per_s']:.0f} {t['bubble_fraction']:.4f} {span / ((M + P - 1) / M * max(ms)):.4f}")
PY
}
printf "%-4s %-4s %10s %8s %8s %10s   %s\n" P M samples/s bubble ideal span/ideal "runs (samples/s/bubble)"
for cfg in "1 1" "2 1" "2 2" "2 4" "2 8"; do
  set -- $cfg
  runs=""
  for i in $(seq "$REPEATS"); do runs+="$(run "$1" "$2"),"; done
  python3 - "$1" "$2" "$runs" <<'PY'
import statistics, sys
P, M = int(sys.argv[1]), int(sys.argv[2])
rs = [r.split() for r in sys.argv[3].strip(",").split(",")]
sps = statistics.median(float(r[0]) for r in rs)
bub = statistics.median(float(r[1]) for r in rs)
eff = statistics.median(float(r[2]) for r in rs)
ideal = (P - 1) / (M + P - 1)
print(f"{P:<4} {M:<4} {sps:>10.0f} {bub:>8.3f} {ideal:>8.3f} {eff:>10.3f}   " + " ".join(f"{float(r[0]):.0f}/{float(r[1]):.3f}" for r in rs))
PY
done
