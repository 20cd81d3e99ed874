// The GPU pipeline stage (stage_math.h): layers [lo, hi) of the MLP with parameters,
// gradients, optimizer state and the per-micro-batch activation stashes in device memory;
// GEMMs by cuBLAS in full FP32, everything else by the kernels of kernels.cu, on one compute
// stream, with the same formulas as the CPU stage (pipeline.cc), so results agree within
// float rounding.
//
// Every call waits for its work before returning (StageMath's contract): a stage's output
// goes to the next stage right after its forward anyway, so there is little to overlap, and
// the pipeline's compute timing and bubble fraction stay real time. The exception is
// backward(), which enqueues all layers first and hands each layer's gradients to
// onLayerDone as soon as its event fires, so the stage group's all-reduce of the last
// layers overlaps the backward of the first ones.
//
// Stash memory is pooled: a slot takes a set of buffers at input() and returns it at the end
// of its backward, so the device holds as many sets as micro-batches were ever in flight at
// once (GPipe: M, 1F1B: at most P - p), without a cudaMalloc per micro-batch.
#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "../stage_math.h"
#include "cuda_util.h"
#include "dtrain/common/errors.h"
#include "kernels.h"

namespace dtrain::train::detail {
namespace {

struct StageLoss {
  double loss;
  int correct;
};

class CudaStage final : public StageMath {
 public:
  CudaStage(const MlpConfig& cfg, int lo, int hi, bool adam, int device)
      : StageMath(cfg, lo, hi, adam), ctx_(device) {
    const size_t n = numParams();
    params_.reset(n);
    grads_.reset(n);
    state_.reset(stateSize());
    cudaCheck(cudaMemsetAsync(params_.get(), 0, n * sizeof(float), ctx_.stream()), "cudaMemsetAsync");
    cudaCheck(cudaMemsetAsync(grads_.get(), 0, n * sizeof(float), ctx_.stream()), "cudaMemsetAsync");
    cudaCheck(cudaMemsetAsync(state_.get(), 0, state_.size() * sizeof(float), ctx_.stream()), "cudaMemsetAsync");
    normPartials_.reset(kernels::kNormPartials);
    norm_.reset(1);
    lossDev_.reset(1);
    resultHost_.ensure(1);
    for (int k = 0; k < numLayers(); ++k) layerDone_.emplace_back();
    for (int l = lo; l < hi; ++l) widestIn_ = std::max(widestIn_, in(l));
    sync();
  }

  ~CudaStage() override { ctx_.drain(); }

  std::string describe() const override { return ctx_.name(); }
  bool onDevice() const override { return true; }

  float* params() override { return params_.get(); }
  float* grads() override { return grads_.get(); }
  float* state() override { return state_.get(); }
  void loadParams(const float* host) override { copyToBackend(params_.get(), host, numParams() * sizeof(float)); }
  void storeParams(float* host) override { copyToHost(host, params_.get(), numParams() * sizeof(float)); }
  void loadState(const float* host) override { copyToBackend(state_.get(), host, state_.size() * sizeof(float)); }
  void storeState(float* host) override { copyToHost(host, state_.get(), state_.size() * sizeof(float)); }
  void copyToBackend(void* dst, const void* host, size_t bytes) override {
    use();
    if (bytes == 0) return;
    cudaCheck(cudaMemcpyAsync(dst, host, bytes, cudaMemcpyHostToDevice, ctx_.stream()), "cudaMemcpyAsync(H2D)");
    sync();
  }
  void copyToHost(void* host, const void* src, size_t bytes) override {
    use();
    if (bytes == 0) return;
    cudaCheck(cudaMemcpyAsync(host, src, bytes, cudaMemcpyDeviceToHost, ctx_.stream()), "cudaMemcpyAsync(D2H)");
    sync();
  }
  void* scratch(size_t bytes) override {
    use();
    scratch_.ensure(bytes);
    return scratch_.get();
  }

  float* input(int slot, int n) override {
    use();
    Stash& s = stash(slot);
    if (!s.buf) {
      if (free_.empty()) {
        s.buf = std::make_unique<Buffers>();
      } else {
        s.buf = std::move(free_.back());
        free_.pop_back();
      }
    }
    if (s.buf->rows < n) allocate(*s.buf, n);
    s.n = n;
    s.forwarded = s.hasDelta = false;
    return s.buf->in.get();
  }

