#!/usr/bin/env bash
# The GPU check of the trainer and the NCCL backend, for a machine with an NVIDIA GPU (sm_90:
# H100, H200). Made for the device machines lent to this project: 15 minutes in all, start-up
# included, so the whole check is bounded by DEADLINE and every result is written to $OUT as
# it comes (a run cut short still brings back what it did):
#   1. configure + build Release with CUDA (only dtrain and dtrain_gpu_tests, -j16; skipped
#      with SKIP_BUILD=1, see scripts/gpu_bundle.sh)
#   2. dtrain_gpu_tests (GPU vs CPU math, optimizer steps, 1-rank training over TCP and
#      NCCL, checkpoints across devices, a peer that never joins failing NCCL's creation in
#      its timeout; the 2-rank NCCL test needs 2 GPUs, else it skips; the pipeline on GPU
#      stages, P = 2 x D = 1 and 2, against CPU stages, its nccl variants only with a GPU per
#      rank), then the no-device tests with CUDA_VISIBLE_DEVICES= (the messages with a driver)
#   3. dtrain train on a small spec: trainer.device auto must pick cuda:0, and with
#      CUDA_VISIBLE_DEVICES= it must fall back to the CPU
#   4. dtrain run configs/quickstart_gpu.json (one worker on the GPU, NCCL communicator),
#      with batches prefetched (the default on a GPU) and again loaded inline
#   5. dtrain bench allreduce --backend nccl --nproc-per-node 1: every data type x reduce op
#      (real NCCL takes the type and op mapping; one rank cannot check the arithmetic), then
#      the size sweep with NCCL_DEBUG=INFO (the NCCL version and transports, in its log)
# Each step's limit is cut to what is left before DEADLINE (seconds since the epoch; default
# now + 420, 540 with the build); a step with less than 10 s left is not started and counts as failed.
# Logs in $OUT (default /tmp/dtrain_gpu_check), one summary line per step appended to
# $OUT/summary.txt as it ends; checkpoints and scratch in $WORK (default /tmp/dtrain_gpu_work).
# Usage: bash scripts/gpu_check.sh [build-dir]     Exit status: the number of failed steps.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/dtrain_gpu_check}
WORK=${WORK:-/tmp/dtrain_gpu_work}
BUILD=${1:-build/gpu}  # under build/: git ignores it, and a device machine keeps it between calls
JOBS=${JOBS:-16}
# (420 s for the checks, 540 with the build: one device command may run 600; a machine that
# builds slower sets DEADLINE)
DEADLINE=${DEADLINE:-$(($(date +%s) + $([ "${SKIP_BUILD:-0}" = 1 ] && echo 420 || echo 540)))}
mkdir -p "$OUT" "$WORK"
: >"$OUT/summary.txt"
FAILS=0

# record LINE: one result, said and appended to the summary at once.
record() {
  echo "$1"
  echo "$1" >>"$OUT/summary.txt"
  case "$1" in FAIL*) FAILS=$((FAILS + 1)) ;; esac
}

# step NAME LIMIT_S COMMAND...: runs it, logs to $OUT/NAME.log, records PASS/FAIL. The limit
# is cut to the time left before DEADLINE; SIGKILL 5 s after the SIGTERM of a step that does
# not end (dtrain train checkpoints on SIGTERM; a worker stuck in NCCL may not end at all).
step() {
  local name=$1 limit=$2
  shift 2
  local left=$((DEADLINE - $(date +%s) - 5))
  [ "$left" -lt "$limit" ] && limit=$left
  if [ "$limit" -lt 10 ]; then
    record "FAIL $name (not run: ${left}s left before the deadline)"
    return 124
  fi
  local t0=$SECONDS rc=0
  timeout -k 5 "$limit" "$@" >"$OUT/$name.log" 2>&1 || rc=$?
  if [ "$rc" -eq 0 ]; then record "PASS $name ($((SECONDS - t0))s)"; else
    record "FAIL $name (rc $rc$([ "$rc" -eq 124 ] || [ "$rc" -eq 137 ] && echo ": timed out at ${limit}s"), $((SECONDS - t0))s; see $OUT/$name.log)"
    tail -n 25 "$OUT/$name.log" | sed 's/^/    | /'
  fi
  return "$rc"
}

# check NAME FILE PATTERN: a grep that counts as a step.
check() {
  if grep -Eq "$3" "$2" 2>/dev/null; then record "PASS $1"; else record "FAIL $1 (no /$3/ in $2)"; fi
}

