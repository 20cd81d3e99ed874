#!/usr/bin/env bash
# Store throughput and latency, dtrain's TcpStore vs PyTorch's TCPStore, in one run,
# alternating, for 1, 8 and 64 client processes. Needs scripts/build.sh and python3-torch.
# Usage: bench/store_bench.sh [pairs_per_client] [repeats]
set -euo pipefail
cd "$(dirname "$0")/.."
PAIRS="${1:-2000}"
REPEATS="${2:-3}"
[ -x build/bin/store_bench ] || { echo "build first: scripts/build.sh" >&2; exit 2; }
printf "%-8s %7s %7s %12s %8s %8s\n" impl clients pairs ops_per_s p50_us p99_us
for clients in 1 8 64; do
  for r in $(seq "$REPEATS"); do
    build/bin/store_bench "$clients" "$PAIRS"
    OMP_NUM_THREADS=1 /usr/bin/python3 bench/store_bench.py "$clients" "$PAIRS"
  done
done
