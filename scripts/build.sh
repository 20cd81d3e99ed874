#!/usr/bin/env bash
# Release build into build/; the binary lands at build/bin/dtrain.
# Extra arguments go to cmake's configure step, e.g. -DDTRAIN_WITH_CUDA=OFF.
set -euo pipefail
cd "$(dirname "$0")/.."
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DDTRAIN_WITH_CUDA="${DTRAIN_WITH_CUDA:-AUTO}" "$@" >/dev/null
cmake --build build -j"$(nproc)"
echo "build: build/bin/dtrain"
