#!/usr/bin/env bash
# The GPU check of the trainer and the NCCL backend, for a machine with an NVIDIA GPU (made
# for an H200, sm_90, with a budget of ~10 minutes; this takes about 4-6):
#   1. configure + build Release with CUDA (only dtrain and dtrain_gpu_tests, -j16)
#   2. dtrain_gpu_tests (GPU vs CPU math, optimizer steps, 1-rank training over TCP and
#      NCCL, checkpoints across devices; the 2-rank NCCL test needs 2 GPUs, else it skips;
#      the pipeline on GPU stages, P = 2 x D = 1 and 2, against CPU stages, its nccl
#      variants only with a GPU per rank)
#   3. dtrain train on a small spec: trainer.device auto must pick cuda:0, and with
#      CUDA_VISIBLE_DEVICES= it must fall back to the CPU
#   4. dtrain run configs/quickstart_gpu.json (one worker on the GPU, NCCL communicator),
#      with batches prefetched (the default on a GPU) and again loaded inline
#   5. dtrain bench allreduce --backend nccl --nproc-per-node 1
# Prints one line per step and a summary; full logs in $OUT (default /tmp/dtrain_gpu_check).
# Usage: bash scripts/gpu_check.sh [build-dir]     Exit status: the number of failed steps.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/dtrain_gpu_check}
BUILD=${1:-build/gpu}  # under build/: git ignores it, and a device machine keeps it between calls
JOBS=${JOBS:-16}
mkdir -p "$OUT"
FAILS=0
SUMMARY=()

# step NAME TIMEOUT_S COMMAND...: runs it, logs to $OUT/NAME.log, records PASS/FAIL.
step() {
  local name=$1 limit=$2
  shift 2
  local t0=$SECONDS rc=0
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1 || rc=$?
  local line
  if [ "$rc" -eq 0 ]; then line="PASS $name ($((SECONDS - t0))s)"; else
    line="FAIL $name (rc $rc, $((SECONDS - t0))s; see $OUT/$name.log)"
    FAILS=$((FAILS + 1))
  fi
  SUMMARY+=("$line")
  echo "$line"
  [ "$rc" -eq 0 ] || tail -n 25 "$OUT/$name.log" | sed 's/^/    | /'
  return "$rc"
}

# check NAME FILE PATTERN: a grep that counts as a step.
check() {
  if grep -Eq "$3" "$2"; then SUMMARY+=("PASS $1"); echo "PASS $1"; else
    SUMMARY+=("FAIL $1 (no /$3/ in $2)")
    echo "FAIL $1 (no /$3/ in $2)"
    FAILS=$((FAILS + 1))
  fi
}

echo "== GPU"
(nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader || echo "nvidia-smi failed") 2>&1 | tee "$OUT/gpu.txt"

echo "== build ($BUILD)"
if [ "${SKIP_BUILD:-0}" = 1 ]; then
  # (no build there: a machine without the build dependencies would spend its minutes failing)
  [ -x "$BUILD/bin/dtrain" ] && [ -x "$BUILD/bin/dtrain_gpu_tests" ] || { echo "SKIP_BUILD=1 but no prebuilt binaries in $BUILD/bin"; exit 99; }
  echo "prebuilt (SKIP_BUILD=1): $BUILD/bin"
else
step configure 120 cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DDTRAIN_WITH_CUDA=ON \
  -DCMAKE_CUDA_ARCHITECTURES=90 || { echo "configure failed"; exit 99; }
step build 360 cmake --build "$BUILD" -j"$JOBS" --target dtrain dtrain_gpu_tests || { echo "build failed"; exit 99; }
fi
D="$BUILD/bin/dtrain"
"$D" --version | tee "$OUT/version.txt"

echo "== gpu tests"
step gpu_tests 300 "$BUILD/bin/dtrain_gpu_tests" --gtest_color=no
grep -E "^\[  (SKIPPED|FAILED) \]|^\[  PASSED  \]" "$OUT/gpu_tests.log" | sort -u | sed 's/^/    /'
# With a GPU these must run (not skip); the 2-rank NCCL test may skip on a 1-GPU machine.
for t in NcclComm.AllreduceAcrossDtypesAndSizes GpuTrain.ForwardBackwardMatchCpu GpuTrain.SgdAndAdamWStepsMatchCpu \
  GpuTrain.OneRankTrainingMatchesCpu GpuTrain.CheckpointsMoveBetweenGpuAndCpu GpuPipeline.TwoStagesMatchCpu \
  GpuPipeline.TwoStagesTimesTwoReplicasMatchCpu GpuPipeline.ResumeFromStageCheckpoints; do
  check "ran $t" "$OUT/gpu_tests.log" "^\[       OK \] $t "
