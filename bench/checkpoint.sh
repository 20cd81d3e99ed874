#!/usr/bin/env bash
# Checkpoint write + read-back, dtrain's trainer format vs torch.save/torch.load with the same
# durability (fsync, rename), alternating in one run. Needs scripts/build.sh and python3-torch.
# Usage: bench/checkpoint.sh [params,...] [reps] [rounds]   (defaults: 1863690,25000000 7 3)
# 1863690 = the issue's MLP 784-1024-1024-10.
set -euo pipefail
cd "$(dirname "$0")/.."
SIZES="${1:-1863690,25000000}"
REPS="${2:-7}"
ROUNDS="${3:-3}"
[ -x build/bin/checkpoint_bench ] || { echo "build first: scripts/build.sh" >&2; exit 2; }
DIR="$(mktemp -d "${TMPDIR:-/tmp}/dtrain-ckpt-bench.XXXXXX")"
trap 'rm -rf "$DIR"' EXIT
printf "%-8s %10s %12s %9s %9s\n" impl params bytes save_ms load_ms
for _ in $(seq "$ROUNDS"); do
  build/bin/checkpoint_bench "$DIR/d" "$SIZES" "$REPS"
  OMP_NUM_THREADS=1 /usr/bin/python3 bench/checkpoint_torch.py "$DIR/t" "$SIZES" "$REPS"
done
