#!/usr/bin/env bash
# Training throughput, the built-in trainer vs PyTorch DDP (gloo), same MLP 784-1024-1024-10,
# ReLU, SGD momentum 0.9, batch 128 per worker: 1 and 2 workers with 1 BLAS thread each, the
# best single process (2 BLAS threads), dtrain's 2 workers with the default overlap ("auto")
# and with overlap forced on and off, and with the all-reduce over TCP instead of same-host
# shared memory (DTRAIN_COMM_SHM=0). Samples/s
# after warm-up, each configuration REPEATS times, interleaved; prints medians.
# Usage: bench/trainer_vs_torch.sh [steps] [repeats]
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS="${1:-150}"; REPEATS="${2:-3}"
[ -x build/bin/dtrain ] || { echo "build first: scripts/build.sh" >&2; exit 2; }
T="$(mktemp -d)"; trap 'rm -rf "$T"' EXIT
spec() {  # nproc overlap threads
  cat > "$T/s.json" <<JSON
{"nproc_per_node": $1, "env": {"OMP_NUM_THREADS": "$3", "OPENBLAS_NUM_THREADS": "$3"},
 "trainer": {"model": {"layers": [784, 1024, 1024, 10]}, "data": {"train_samples": 10000000, "eval_samples": 0},
  "batch_size": 128, "max_steps": $STEPS, "optimizer": {"lr": 0.005, "momentum": 0.9}, "overlap": $2,
  "log_every_steps": 1000000}}
JSON
  build/bin/dtrain run "$T/s.json" 2>/dev/null | sed -n 's/.* \([0-9]*\) samples\/s.*/\1/p' | tail -1
}
# torch's threads are OpenBLAS's (its GEMMs) with one OpenMP thread: OMP_NUM_THREADS=2 as
# well would run two spinning pools on two cores (0.6k samples/s instead of ~6k); dtrain's
# workers have only OpenBLAS's pool.
torch() { OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=$2 /usr/bin/python3 bench/torch_ddp_mlp.py "$1" "$STEPS" 10 2>/dev/null; }
echo "torch BLAS: $(/usr/bin/python3 -c 'import torch; print(torch.__config__.show())' 2>/dev/null | grep -io 'blas_info=[a-z]*' | head -1), libblas.so.3 -> $(readlink -f /usr/lib/x86_64-linux-gnu/libblas.so.3)"
declare -A R
for i in $(seq "$REPEATS"); do
  R[d1]+="$(spec 1 '"auto"' 1) "; R[d2]+="$(spec 2 '"auto"' 1) "; R[d2on]+="$(spec 2 true 1) "
  R[d2off]+="$(spec 2 false 1) "; R[d1t2]+="$(spec 1 '"auto"' 2) "
  R[d2tcp]+="$(DTRAIN_COMM_SHM=0 spec 2 '"auto"' 1) "
  R[t1]+="$(torch 1 1) "; R[t2]+="$(torch 2 1) "; R[t1t2]+="$(torch 1 2) "
done
python3 - "${R[d1]}" "${R[d2]}" "${R[d2off]}" "${R[d1t2]}" "${R[t1]}" "${R[t2]}" "${R[t1t2]}" "${R[d2tcp]}" "${R[d2on]}" <<'PY'
import statistics, sys
names = ["dtrain 1 worker x 1 thread", "dtrain 2 workers x 1 thread", "dtrain 2 workers x 1 thread (no overlap)",
         "dtrain 1 worker x 2 threads", "torch 1 process x 1 thread", "torch DDP 2 processes x 1 thread",
         "torch 1 process x 2 threads", "dtrain 2 workers x 1 thread (tcp, no shm)",
         "dtrain 2 workers x 1 thread (overlap)"]
med = []
for n, v in zip(names, sys.argv[1:]):
    xs = [float(x) for x in v.split()]
    med.append(statistics.median(xs))
    print(f"{n:<42} median {med[-1]:>8.0f} samples/s   runs: {' '.join(f'{x:.0f}' for x in xs)}")
print(f"dtrain 2 workers / torch DDP 2 processes: {med[1] / med[5]:.2f}x")
print(f"dtrain 2 workers / best torch single process: {med[1] / max(med[4], med[6]):.2f}x")
print(f"overlap on / off: {med[8] / med[2]:.2f}x")
print(f"default (overlap auto) / overlap on: {med[1] / med[8]:.2f}x")
print(f"dtrain 2 workers shm / tcp transport: {med[1] / med[7]:.2f}x")
PY
