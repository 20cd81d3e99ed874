#!/usr/bin/env bash
# What checkpoints cost a training run: the issue's MLP 784-1024-1024-10 (1.9M parameters, a
# 15 MB checkpoint with momentum), 2 workers x 1 BLAS thread, batch 128 per worker, a
# checkpoint every EVERY steps, side by side in one run, interleaved, REPEATS times:
#   dtrain without checkpoints, with inline checkpoints (the default), with
#   trainer.checkpoint.async; PyTorch DDP (gloo) without and with rank 0's torch.save
#   (temporary file, fsync, rename: dtrain's durability) every EVERY steps.
# Samples/s after the first steps (dtrain: its own figure, over the run after step 1; torch:
# after 10 warm-up steps). Prints medians and the share of throughput each loses to checkpoints.
# Usage: bench/checkpoint_training.sh [steps] [every] [repeats] [dir]  (dir: where checkpoints
# go; default a temporary directory under /tmp)
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS="${1:-200}"; EVERY="${2:-10}"; REPEATS="${3:-3}"
[ -x build/bin/dtrain ] || { echo "build first: scripts/build.sh" >&2; exit 2; }
T="$(mktemp -d)"; trap 'rm -rf "$T"' EXIT
D="${4:-$T}"
spec() {  # checkpoint-json
  cat > "$T/s.json" <<JSON
{"nproc_per_node": 2, "env": {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"},
 "trainer": {"model": {"layers": [784, 1024, 1024, 10]}, "data": {"train_samples": 10000000, "eval_samples": 0},
  "batch_size": 128, "max_steps": $STEPS, "optimizer": {"lr": 0.005, "momentum": 0.9},
  "log_every_steps": 1000000 $1}}
JSON
  rm -rf "$D/ck"
  build/bin/dtrain run "$T/s.json" 2>/dev/null | sed -n 's/.* \([0-9]*\) samples\/s.*/\1/p' | tail -1
}
torch() {  # [every dir]
  rm -rf "$D/tck"; mkdir -p "$D/tck"
  OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 /usr/bin/python3 bench/torch_ddp_mlp.py 2 "$STEPS" 10 "$@" 2>/dev/null
}
declare -A R
for i in $(seq "$REPEATS"); do
  R[none]+="$(spec '') "
  R[sync]+="$(spec ", \"checkpoint\": {\"dir\": \"$D/ck\", \"every_steps\": $EVERY}") "
  R[async]+="$(spec ", \"checkpoint\": {\"dir\": \"$D/ck\", \"every_steps\": $EVERY, \"async\": true}") "
  R[tnone]+="$(torch) "
  R[tsave]+="$(torch "$EVERY" "$D/tck") "
done
rm -rf "$D/ck" "$D/tck"
python3 - "$EVERY" "${R[none]}" "${R[sync]}" "${R[async]}" "${R[tnone]}" "${R[tsave]}" <<'PY'
import statistics, sys
every = sys.argv[1]
names = ["dtrain, no checkpoints", f"dtrain, checkpoint every {every} steps", f"dtrain, every {every} steps, async",
         "torch DDP, no checkpoints", f"torch DDP, torch.save every {every} steps"]
med = []
for n, v in zip(names, sys.argv[2:]):
    xs = [float(x) for x in v.split()]
    med.append(statistics.median(xs))
    print(f"{n:<42} median {med[-1]:>8.0f} samples/s   runs: {' '.join(f'{x:.0f}' for x in xs)}")
print(f"throughput kept with checkpoints: dtrain inline {med[1] / med[0]:.3f}, dtrain async {med[2] / med[0]:.3f}, "
      f"torch {med[4] / med[3]:.3f}")
print(f"dtrain async / torch DDP with torch.save: {med[2] / med[4]:.2f}x; dtrain inline / torch: {med[1] / med[4]:.2f}x")
PY