  const float* forward(int slot) override {
    use();
    Stash& s = stash(slot);
    Buffers& b = *s.buf;
    const int n = s.n, L = numLayers();
    cudaStream_t st = ctx_.stream();
    for (int k = 0; k < L; ++k) {
      const int l = lo_ + k;
      const float* a = k == 0 ? b.in.get() : b.act[static_cast<size_t>(k) - 1].get();
      float* z = b.pre[static_cast<size_t>(k)].get();
      kernels::fillBias(z, bias(l), n, out(l), st);
      // z[n x out] += a[n x in] * W^T, W is [out x in]
      gemmRowMajor(false, true, n, out(l), in(l), 1.0f, a, in(l), W(l), in(l), 1.0f, z, out(l));
      // The output layer has no activation: its output is the pre-activation itself.
      if (!outputLayer(l))
        kernels::activationForward(z, b.act[static_cast<size_t>(k)].get(), static_cast<size_t>(n) * out(l),
                                   cfg_.activation == Activation::kGelu, st);
    }
    sync();
    s.forwarded = true;
    account();
    return output(b);
  }

  double loss(int slot, const float* targets, int denom, int* correct) override {
    use();
    Stash& s = stash(slot);
    const int n = s.n, C = cfg_.layers.back();
    const bool isMse = cfg_.loss == Loss::kMse;
    cudaStream_t st = ctx_.stream();
    const size_t yFloats = static_cast<size_t>(n) * (isMse ? C : 1);
    targets_.ensure(yFloats);
    rowLoss_.ensure(static_cast<size_t>(n));
    rowCorrect_.ensure(static_cast<size_t>(n));
    cudaCheck(cudaMemcpyAsync(targets_.get(), targets, yFloats * sizeof(float), cudaMemcpyHostToDevice, st),
              "cudaMemcpyAsync(targets)");
    const float* logits = output(*s.buf);
    float* delta = s.buf->delta.get();
    if (isMse) kernels::mse(logits, targets_.get(), n, C, rowLoss_.get(), rowCorrect_.get(), delta, st, denom);
    else kernels::crossEntropy(logits, targets_.get(), n, C, rowLoss_.get(), rowCorrect_.get(), delta, st, denom);
    StageLoss* r = lossDev_.get();
    kernels::reduceLoss(rowLoss_.get(), rowCorrect_.get(), n, &r->loss, &r->correct, st);
    cudaCheck(cudaMemcpyAsync(resultHost_.get(), r, sizeof(StageLoss), cudaMemcpyDeviceToHost, st),
              "cudaMemcpyAsync(loss)");
    sync();
    s.hasDelta = true;
    account();
    if (correct) *correct = resultHost_.get()->correct;
    return resultHost_.get()->loss;
  }

  float* outputGrad(int slot) override {
    Stash& s = stash(slot);
    s.hasDelta = true;
    account();
    return s.buf->delta.get();
  }

