#pragma once
// The math of one pipeline stage (pipeline.cc) behind one interface, so that the schedules,
// transfers, timing, trace and checkpoints are shared by the CPU stage (OpenBLAS, in
// pipeline.cc) and the GPU stage (cuBLAS + the kernels of src/cuda, in cuda_stage.cu).
//
// A stage holds layers [lo, hi) of the MLP with an activation stash per micro-batch (slot;
// several are in flight) and gradients accumulated over the micro-batches of a step.
//
// Buffers: params(), grads(), state() and every pointer the slot calls return live in the
// stage's memory (onDevice(): device memory), flat and layer by layer as in Mlp (W, b of
// layer lo, then lo + 1, ...). state() is the SGD momentum, or AdamW's m then v.
//
// Ordering: every call has completed its work when it returns (the GPU stage synchronises
// its stream), so a returned buffer may go to any communicator at once and the pipeline's
// compute timing is real time. The one exception is documented at backward().
// Thread-safety: none; one stage per worker.
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "dtrain/train/backend.h"
#include "dtrain/train/mlp.h"

namespace dtrain::train::detail {

class StageMath : public DeviceStaging {
 public:
  // "cpu" or "cuda:N (device name)".
  virtual std::string describe() const = 0;
  virtual bool onDevice() const = 0;
  // True when the stage ends with the MLP's output layer (it computes the loss).
  bool last() const { return hi_ == static_cast<int>(cfg_.layers.size()) - 1; }
  int inWidth() const { return in(lo_); }
  int outWidth() const { return out(hi_ - 1); }
  int numLayers() const { return hi_ - lo_; }
  size_t numParams() const { return offsets_.back(); }
  size_t stateSize() const { return numParams() * (adam_ ? 2 : 1); }
  // Local layer k's [offset, offset + count) in params()/grads().
  std::pair<size_t, size_t> layerSpan(int k) const {
    return {offsets_[static_cast<size_t>(k)], offsets_[static_cast<size_t>(k) + 1] - offsets_[static_cast<size_t>(k)]};
  }

  virtual float* params() = 0;
  virtual float* grads() = 0;
  virtual float* state() = 0;

  // Host <-> stage copies of whole buffers (numParams() or stateSize() floats).
  virtual void loadParams(const float* host) = 0;
  virtual void storeParams(float* host) = 0;
  virtual void loadState(const float* host) = 0;
  virtual void storeState(float* host) = 0;
  // copyToBackend, copyToHost (also inputs), scratch: DeviceStaging, at stage addresses.

  // The buffer for slot's input of n rows (inWidth() floats each), to receive or copy into.
  virtual float* input(int slot, int n) = 0;
  // Forward of slot's input; returns its output (post-activation, or the logits on the last
  // stage), valid until slot's backward.
  virtual const float* forward(int slot) = 0;
  // Last stage: slot's mean loss against `targets` (host memory: class indices as floats, or
  // [n x C] for MSE), its correct argmax count, and the output gradient into the stash,
  // divided by `denom` samples (the per-replica batch), so that accumulating the
  // micro-batches gives the batch mean's gradient.
  virtual double loss(int slot, const float* targets, int denom, int* correct) = 0;
  // Middle stages: the buffer for slot's output gradient (from the next stage), to receive into.
  virtual float* outputGrad(int slot) = 0;
  // Backward of slot: accumulates into grads(); returns the gradient of the stage's input
  // (valid until the next backward; nullptr on the first stage) and frees the stash.
  // onLayerDone(k) runs once local layer k's gradients (layerSpan(k)) are final for this
  // slot and readable from the host or any stream, last layer first; the GPU stage calls it
  // while it still computes the earlier layers (so a reduction can start), and returns only
  // when the whole backward is done.
  virtual const float* backward(int slot, const std::function<void(int)>& onLayerDone) = 0;

  virtual void zeroGrads() = 0;
  // The sum of the squared gradients (in double).
  virtual double gradSquares() = 0;
  // grads *= float(maxNorm / (norm + 1e-6)) when norm > maxNorm, norm the global gradient
  // norm (all stages), as torch.nn.utils.clip_grad_norm_.
  virtual void clipGrads(double norm, double maxNorm) = 0;
  virtual void sgdStep(const SgdParams& p) = 0;
  virtual void adamwStep(const AdamWParams& p) = 0;

  // Bytes held by the stashes (inputs, pre-activations, outputs, output gradients), and
  // their peak: the activation memory the schedule costs (the same on either device).
  virtual size_t liveBytes() const = 0;
  virtual size_t peakBytes() const = 0;

 protected:
  // Layers [lo, hi) of cfg; adam: the optimizer state is two moments, else the momentum.
  StageMath(const MlpConfig& cfg, int lo, int hi, bool adam) : cfg_(cfg), lo_(lo), hi_(hi), adam_(adam) {
    offsets_.push_back(0);
    for (int l = lo; l < hi; ++l) offsets_.push_back(offsets_.back() + static_cast<size_t>(out(l)) * in(l) + out(l));
  }
  int in(int l) const { return cfg_.layers[static_cast<size_t>(l)]; }
  int out(int l) const { return cfg_.layers[static_cast<size_t>(l) + 1]; }

  const MlpConfig cfg_;
  const int lo_, hi_;
  const bool adam_;
  // Layer k's W, then its b, in the flat buffers: offsets_[k], plus the total at the end.
  std::vector<size_t> offsets_;
};

// The parameters Mlp::init(seed) gives layers [lo, hi) into `params` (their flat layout):
// the generator is advanced through the earlier layers' draws (same distributions), so no
// rank materialises the whole model. Biases are zero.
void initStageParams(const MlpConfig& cfg, int lo, int hi, uint64_t seed, float* params);

// The CPU stage (OpenBLAS), initialised by initStageParams.
std::unique_ptr<StageMath> makeCpuStage(const MlpConfig& cfg, int lo, int hi, uint64_t seed, bool adam);

// The GPU stage on device `device`, with the CPU stage's initial weights for the same seed
// (initialised on the host, then copied). CUDA builds load it from libdtrain_train_cuda.so
// (backend.cc); CPU builds throw SpecError.
std::unique_ptr<StageMath> makeCudaStage(const MlpConfig& cfg, int lo, int hi, uint64_t seed, bool adam, int device);

}  // namespace dtrain::train::detail
