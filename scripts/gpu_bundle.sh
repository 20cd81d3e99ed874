#!/usr/bin/env bash
# Runs scripts/gpu_check.sh on a GPU machine that has CUDA but none of dtrain's build
# dependencies (no CLI11, Boost, fmt, OpenBLAS, GoogleTest; nothing can be installed), such as
# the device machines lent to this project: build here, carry the binaries and the Debian
# libraries they load, run there.
#   here:  bash scripts/gpu_bundle.sh pack [build-dir]   -> .devcarry/bundle.tar.xz (git-ignored
#          through .git/info/exclude; carry .devcarry)
#   there: bash scripts/gpu_bundle.sh run                -> unpacks, checks the driver and finds
#          the machine's cuBLAS and NCCL, runs gpu_check.sh on the prebuilt binaries, then
#          bench/trainer_gpu.sh with the time left; all within TOTAL_LIMIT seconds (default
#          450: a device command may run 600, and the machine's start counts against the
#          same 15 minutes); the logs are written into $OUT/gpu_check as they come
set -u
cd "$(dirname "$0")/.."
case "${1:-}" in
pack)
  set -e -o pipefail
  B=${2:-build/gpu}
  for f in dtrain dtrain_gpu_tests libdtrain_comm_nccl.so libdtrain_train_cuda.so; do
    [ -f "$B/bin/$f" ] || { echo "no $B/bin/$f: make a CUDA build there first (cmake -S . -B $B -DDTRAIN_WITH_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90, then build dtrain and dtrain_gpu_tests)" >&2; exit 1; }
  done
  rm -rf .devcarry && mkdir -p .devcarry/stage/build/bin .devcarry/stage/lib
  cp -a "$B/bin/dtrain" "$B/bin/dtrain_gpu_tests" "$B"/bin/*.so .devcarry/stage/build/bin/
  # The shared libraries our binaries and plugins load that are not libc/libstdc++ or CUDA's
  # big ones (cuBLAS, NCCL: the GPU machine has its own of the same major version).
  for l in libopenblas.so.0 libgfortran.so.5 libquadmath.so.0 libfmt.so.9 libcrypto.so.3 libcudart.so.13; do
    p=$( (ldconfig -p | sed -n "s/.*[[:space:]]$l .*=> //p"; ls /usr/local/cuda/lib64/$l 2>/dev/null || true) | sed -n 1p)
    [ -n "$p" ] || { echo "not found: $l" >&2; exit 1; }
    cp -L "$p" .devcarry/stage/lib/$l
  done
  tar -C .devcarry/stage -cJf .devcarry/bundle.tar.xz .  # (alone: set -e ignores a failure before &&)
  rm -rf .devcarry/stage
  X=$(git rev-parse --git-path info/exclude)  # (a worktree's .git is a file)
  mkdir -p "$(dirname "$X")"
  grep -qx '/.devcarry/' "$X" 2>/dev/null || echo /.devcarry/ >>"$X"
  ls -la .devcarry/bundle.tar.xz
  ;;
run)
  if [ -e build/gpu ] && [ ! -L build/gpu ]; then
    echo "build/gpu is a real build here: 'run' is for the GPU machine the bundle was carried to" >&2; exit 2
  fi
  # One deadline for everything (the device tool's command limit, less a margin): each step
  # of gpu_check.sh and the benchmark after it get what is left, and every log is written
  # straight into $OUT, so a run cut short still brings back what it did.
  START=$(date +%s)
  export DEADLINE=$((START + ${TOTAL_LIMIT:-450}))
  L=${OUT:-/tmp/dtrain_gpu_check}/gpu_check
  mkdir -p "$L"
  exec > >(tee "$L/run.log") 2>&1
  TEE=$!
  # (every exit waits for tee: its last lines would be lost with the script's end)
  trap 'exec >&- 2>&-; wait "$TEE"' EXIT
  R=/tmp/dtrain_bundle
  rm -rf "$R" && mkdir -p "$R" && tar -C "$R" -xJf .devcarry/bundle.tar.xz || { echo "no bundle: .devcarry not carried?"; exit 98; }
  # Preflight, seconds: what would make every GPU test skip or every step fail, said at once
  # rather than found at the end of the budget.
  nvidia-smi >"$L/nvidia-smi.txt" 2>&1 || { echo "PREFLIGHT: nvidia-smi failed: $(head -n 2 "$L/nvidia-smi.txt")"; exit 97; }
  cuda=$(sed -n 's/.*CUDA Version: *\([0-9]*\)\.\([0-9]*\).*/\1 \2/p' "$L/nvidia-smi.txt" | head -n 1)
  echo "driver supports CUDA ${cuda:-?}"
  # (the bundle's libcudart.so.13 needs a driver for CUDA 13; an older one reports no device,
  # and every GPU test would skip)
  [ -n "$cuda" ] && [ "${cuda% *}" -lt 13 ] && { echo "PREFLIGHT: the driver supports CUDA $cuda; the bundle's runtime is CUDA 13"; exit 97; }
  LIBS="$R/lib"
  for l in libcublas.so.13 libcublasLt.so.13 libnccl.so.2; do
    p=$(find /usr/local/cuda/ /usr/local/cuda*/ /usr/lib /opt /usr/local/lib -name "$l" 2>/dev/null | head -1)
    echo "$l: ${p:-NOT FOUND}"
    [ -n "$p" ] || { echo "PREFLIGHT: $l not found on this machine"; exit 97; }
    LIBS="$LIBS:$(dirname "$p")"
  done
  export LD_LIBRARY_PATH="$LIBS${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
  # The checkout's build/gpu is what gpu_check.sh looks in: point it at the unpacked binaries.
  mkdir -p build && rm -f build/gpu && ln -s "$R/build" build/gpu
  missing=$(ldd build/gpu/bin/dtrain build/gpu/bin/*.so build/gpu/bin/dtrain_gpu_tests | grep "not found" | sort -u)
  [ -z "$missing" ] || { echo "PREFLIGHT: libraries not found:"; echo "$missing"; exit 97; }
  echo "preflight done in $(($(date +%s) - START))s; deadline in $((DEADLINE - $(date +%s)))s"
  OUT="$L" WORK=/tmp/dtrain_gpu_work SKIP_BUILD=1 bash scripts/gpu_check.sh build/gpu
  rc=$?
  echo "gpu_check exit $rc"
  left=$((DEADLINE - $(date +%s)))
  if [ "$left" -ge 40 ]; then
    echo "== bench/trainer_gpu.sh (${left}s left)"
    timeout -k 5 "$left" bash bench/trainer_gpu.sh "${BENCH_STEPS:-300}" 3 build/gpu/bin/dtrain >"$L/trainer_gpu_bench.log" 2>&1
    echo "trainer_gpu.sh exit $?"
    tail -n 12 "$L/trainer_gpu_bench.log"
  else
    echo "== bench/trainer_gpu.sh not run: ${left}s left"
  fi
  exit "$rc"
  ;;
*) echo "usage: $0 pack [build-dir] | run" >&2; exit 2 ;;
esac