done

echo "== dtrain train (small spec)"
cat >"$OUT/small.json" <<'JSON'
{
  "name": "gpu_small",
  "trainer": {
    "model": {"type": "mlp", "layers": [64, 128, 128, 8], "activation": "gelu"},
    "data": {"type": "synthetic", "train_samples": 20000, "eval_samples": 2000, "seed": 3},
    "batch_size": 128, "epochs": 2,
    "optimizer": {"type": "adamw", "lr": 0.003},
    "grad_clip_norm": 1.0, "device": "auto", "log_every_steps": 50,
    "checkpoint": {"dir": "CKPT", "every_steps": 100}
  }
}
JSON
sed -i "s|CKPT|$OUT/ckpt|" "$OUT/small.json"
rm -rf "$OUT/ckpt"
step train_gpu 120 "$D" train "$OUT/small.json"
check "train picked the GPU" "$OUT/train_gpu.log" "math on cuda:0"
check "train finished" "$OUT/train_gpu.log" "^trained: 312 steps"
# The same spec without a GPU: auto falls back to the CPU and resumes the GPU's checkpoint.
step train_cpu_fallback 180 env CUDA_VISIBLE_DEVICES= "$D" train "$OUT/small.json"
check "auto without a GPU is cpu" "$OUT/train_cpu_fallback.log" "math on cpu"
check "cpu resumed the gpu checkpoint" "$OUT/train_cpu_fallback.log" "resuming from .*ckpt-0*312\.bin"
# Nothing left to train: the CPU's final weights are the GPU's, bit for bit, via the file.
sha() { sed -n 's/.*weights sha256 \([0-9a-f]*\).*/\1/p' "$1"; }
if [ -n "$(sha "$OUT/train_gpu.log")" ] && [ "$(sha "$OUT/train_gpu.log")" = "$(sha "$OUT/train_cpu_fallback.log")" ]; then
  SUMMARY+=("PASS checkpoint weights identical on cpu"); echo "PASS checkpoint weights identical on cpu"
else
  SUMMARY+=("FAIL checkpoint weights differ on cpu"); echo "FAIL checkpoint weights differ on cpu"; FAILS=$((FAILS + 1))
fi

echo "== dtrain run configs/quickstart_gpu.json"
step quickstart_gpu 240 "$D" run configs/quickstart_gpu.json --log-dir "$OUT/quickstart_logs" \
  --summary-json "$OUT/quickstart_summary.json"
check "quickstart on the GPU with NCCL" "$OUT/quickstart_gpu.log" "math on cuda:0.*nccl communicator"
check "quickstart learned" "$OUT/quickstart_gpu.log" "eval accuracy (9[0-9]|100)\."
check "quickstart prefetches its batches" "$OUT/quickstart_gpu.log" "batches prefetched"
grep -E "trained:|samples/s" "$OUT/quickstart_gpu.log" | tail -n 2 | sed 's/^/    /'
# The same job loading each batch inline (data.prefetch false): samples/s for docs/PERFORMANCE.md,
# and the same weights.
sed 's/"seed": 1}/"seed": 1, "prefetch": false}/' configs/quickstart_gpu.json >"$OUT/quickstart_inline.json"
step quickstart_gpu_inline 240 "$D" run "$OUT/quickstart_inline.json"
check "inline loading said" "$OUT/quickstart_gpu_inline.log" "batches loaded inline"
grep -E "trained:" "$OUT/quickstart_gpu_inline.log" | tail -n 1 | sed 's/^/    inline: /'
if [ -n "$(sha "$OUT/quickstart_gpu.log")" ] && [ "$(sha "$OUT/quickstart_gpu.log")" = "$(sha "$OUT/quickstart_gpu_inline.log")" ]; then
  SUMMARY+=("PASS prefetched and inline batches train the same weights"); echo "PASS prefetched and inline batches train the same weights"
else
  SUMMARY+=("FAIL prefetched and inline weights differ"); echo "FAIL prefetched and inline weights differ"; FAILS=$((FAILS + 1))
fi

echo "== dtrain bench allreduce --backend nccl"
step bench_nccl 120 "$D" bench allreduce --backend nccl --nproc-per-node 1 -e 64M
tail -n 6 "$OUT/bench_nccl.log" | sed 's/^/    /'

echo
echo "== summary ($FAILS failed)"
printf '%s\n' "${SUMMARY[@]}" | tee "$OUT/summary.txt"
exit "$FAILS"
