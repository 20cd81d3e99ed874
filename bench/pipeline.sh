#!/usr/bin/env bash
# Pipeline parallelism on the CPU: samples/s and the measured bubble fraction for P = 1 and
# P = 2 stages x M = 1, 2, 4, 8 micro-batches (schedule 1f1b; gpipe with BENCH_SCHEDULE=gpipe),
# one replica, 1 BLAS thread per worker. Model: MLP 16-W-W-W-W-W-10 (W = BENCH_WIDTH, 1024),
# split into two stages of equal compute, not only equal parameters: stage 0 = 16-W-W-W,
# stage 1 = W-W-W-10. Per sample, in units of W multiply-adds: stage 0's first layer has no
# input gradient to compute (forward + weight gradient: 2 x 16), stage 1's last one has all
# three (3 x 10): 6W + 32 against 6W + 30. (An input of 64, used until 2026-12-07, made
# stage 0 2% slower: 6W + 128, and that 2% showed as bubble, ~0.01 at M = 8.)
# The (P-1)/(M+P-1) theory assumes equal stages; with unequal ones the faster stage waits
# for the slower one and that shows as bubble too. Batch BENCH_BATCH (1024) per step, so
# that at M = 8 a micro-batch is 128 rows: with 32 (batch 256) each micro-batch's compute
# is ~1 ms and the exchanges' fixed costs (copy, wake-up) are a visible share of it.
# P = 1 is the data-parallel trainer with one worker (no micro-batches: M does not apply).
# Each configuration REPEATS times; prints medians, the ideal (P-1)/(M+P-1), and the stages'
# compute in ms per step (of the run with the median bubble).
# DTRAIN_TRACE_DIR=DIR also writes a Chrome trace per rank of the last configuration run.
# Usage: bench/pipeline.sh [steps] [repeats]
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS="${1:-20}"; REPEATS="${2:-3}"; SCHEDULE="${BENCH_SCHEDULE:-1f1b}"
W="${BENCH_WIDTH:-1024}"; BATCH="${BENCH_BATCH:-1024}"
[ -x build/bin/dtrain ] || { echo "build first: scripts/build.sh" >&2; exit 2; }
T="$(mktemp -d)"; trap 'rm -rf "$T"' EXIT
run() {  # stages micro -> "samples/s bubble span/ideal stage-ms/stage-ms"
  cat > "$T/s.json" <<JSON
{"nproc_per_node": $1, "env": {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"},
 "trainer": {"model": {"layers": [16, $W, $W, $W, $W, $W, 10]}, "data": {"train_samples": 1000000, "eval_samples": 0},
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
    print(f"{t['samples_per_s']:.0f} 0 1 -"); sys.exit()
ms = t["stage_ms"]
span = sum(ms) / (P * (1 - t["bubble_fraction"]))
print(f"{t['samples_per_s']:.0f} {t['bubble_fraction']:.4f} {span / ((M + P - 1) / M * max(ms)):.4f} "
      + "/".join(f"{x:.1f}" for x in ms))
PY
}
printf "%-4s %-4s %10s %8s %8s %10s %14s   %s\n" P M samples/s bubble ideal span/ideal "stage ms" "runs (samples/s/bubble)"
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
# the stage times of the run with the median bubble
mid = sorted(rs, key=lambda r: float(r[1]))[len(rs) // 2][3]
ideal = (P - 1) / (M + P - 1)
print(f"{P:<4} {M:<4} {sps:>10.0f} {bub:>8.3f} {ideal:>8.3f} {eff:>10.3f} {mid:>14}   " + " ".join(f"{float(r[0]):.0f}/{float(r[1]):.3f}" for r in rs))
PY
done
