#!/usr/bin/env bash
# csv data sets: the time dtrain takes to read and check a csv file before launch
# (`dtrain validate`, which parses it as the launcher and every worker do) vs numpy.loadtxt,
# what a PyTorch script without pandas uses, on the same generated file. Alternating runs.
# Needs scripts/build.sh and python3-numpy.
# Usage: bench/csv_load.sh [rows] [feature columns] [rounds]   (defaults: 200000 64 3)
set -euo pipefail
cd "$(dirname "$0")/.."
ROWS="${1:-200000}"
COLS="${2:-64}"
ROUNDS="${3:-3}"
[ -x build/bin/dtrain ] || { echo "build first: scripts/build.sh" >&2; exit 2; }
DIR="$(mktemp -d "${TMPDIR:-/tmp}/dtrain-csv-bench.XXXXXX")"
trap 'rm -rf "$DIR"' EXIT
/usr/bin/python3 - "$DIR/data.csv" "$ROWS" "$COLS" <<'PY'
import random, sys
path, rows, cols = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
random.seed(1)
with open(path, "w") as f:
    f.write(",".join(f"f{i}" for i in range(cols)) + ",label\n")
    for r in range(rows):
        f.write(",".join(f"{random.gauss(0, 1):.5f}" for _ in range(cols)) + f",{r % 10}\n")
PY
cat >"$DIR/job.json" <<JSON
{"nproc_per_node": 1, "trainer": {"model": {"layers": [$COLS, 64, 10]},
 "data": {"type": "csv", "path": "$DIR/data.csv", "label_column": "label"}, "batch_size": 64, "epochs": 1}}
JSON
echo "# $(stat -c %s "$DIR/data.csv") bytes, $ROWS rows x $((COLS + 1)) columns"
printf "%-14s %8s\n" impl seconds
for _ in $(seq "$ROUNDS"); do
  s=$(date +%s.%N); build/bin/dtrain validate "$DIR/job.json" >/dev/null; e=$(date +%s.%N)
  printf "%-14s %8.3f\n" dtrain "$(echo "$e - $s" | bc)"
  /usr/bin/python3 -c "
import sys, time, numpy
t = time.perf_counter(); a = numpy.loadtxt(sys.argv[1], delimiter=',', skiprows=1, dtype=numpy.float32)
print(f'{\"numpy.loadtxt\":<14} {time.perf_counter() - t:8.3f}')" "$DIR/data.csv"
done
