#pragma once
// The emulation of CUDA's execution model for tests/train/gpu_emulation: kernels run block by
// block on a pool of kThreads host threads (one launch at a time), __syncthreads() is a barrier.
#include <functional>
#include "cuda_runtime.h"
#define __global__
#define __device__
#define __shared__ static
struct EmuDim { unsigned x = 0; };
extern EmuDim blockIdx, blockDim, gridDim;
extern thread_local EmuDim threadIdx;
void __syncthreads();
void emuLaunch(unsigned grid, unsigned block, const std::function<void()>& body);