  const float* backward(int slot, const std::function<void(int)>& onLayerDone) override {
    use();
    Stash& s = stash(slot);
    Buffers& b = *s.buf;
    const int n = s.n, L = numLayers();
    const bool useGelu = cfg_.activation == Activation::kGelu;
    cudaStream_t st = ctx_.stream();
    // The previous backward's input gradient is in one of these: free to overwrite now.
    gradA_.ensure(static_cast<size_t>(n) * widestIn_);
    gradB_.ensure(static_cast<size_t>(n) * widestIn_);
    float* delta = b.delta.get();
    // A middle stage received d(loss)/d(its post-activation output): through the activation.
    if (!last())
      kernels::activationBackward(b.pre[static_cast<size_t>(L) - 1].get(), delta,
                                  static_cast<size_t>(n) * outWidth(), useGelu, st);
    for (int k = L - 1; k >= 0; --k) {
      const int l = lo_ + k;
      const float* aPrev = k == 0 ? b.in.get() : b.act[static_cast<size_t>(k) - 1].get();
      // dW[out x in] += delta^T[out x n] * aPrev[n x in]; db += column sums: accumulated over
      // the micro-batches, as the CPU stage.
      gemmRowMajor(true, false, out(l), in(l), n, 1.0f, delta, out(l), aPrev, in(l), 1.0f, dW(l), in(l));
      kernels::biasGrad(delta, db(l), n, out(l), st, /*accumulate=*/true);
      cudaCheck(cudaEventRecord(layerDone_[static_cast<size_t>(k)].get(), st), "cudaEventRecord");
      if (k == 0 && lo_ == 0) break;
      // deltaPrev[n x in] = delta[n x out] * W[out x in], then through the previous layer's
      // activation (the stage's input gradient is left as is: the previous stage applies it).
      float* prev = delta == gradA_.get() ? gradB_.get() : gradA_.get();
      gemmRowMajor(false, false, n, in(l), out(l), 1.0f, delta, out(l), W(l), in(l), 0.0f, prev, in(l));
      if (k > 0)
        kernels::activationBackward(b.pre[static_cast<size_t>(k) - 1].get(), prev, static_cast<size_t>(n) * in(l),
                                    useGelu, st);
      delta = prev;
    }
    if (onLayerDone)
      for (int k = L - 1; k >= 0; --k) {
        cudaCheck(cudaEventSynchronize(layerDone_[static_cast<size_t>(k)].get()), "cudaEventSynchronize(layer)");
        onLayerDone(k);
      }
    use();  // onLayerDone may have talked to a communicator that switched devices
    sync();
    // Stream order makes the buffers safe to hand to the next slot at once.
    free_.push_back(std::move(s.buf));
    s = Stash{};
    account();
    return lo_ == 0 ? nullptr : delta;
  }

  void zeroGrads() override {
    use();
    cudaCheck(cudaMemsetAsync(grads_.get(), 0, numParams() * sizeof(float), ctx_.stream()), "cudaMemsetAsync");
    sync();
  }
  double gradSquares() override {
    use();
    kernels::l2Norm(grads_.get(), numParams(), normPartials_.get(), norm_.get(), ctx_.stream());
    double norm = 0;
    copyToHost(&norm, norm_.get(), sizeof(double));
    return norm * norm;
  }
  void clipGrads(double norm, double maxNorm) override {
    if (!(norm > maxNorm)) return;
    // The kernel reads the norm from device memory (the data-parallel path decides there).
    copyToBackend(norm_.get(), &norm, sizeof(double));
    kernels::clipByNorm(grads_.get(), numParams(), norm_.get(), maxNorm, ctx_.stream());
    sync();
  }
  void sgdStep(const SgdParams& p) override {
    use();
    kernels::sgd(params_.get(), grads_.get(), state_.get(), numParams(), p, ctx_.stream());
    sync();
  }
  void adamwStep(const AdamWParams& p) override {
    use();
    kernels::adamw(params_.get(), grads_.get(), state_.get(), state_.get() + numParams(), numParams(), p,
                   ctx_.stream());
    sync();
  }
  size_t liveBytes() const override { return live_; }
  size_t peakBytes() const override { return peak_; }

 private:
  // A micro-batch's device buffers for up to `rows` rows: the input, each layer's
  // pre-activation and output (none for the MLP's output layer: its output is the
  // pre-activation), and the output gradient.
  struct Buffers {
    int rows = 0;
    DeviceBuffer<float> in, delta;
    std::vector<DeviceBuffer<float>> pre, act;
  };
  struct Stash {
    int n = 0;
    bool forwarded = false, hasDelta = false;
    std::unique_ptr<Buffers> buf;
  };

  size_t weights(int l) const { return static_cast<size_t>(out(l)) * in(l); }
  bool outputLayer(int l) const { return l == static_cast<int>(cfg_.layers.size()) - 2; }
  float* W(int l) { return params_.get() + offsets_[static_cast<size_t>(l - lo_)]; }
  float* bias(int l) { return W(l) + weights(l); }
  float* dW(int l) { return grads_.get() + offsets_[static_cast<size_t>(l - lo_)]; }
  float* db(int l) { return dW(l) + weights(l); }
  const float* output(const Buffers& b) const {
    const size_t k = static_cast<size_t>(numLayers()) - 1;
    return outputLayer(hi_ - 1) ? b.pre[k].get() : b.act[k].get();
  }

  void use() const { ctx_.use(); }
  void sync() const { cudaCheck(cudaStreamSynchronize(ctx_.stream()), "cudaStreamSynchronize"); }

