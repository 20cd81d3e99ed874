#!/usr/bin/env bash
# GPU training throughput on one GPU, the built-in trainer (CUDA build, cuBLAS + its kernels,
# synthetic batches computed on the CPU and prefetched, by trainer.data.loader_threads "auto"
# and by 1 thread) vs PyTorch (bench/torch_gpu_mlp.py: eager mode, batches already on the
# GPU), same MLP 784-1024-1024-10, ReLU, SGD momentum 0.9, plain fp32, at batch 128 and 1024.
# Samples/s after warm-up, each configuration REPEATS times, interleaved; prints medians.
# Usage: bench/trainer_gpu.sh [steps] [repeats] [dtrain binary, default build/bin/dtrain]
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS="${1:-2000}"; REPEATS="${2:-3}"; D="${3:-build/bin/dtrain}"
PY="${PYTHON:-python3}"
[ -x "$D" ] || { echo "no dtrain at $D: build a CUDA build first (scripts/build.sh with CUDA)" >&2; exit 2; }
T="$(mktemp -d)"; trap 'rm -rf "$T"' EXIT
dtrain() {  # batch loader_threads
  cat > "$T/s.json" <<JSON
{"nproc_per_node": 1,
 "trainer": {"model": {"layers": [784, 1024, 1024, 10]},
  "data": {"train_samples": 100000000, "eval_samples": 0, "loader_threads": $2},
  "batch_size": $1, "max_steps": $STEPS, "optimizer": {"lr": 0.005, "momentum": 0.9}, "device": "cuda",
  "log_every_steps": 1000000}}
JSON
  local r
  r=$("$D" run "$T/s.json" 2>/dev/null | sed -n 's/.* \([0-9]*\) samples\/s.*/\1/p' | tail -1 || true)
  echo "  dtrain batch $1 loader_threads $2: ${r:-failed}" >&2  # (as it goes: a run cut short keeps what it measured)
  echo "$r"
}
torch() {
  local r
  r=$("$PY" bench/torch_gpu_mlp.py "$1" "$STEPS" 50 2>/dev/null || true)
  echo "  torch batch $1: ${r:-failed}" >&2
  echo "$r"
}
echo "torch $("$PY" -c 'import torch; print(torch.__version__, torch.cuda.get_device_name(0))' 2>&1 | tail -1)"
declare -A R
for i in $(seq "$REPEATS"); do
  R[d128]+="$(dtrain 128 '"auto"') "; R[t128]+="$(torch 128) "
  R[d1024]+="$(dtrain 1024 '"auto"') "; R[t1024]+="$(torch 1024) "
  R[d1024one]+="$(dtrain 1024 1) "
done
python3 - "${R[d128]}" "${R[t128]}" "${R[d1024]}" "${R[t1024]}" "${R[d1024one]}" <<'PY'
import statistics, sys
names = ["dtrain batch 128", "torch batch 128", "dtrain batch 1024", "torch batch 1024",
         "dtrain batch 1024, 1 loader thread"]
med = []
for n, v in zip(names, sys.argv[1:]):
    xs = [float(x) for x in v.split()]
    med.append(statistics.median(xs) if xs else float("nan"))
    print(f"{n:<36} median {med[-1]:>10.0f} samples/s   runs: {' '.join(f'{x:.0f}' for x in xs)}")
for b, (d, t) in (("128", med[0:2]), ("1024", med[2:4])):
    print(f"batch {b}: dtrain / torch {d / t:.2f}x")
print(f"batch 1024: loader threads auto / 1: {med[2] / med[4]:.2f}x")
PY
