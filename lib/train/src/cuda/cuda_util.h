#pragma once
// RAII owners for the CUDA and cuBLAS handles of the GPU trainer, and the checks that turn
// their return codes into dtrain exceptions at the boundary (IoError naming the call and
// the error string: a device failure is an environment problem, not a bug in dtrain).
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <memory>
#include <string>
#include <utility>

namespace dtrain::train::detail {

// Throws IoError("<call>: CUDA error: <string>") unless e == cudaSuccess.
void cudaCheck(cudaError_t e, const char* call);
// Throws IoError("<call>: cuBLAS error: <status>") unless s == CUBLAS_STATUS_SUCCESS.
void cublasCheck(cublasStatus_t s, const char* call);
// After kernel launches: a launch error (bad configuration) as cudaCheck.
void checkLaunch(const char* kernel);
// After cudaMalloc (device) or cudaMallocHost (page-locked host memory) of `bytes`: out of
// memory is an AllocationError (a std::bad_alloc, which the trainer turns into one line naming
// what it was allocating and the field to change, exit 2); any other error as cudaCheck.
void allocCheck(cudaError_t e, const char* call, size_t bytes, bool device);

// Device memory of `count` T. Move-only.
template <typename T>
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t count) { reset(count); }
  ~DeviceBuffer() { release(); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& o) noexcept : p_(std::exchange(o.p_, nullptr)), n_(std::exchange(o.n_, 0)) {}
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    if (this != &o) {
      release();
      p_ = std::exchange(o.p_, nullptr);
      n_ = std::exchange(o.n_, 0);
    }
    return *this;
  }
  // Reallocates (contents lost) to hold `count` elements.
  void reset(size_t count) {
    release();
    if (count > 0)
      allocCheck(cudaMalloc(reinterpret_cast<void**>(&p_), count * sizeof(T)), "cudaMalloc", count * sizeof(T), true);
    n_ = count;
  }
  // Grows (contents lost) when smaller than `count`.
  void ensure(size_t count) {
    if (n_ < count) reset(count);
  }
  T* get() const { return p_; }
  size_t size() const { return n_; }

 private:
  void release() {
    if (p_) cudaFree(p_);
    p_ = nullptr;
    n_ = 0;
  }
  T* p_ = nullptr;
  size_t n_ = 0;
};

// Page-locked host memory (fast, truly asynchronous copies). Move-only.
template <typename T>
class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  ~PinnedBuffer() { release(); }
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  void ensure(size_t count) {
    if (n_ >= count) return;
    release();
    allocCheck(cudaMallocHost(reinterpret_cast<void**>(&p_), count * sizeof(T)), "cudaMallocHost", count * sizeof(T),
               false);
    n_ = count;
  }
  T* get() const { return p_; }

 private:
  void release() {
    if (p_) cudaFreeHost(p_);
    p_ = nullptr;
    n_ = 0;
  }
  T* p_ = nullptr;
  size_t n_ = 0;
};

class Stream {
 public:
  Stream() { cudaCheck(cudaStreamCreateWithFlags(&s_, cudaStreamNonBlocking), "cudaStreamCreateWithFlags"); }
  ~Stream() { cudaStreamDestroy(s_); }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  cudaStream_t get() const { return s_; }

 private:
  cudaStream_t s_ = nullptr;
};

class Event {
 public:
  Event() { cudaCheck(cudaEventCreateWithFlags(&e_, cudaEventDisableTiming), "cudaEventCreateWithFlags"); }
  ~Event() {
    if (e_) cudaEventDestroy(e_);
  }
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  Event(Event&& o) noexcept : e_(std::exchange(o.e_, nullptr)) {}
  Event& operator=(Event&&) = delete;
  cudaEvent_t get() const { return e_; }

 private:
  cudaEvent_t e_ = nullptr;
};

class CublasHandle {
 public:
  CublasHandle() { cublasCheck(cublasCreate(&h_), "cublasCreate"); }
  ~CublasHandle() { cublasDestroy(h_); }
  CublasHandle(const CublasHandle&) = delete;
  CublasHandle& operator=(const CublasHandle&) = delete;
  cublasHandle_t get() const { return h_; }

 private:
  cublasHandle_t h_ = nullptr;
};

// What both GPU backends (the trainer's and the pipeline stage's) set up first: `device`
// made current, so that everything created after it (streams, events, memory) belongs to it;
// its name for describe(); a non-blocking stream; and a cuBLAS handle on that stream doing
// FP32 GEMMs in full precision (TF32 tensor cores would drift from the CPU results).
// Declare it before any member that allocates on the device. Not copyable.
class DeviceContext {
 public:
  explicit DeviceContext(int device) : device_(device) {
    cudaCheck(cudaSetDevice(device), "cudaSetDevice");
    cudaDeviceProp prop{};
    cudaCheck(cudaGetDeviceProperties(&prop, device), "cudaGetDeviceProperties");
    name_ = std::string("cuda:") + std::to_string(device) + " (" + prop.name + ")";
    stream_ = std::make_unique<Stream>();
    cublas_ = std::make_unique<CublasHandle>();
    cublasCheck(cublasSetStream(cublas_->get(), stream_->get()), "cublasSetStream");
    cublasCheck(cublasSetMathMode(cublas_->get(), CUBLAS_DEFAULT_MATH), "cublasSetMathMode");
  }
  DeviceContext(const DeviceContext&) = delete;
  DeviceContext& operator=(const DeviceContext&) = delete;

  int device() const { return device_; }
  const std::string& name() const { return name_; }
  // Makes the device current again: the calling thread's current device may have been
  // changed since (NCCL, other backends).
  void use() const { cudaCheck(cudaSetDevice(device_), "cudaSetDevice"); }
  // For the owner's destructor, before its device buffers are freed: waits for the work in
  // flight that may still read them (an exception unwound mid-call). Never throws.
  void drain() const noexcept {
    cudaSetDevice(device_);
    cudaStreamSynchronize(stream());
  }
  cudaStream_t stream() const { return stream_->get(); }
  cublasHandle_t cublas() const { return cublas_->get(); }

 private:
  int device_;
  std::string name_;
  std::unique_ptr<Stream> stream_;
  std::unique_ptr<CublasHandle> cublas_;
};

}  // namespace dtrain::train::detail