# same NAME A B: two non-empty values that must be equal.
same() {
  if [ -n "$2" ] && [ "$2" = "$3" ]; then record "PASS $1"; else record "FAIL $1 ('$2' vs '$3')"; fi
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
# (the tests' NCCL communicators time out in 60 s: one hang costs a minute, not the budget)
step gpu_tests 180 "$BUILD/bin/dtrain_gpu_tests" --gtest_color=no
grep -E "^\[  (SKIPPED|FAILED) \]|^\[  PASSED  \]" "$OUT/gpu_tests.log" | sort -u | sed 's/^/    /'
# With a GPU these must run (not skip); the 2-rank NCCL test may skip on a 1-GPU machine.
for t in NcclComm.AllreduceAcrossDtypesAndSizes NcclComm.MissingPeerFailsInit GpuTrain.ForwardBackwardMatchCpu \
  GpuTrain.SgdAndAdamWStepsMatchCpu GpuTrain.OneRankTrainingMatchesCpu GpuTrain.CheckpointsMoveBetweenGpuAndCpu \
  GpuPipeline.TwoStagesMatchCpu GpuPipeline.TwoStagesTimesTwoReplicasMatchCpu GpuPipeline.ResumeFromStageCheckpoints; do
  check "ran $t" "$OUT/gpu_tests.log" "^\[       OK \] $t "
done
# A host whose GPUs are hidden, with the driver there: the clear messages, not a CUDA abort.
step no_device_tests 30 env CUDA_VISIBLE_DEVICES= "$BUILD/bin/dtrain_gpu_tests" --gtest_color=no \
  --gtest_filter=NcclComm.NoDeviceIsAClearError:GpuTrain.DeviceSelection
check "no-device tests ran" "$OUT/no_device_tests.log" "^\[       OK \] NcclComm.NoDeviceIsAClearError "

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
sed -i "s|CKPT|$WORK/ckpt|" "$OUT/small.json"
rm -rf "$WORK/ckpt"
step train_gpu 90 "$D" train "$OUT/small.json"
check "train picked the GPU" "$OUT/train_gpu.log" "math on cuda:0"
check "train finished" "$OUT/train_gpu.log" "^trained: 312 steps"
# The same spec without a GPU: auto falls back to the CPU and resumes the GPU's checkpoint.
step train_cpu_fallback 90 env CUDA_VISIBLE_DEVICES= "$D" train "$OUT/small.json"
check "auto without a GPU is cpu" "$OUT/train_cpu_fallback.log" "math on cpu"
check "cpu resumed the gpu checkpoint" "$OUT/train_cpu_fallback.log" "resuming from .*ckpt-0*312\.bin"
# Nothing left to train: the CPU's final weights are the GPU's, bit for bit, via the file.
sha() { sed -n 's/.*weights sha256 \([0-9a-f]*\).*/\1/p' "$1" 2>/dev/null; }
same "checkpoint weights identical on cpu" "$(sha "$OUT/train_gpu.log")" "$(sha "$OUT/train_cpu_fallback.log")"

echo "== dtrain run configs/quickstart_gpu.json"
step quickstart_gpu 90 "$D" run configs/quickstart_gpu.json --log-dir "$OUT/quickstart_logs" \
  --summary-json "$OUT/quickstart_summary.json"
check "quickstart on the GPU with NCCL" "$OUT/quickstart_gpu.log" "math on cuda:0.*nccl communicator"
check "quickstart learned" "$OUT/quickstart_gpu.log" "eval accuracy (9[0-9]|100)\."
check "quickstart prefetches its batches" "$OUT/quickstart_gpu.log" "batches prefetched"
grep -E "trained:|samples/s" "$OUT/quickstart_gpu.log" | tail -n 2 | sed 's/^/    /'
# The same job loading each batch inline (data.prefetch false): samples/s for docs/PERFORMANCE.md,
# and the same weights.
sed 's/"seed": 1}/"seed": 1, "prefetch": false}/' configs/quickstart_gpu.json >"$OUT/quickstart_inline.json"
step quickstart_gpu_inline 90 "$D" run "$OUT/quickstart_inline.json"
check "inline loading said" "$OUT/quickstart_gpu_inline.log" "batches loaded inline"
grep -E "trained:" "$OUT/quickstart_gpu_inline.log" | tail -n 1 | sed 's/^/    inline: /'
same "prefetched and inline batches train the same weights" "$(sha "$OUT/quickstart_gpu.log")" \
  "$(sha "$OUT/quickstart_gpu_inline.log")"

echo "== dtrain bench allreduce --backend nccl"
# Every type x op through real NCCL (its ncclDataType/ncclRedOp and cudaPointerGetAttributes);
# a failed pair goes on to the next, the log names it.
types_ops() {
  local bad=0 d o
  for d in float double half bfloat16 int32 int64; do
    for o in sum avg min max; do
      echo "== -d $d -o $o"
      "$D" bench allreduce --backend nccl --nproc-per-node 1 -b 4K -e 1M -f 16 -n 3 -w 1 -d "$d" -o "$o" \
        --timeout 30 || { echo "FAILED: -d $d -o $o"; bad=$((bad + 1)); }
    done
  done
  return "$bad"
}
export D
export -f types_ops
step bench_nccl_types 90 bash -c types_ops
grep "^FAILED" "$OUT/bench_nccl_types.log" | sed 's/^/    /'
step bench_nccl 60 env NCCL_DEBUG=INFO "$D" bench allreduce --backend nccl --nproc-per-node 1 -e 64M
grep -E "NCCL INFO (NCCL version|cudaDriverVersion)" "$OUT/bench_nccl.log" | head -n 2 | sed 's/^/    /'
grep -vE "NCCL (INFO|WARN)" "$OUT/bench_nccl.log" | tail -n 6 | sed 's/^/    /'

echo
echo "== summary ($FAILS failed; $OUT/summary.txt)"
exit "$FAILS"
