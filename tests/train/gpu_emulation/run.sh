#!/usr/bin/env bash
# The GPU trainer on a machine without a GPU: lib/train/src/cuda/cuda_backend.cu,
# cuda_stage.cu (the pipeline's GPU stage) and the kernel bodies of kernels.cu, compiled as host C++ against an emulated CUDA runtime and
# cuBLAS (fake/), with AddressSanitizer and UBSan, running tests/train/gpu_train_test.cc.
# The "nccl" communicator is TCP underneath (emulated device memory is host memory).
#
# What it checks: the backend's host logic (buffer sizes, offsets, the row-major cuBLAS
# mapping, staging, checkpoints, the trainer's device paths) and the kernels' arithmetic,
# against the CPU path. What it cannot: real asynchrony (streams, events, NCCL's stream),
# cuBLAS/NCCL themselves, device limits. Those need scripts/gpu_check.sh on a GPU.
#
# Usage: bash tests/train/gpu_emulation/run.sh [cpu-build-dir] [gtest args...]
#   cpu-build-dir: a -DDTRAIN_WITH_CUDA=OFF build with the libraries built (default build/cpu):
#   cmake -S . -B build/cpu -DDTRAIN_WITH_CUDA=OFF && cmake --build build/cpu -j2 --target dtrain_train
set -eu
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../../.." && pwd)
BUILD=$(cd "${1:-$ROOT/build/cpu}" && pwd)
shift || true
OUT="$BUILD/gpu_emulation"
mkdir -p "$OUT/obj"
for lib in comm store spec common; do
  [ -f "$BUILD/lib/$lib/libdtrain_$lib.a" ] || { echo "no $BUILD/lib/$lib/libdtrain_$lib.a: build $BUILD first (CPU build)"; exit 2; }
done
# (a CUDA build's libdtrain_comm has the real NCCL backend, which would clash with the fake)
# (the NCCL backend is a plugin, but the archive then defines createNcclCommunicator, its loader)
nm -C "$BUILD/lib/comm/libdtrain_comm.a" 2>/dev/null | grep -q " T dtrain::comm::createNcclCommunicator" &&
  { echo "$BUILD is a CUDA build; use a -DDTRAIN_WITH_CUDA=OFF one"; exit 2; }
cp "$ROOT/lib/train/src/cuda/cuda_util.h" "$ROOT/lib/train/src/cuda/kernels.h" "$OUT/"
python3 "$HERE/gen_kernels.py" "$ROOT/lib/train/src/cuda/kernels.cu" "$OUT/kernels.cc"
INC=(-I"$OUT" -I"$HERE" -I"$HERE/fake" -I"$ROOT/lib/common/include" -I"$ROOT/lib/spec/include" -I"$ROOT/lib/store/include"
     -I"$ROOT/lib/comm/include" -I"$ROOT/lib/train/include" -I/usr/include/x86_64-linux-gnu/openblas-pthread)
FLAGS=(-std=c++20 -O1 -g -fsanitize=address,undefined -fno-omit-frame-pointer -DDTRAIN_HAVE_CUDA=1 -DDTRAIN_BLAS_LIBRARY=\"libopenblas.so\")
SRCS=("$ROOT"/lib/train/src/{mlp,data,batch_loader,progress,trainer,lr_schedule,pipeline,backend,device,checkpoint,checkpoint_writer,metrics,blas,memory_estimate,out_of_memory}.cc "$OUT/kernels.cc" "$HERE/emu_runtime.cc"
      "$ROOT/tests/train/gpu_train_test.cc")
pids=()
for f in "${SRCS[@]}"; do
  o="$OUT/obj/$(basename "$f").o"
  # Rebuilt when the source or any header it may include is newer (a header that changed a
  # class layout, e.g. a new virtual in communicator.h, must not leave stale objects).
  if [ ! -f "$o" ] || [ "$f" -nt "$o" ] ||
     [ -n "$(find "$ROOT"/lib/*/include "$ROOT/lib/train/src" "$HERE" -name '*.h' -newer "$o" -print -quit)" ]; then
    g++ "${FLAGS[@]}" "${INC[@]}" -c "$f" -o "$o" &
    pids+=($!)
    [ "${#pids[@]}" -ge 2 ] && { wait "${pids[0]}"; pids=("${pids[@]:1}"); }
  fi
done
for cu in cuda_backend cuda_stage; do
  g++ "${FLAGS[@]}" "${INC[@]}" -x c++ -c "$ROOT/lib/train/src/cuda/$cu.cu" -o "$OUT/obj/$cu.o"
done
for p in "${pids[@]}"; do wait "$p"; done
g++ "${FLAGS[@]}" "$OUT"/obj/*.o "$BUILD"/lib/{comm/libdtrain_comm,store/libdtrain_store,spec/libdtrain_spec,common/libdtrain_common}.a \
  -lfmt -ldl -lcrypto -lgtest -lgtest_main -pthread -o "$OUT/emu_gpu_tests"
# 4 devices: the pipeline's 2 x 2 test over "nccl" wants a device per rank.
EMU_GPUS=${EMU_GPUS:-4} "$OUT/emu_gpu_tests" --gtest_filter="${GTEST_FILTER:-GpuTrain.*:GpuPipeline.*}" "$@"
