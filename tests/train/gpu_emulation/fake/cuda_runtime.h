#pragma once
// Host emulation of the CUDA runtime calls the GPU trainer makes (tests/train/gpu_emulation
// only; never part of a build). "Device" memory is exact-size host malloc, so AddressSanitizer
// catches any out-of-bounds access by the backend or a kernel; copies and kernels complete
// at once, so streams and events are bookkeeping. EMU_GPUS (default 1) devices are visible.
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <cstdio>
#include <cmath>
enum cudaError_t { cudaSuccess = 0, cudaErrorMemoryAllocation = 2, cudaErrorNotReady = 600, cudaErrorNoDevice = 100, cudaErrorInvalidDevice = 101 };
enum cudaMemcpyKind { cudaMemcpyHostToDevice = 1, cudaMemcpyDeviceToHost = 2, cudaMemcpyDeviceToDevice = 3 };
struct CUstream_st { int dev; };
struct CUevent_st { int recorded; };
typedef CUstream_st* cudaStream_t;
typedef CUevent_st* cudaEvent_t;
#define cudaStreamNonBlocking 1
#define cudaEventDisableTiming 2
struct cudaDeviceProp { char name[256]; };
int emuDeviceCount();
inline int& emuCurrentDevice() { static thread_local int d = 0; return d; }
inline const char* cudaGetErrorString(cudaError_t e) { return e == cudaSuccess ? "no error" : e == cudaErrorNoDevice ? "no CUDA-capable device is detected" : e == cudaErrorMemoryAllocation ? "out of memory" : "invalid device ordinal"; }
inline const char* cudaGetErrorName(cudaError_t e) { return e == cudaSuccess ? "cudaSuccess" : e == cudaErrorNoDevice ? "cudaErrorNoDevice" : e == cudaErrorMemoryAllocation ? "cudaErrorMemoryAllocation" : "cudaErrorInvalidDevice"; }
inline cudaError_t cudaGetLastError() { return cudaSuccess; }
inline cudaError_t cudaGetDeviceCount(int* n) { *n = emuDeviceCount(); return *n ? cudaSuccess : cudaErrorNoDevice; }
inline cudaError_t cudaGetDevice(int* d) { *d = emuCurrentDevice(); return cudaSuccess; }
inline cudaError_t cudaSetDevice(int d) { if (d < 0 || d >= emuDeviceCount()) return cudaErrorInvalidDevice; emuCurrentDevice() = d; return cudaSuccess; }
inline cudaError_t cudaGetDeviceProperties(cudaDeviceProp* p, int d) { std::snprintf(p->name, sizeof p->name, "Emulated GPU %d", d); return cudaSuccess; }
void* emuAlloc(size_t bytes);
void emuFree(void* p);
// An emulated device holds EMU_DEVICE_BYTES (default 16 GiB): a larger allocation is out of
// memory, as on a real device (one allocation at a time is compared, not their sum).
size_t emuDeviceBytes();
inline cudaError_t cudaMalloc(void** p, size_t bytes) {
  if (bytes > emuDeviceBytes()) return cudaErrorMemoryAllocation;
  *p = emuAlloc(bytes);
  return cudaSuccess;
}
inline cudaError_t cudaFree(void* p) { emuFree(p); return cudaSuccess; }
inline cudaError_t cudaMallocHost(void** p, size_t bytes) { *p = emuAlloc(bytes); return cudaSuccess; }
inline cudaError_t cudaFreeHost(void* p) { emuFree(p); return cudaSuccess; }
inline cudaError_t cudaMemsetAsync(void* p, int v, size_t bytes, cudaStream_t) { std::memset(p, v, bytes); return cudaSuccess; }
inline cudaError_t cudaMemcpyAsync(void* d, const void* s, size_t bytes, cudaMemcpyKind, cudaStream_t) { std::memcpy(d, s, bytes); return cudaSuccess; }
inline cudaError_t cudaStreamCreateWithFlags(cudaStream_t* s, unsigned) { *s = new CUstream_st{emuCurrentDevice()}; return cudaSuccess; }
inline cudaError_t cudaStreamDestroy(cudaStream_t s) { delete s; return cudaSuccess; }
inline cudaError_t cudaStreamSynchronize(cudaStream_t) { return cudaSuccess; }
inline cudaError_t cudaEventCreateWithFlags(cudaEvent_t* e, unsigned) { *e = new CUevent_st{0}; return cudaSuccess; }
inline cudaError_t cudaEventDestroy(cudaEvent_t e) { delete e; return cudaSuccess; }
inline cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t) { e->recorded = 1; return cudaSuccess; }
inline cudaError_t cudaEventSynchronize(cudaEvent_t) { return cudaSuccess; }
