#pragma once
// The trainer's math behind one interface, so that the training loop (trainer.cc) is shared
// by the CPU path (Mlp + OpenBLAS) and the GPU path (cuBLAS + CUDA kernels, src/cuda).
//
// Buffers: params(), grads() and state() are flat, layer by layer as in Mlp (W0, b0, W1, ...),
// in the backend's memory: host memory on the CPU, device memory on the GPU (onDevice()).
// state() is the SGD momentum buffer, or AdamW's first and second moments back to back.
//
// Ordering: on the GPU every call only enqueues work on the backend's compute stream, except
// the ones documented as waiting. Thread-safety: none; one backend per worker thread.
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include <vector>

#include "dtrain/train/mlp.h"

namespace dtrain::train::detail {

struct SgdParams {
  float lr = 0, weight_decay = 0, momentum = 0;
  bool nesterov = false;
};

// c1 = 1 - beta1^t, c2 = sqrt(1 - beta2^t): computed by the caller in double, as on the CPU.
struct AdamWParams {
  float lr = 0, weight_decay = 0, beta1 = 0, beta2 = 0, eps = 0, c1 = 1, c2 = 1;
};

// Memory a communicator may need host data copied into: the device's for a GPU backend or
// stage (NCCL takes device pointers), host memory for the CPU ones. Shared by MathBackend and
// the pipeline's StageMath so that one HostCollectives (host_collectives.h) serves both.
class DeviceStaging {
 public:
  virtual ~DeviceStaging() = default;
  // Host <-> backend copies of `bytes` at arbitrary backend addresses (staging for
  // collectives); they wait until the copy is done.
  virtual void copyToBackend(void* dst, const void* host, size_t bytes) = 0;
  virtual void copyToHost(void* host, const void* src, size_t bytes) = 0;
  // A backend buffer of at least `bytes` for staging small host collectives through
  // (communicators that need device pointers). Valid until the next call.
  virtual void* scratch(size_t bytes) = 0;
};

class MathBackend : public DeviceStaging {
 public:

  // "cpu" or "cuda:N (device name)".
  virtual std::string describe() const = 0;
  // True when params()/grads()/state() are device memory.
  virtual bool onDevice() const = 0;
  virtual const MlpConfig& config() const = 0;
  virtual size_t numParams() const = 0;
  size_t stateSize() const { return numParams() * (adam() ? 2 : 1); }
  virtual bool adam() const = 0;
  // Offsets of the layers in the flat buffers, plus the total at the end.
  virtual std::vector<size_t> layerOffsets() const = 0;

  virtual float* params() = 0;
  virtual float* grads() = 0;
  virtual float* state() = 0;

  // Host <-> backend copies of whole buffers; they wait until the copy is done.
  virtual void loadParams(const float* host) = 0;
  virtual void storeParams(float* host) = 0;
  virtual void loadState(const float* host) = 0;
  virtual void storeState(float* host) = 0;
  virtual void storeGrads(float* host) = 0;
  // copyToBackend, copyToHost, scratch: DeviceStaging.

  // Forward on x [n x in] (host memory; may be reused as soon as forward returns) against
  // targets (class indices as floats, or [n x out] for MSE). The mean loss and the number of
  // correct argmax predictions are available from result().
  virtual void forward(const float* x, int n, const float* targets) = 0;
  // Waits for the last forward; returns its mean loss and sets *correct.
  virtual double result(int* correct) = 0;
  // Backward of the last forward into grads(). onLayerDone(l) runs after layer l's W and b
  // gradients were computed (CPU) or enqueued (GPU: then waitLayer(l) before reading them
  // from another stream or the host), last layer first.
  virtual void backward(const std::function<void(int layer)>& onLayerDone) = 0;
  // True when backward only enqueues (the GPU): callers must waitLayer() before communicating.
  virtual bool asyncCompute() const = 0;
  // Blocks until layer l's gradients of the last backward are in grads().
  virtual void waitLayer(int layer) = 0;

  // Scales grads() so that their global L2 norm is at most maxNorm (scale
  // maxNorm / (norm + 1e-6)), as torch.nn.utils.clip_grad_norm_.
  virtual void clipGradNorm(double maxNorm) = 0;
  // PyTorch semantics: SGD (momentum, Nesterov, coupled weight decay) and AdamW (decoupled).
  virtual void sgdStep(const SgdParams& p) = 0;
  virtual void adamwStep(const AdamWParams& p) = 0;
  // Blocks until everything enqueued has finished.
  virtual void synchronize() = 0;
};

// The CPU optimizer loops on flat host buffers of n floats (state: SGD momentum, or AdamW's
// m then v, 2n floats), shared by the CPU backend and the pipeline trainer's stages.
void cpuSgdStep(float* params, const float* grads, float* state, size_t n, const SgdParams& p);
void cpuAdamwStep(float* params, const float* grads, float* state, size_t n, const AdamWParams& p);

// Mlp + OpenBLAS; initialised deterministically from seed (Mlp::init).
std::unique_ptr<MathBackend> makeCpuBackend(const MlpConfig& cfg, uint64_t seed, bool adam);

// cuBLAS + CUDA kernels on device `device`, with the same initial weights as the CPU
// backend for the same seed (initialised on the host, then copied). Only in CUDA builds;
// elsewhere it throws SpecError.
std::unique_ptr<MathBackend> makeCudaBackend(const MlpConfig& cfg, uint64_t seed, bool adam, int device);

}  // namespace dtrain::train::detail