  Stash& stash(int slot) {
    if (stash_.size() <= static_cast<size_t>(slot)) stash_.resize(static_cast<size_t>(slot) + 1);
    return stash_[static_cast<size_t>(slot)];
  }

  // (Re)allocates b for `rows` rows; nothing is in flight (every call synchronises).
  void allocate(Buffers& b, int rows) {
    const size_t n = static_cast<size_t>(rows);
    const int L = numLayers();
    b.in.reset(n * inWidth());
    b.delta.reset(n * outWidth());
    b.pre.resize(static_cast<size_t>(L));
    b.act.resize(static_cast<size_t>(L));
    for (int k = 0; k < L; ++k) {
      const int l = lo_ + k;
      b.pre[static_cast<size_t>(k)].reset(n * out(l));
      b.act[static_cast<size_t>(k)].reset(outputLayer(l) ? 0 : n * out(l));
    }
    b.rows = rows;
  }

  // Counted as the CPU stage counts its vectors (an output layer's output as a copy of its
  // pre-activation), so both report the same activation memory.
  void account() {
    size_t floats = 0;
    for (const auto& s : stash_) {
      if (!s.buf) continue;
      const size_t n = static_cast<size_t>(s.n);
      floats += n * inWidth();
      if (s.forwarded)
        for (int l = lo_; l < hi_; ++l) floats += 2 * n * out(l);
      if (s.hasDelta) floats += n * outWidth();
    }
    live_ = floats * sizeof(float);
    peak_ = std::max(peak_, live_);
  }

  // Row-major C[M x N] = alpha * op(A) op(B) + beta * C, as cblas_sgemm(CblasRowMajor, ...):
  // column-major cuBLAS computes C^T = op(B)^T op(A)^T (see cuda_backend.cu).
  void gemmRowMajor(bool transA, bool transB, int M, int N, int K, float alpha, const float* A, int lda,
                    const float* B, int ldb, float beta, float* C, int ldc) {
    cublasCheck(cublasSgemm(ctx_.cublas(), transB ? CUBLAS_OP_T : CUBLAS_OP_N, transA ? CUBLAS_OP_T : CUBLAS_OP_N, N,
                            M, K, &alpha, B, ldb, A, lda, &beta, C, ldc),
                "cublasSgemm");
  }

  DeviceContext ctx_;
  int widestIn_ = 0;
  DeviceBuffer<float> params_, grads_, state_, targets_, gradA_, gradB_;
  DeviceBuffer<double> rowLoss_, normPartials_, norm_;
  DeviceBuffer<int> rowCorrect_;
  DeviceBuffer<StageLoss> lossDev_;
  DeviceBuffer<char> scratch_;
  PinnedBuffer<StageLoss> resultHost_;
  std::vector<Event> layerDone_;
  std::vector<Stash> stash_;
  std::vector<std::unique_ptr<Buffers>> free_;
  size_t live_ = 0, peak_ = 0;
};

std::unique_ptr<StageMath> makeStage(const MlpConfig& cfg, int lo, int hi, uint64_t seed, bool adam, int device) {
  auto s = std::make_unique<CudaStage>(cfg, lo, hi, adam, device);
  // The CPU stage's initial weights: drawn on the host, then copied.
  std::vector<float> host(s->numParams());
  initStageParams(cfg, lo, hi, seed, host.data());
  s->loadParams(host.data());
  return s;
}

}  // namespace

#ifdef DTRAIN_CUDA_PLUGIN
// Built into libdtrain_train_cuda.so next to dtrain_make_cuda_backend (cuda_backend.cu);
// resolved by backend.cc's makeCudaStage. initStageParams resolves against the executable.
extern "C" __attribute__((visibility("default"))) StageMath* dtrain_make_cuda_stage(const MlpConfig* cfg, int lo, int hi,
                                                                                   uint64_t seed, bool adam, int device) {
  return makeStage(*cfg, lo, hi, seed, adam, device).release();
}
#else
std::unique_ptr<StageMath> makeCudaStage(const MlpConfig& cfg, int lo, int hi, uint64_t seed, bool adam, int device) {
  return makeStage(cfg, lo, hi, seed, adam, device);
}
#endif

}  // namespace dtrain::train::detail
