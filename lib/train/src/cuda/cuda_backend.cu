// The GPU backend: parameters, gradients, optimizer state and activations in device memory;
// GEMMs by cuBLAS in full FP32 (no TF32, to stay close to the CPU path), everything else by
// the kernels of kernels.cu, all on one compute stream. The host only enqueues, except where
// MathBackend documents a wait: result() once per step, waitLayer() before a bucket goes to
// the communicator, and the whole-buffer copies.
#include <algorithm>
#include <cstring>
#include <vector>

#include <fmt/format.h>

#include "cuda_util.h"
#include "dtrain/common/errors.h"
#include "dtrain/train/backend.h"
#include "kernels.h"

namespace dtrain::train::detail {

void cudaCheck(cudaError_t e, const char* call) {
  if (e != cudaSuccess) {
    (void)cudaGetLastError();  // clear a non-sticky error so the next call reports its own
    throw IoError(fmt::format("{}: CUDA error: {} ({})", call, cudaGetErrorString(e), cudaGetErrorName(e)));
  }
}

void allocCheck(cudaError_t e, const char* call, size_t bytes, bool device) {
  if (e == cudaErrorMemoryAllocation) {
    (void)cudaGetLastError();  // (not sticky: the next call reports its own)
    int dev = -1;
    (void)cudaGetDevice(&dev);
    throw AllocationError(fmt::format("{} of {} bytes on cuda:{}: out of {} memory", call, bytes, dev,
                                      device ? "device" : "page-locked host"),
                          device);
  }
  cudaCheck(e, call);
}

void cublasCheck(cublasStatus_t s, const char* call) {
  if (s != CUBLAS_STATUS_SUCCESS)
    throw IoError(fmt::format("{}: cuBLAS error: {} ({})", call, cublasGetStatusString(s), cublasGetStatusName(s)));
}

void checkLaunch(const char* kernel) { cudaCheck(cudaGetLastError(), kernel); }

namespace {

struct LossResult {
  double loss;
  int correct;
};

class CudaBackend final : public MathBackend {
 public:
  CudaBackend(const MlpConfig& cfg, uint64_t seed, bool adam, int device)
      : cfg_(cfg), adam_(adam), ctx_(device) {

    // Same layout and the same initial weights as the CPU backend: Mlp initialises on the host.
    Mlp host(cfg_);
    host.init(seed);
    for (int l = 0; l < host.numLayers(); ++l) offsets_.push_back(host.layerOffset(l));
    offsets_.push_back(host.params().size());
    const size_t n = host.params().size();
    params_.reset(n);
    grads_.reset(n);
    state_.reset(n * (adam_ ? 2 : 1));
    cudaCheck(cudaMemsetAsync(grads_.get(), 0, n * sizeof(float), ctx_.stream()), "cudaMemsetAsync");
    cudaCheck(cudaMemsetAsync(state_.get(), 0, state_.size() * sizeof(float), ctx_.stream()), "cudaMemsetAsync");
    loadParams(host.params().data());
    normPartials_.reset(kernels::kNormPartials);
    norm_.reset(1);
    lossDev_.reset(1);
    resultHost_.ensure(1);
    for (int l = 0; l < numLayers(); ++l) layerDone_.emplace_back();
    pre_.resize(static_cast<size_t>(numLayers()));
    acts_.resize(static_cast<size_t>(numLayers()));  // acts_[l] = input of layer l
  }

  ~CudaBackend() override { ctx_.drain(); }

  std::string describe() const override { return ctx_.name(); }
  bool onDevice() const override { return true; }
  const MlpConfig& config() const override { return cfg_; }
  size_t numParams() const override { return params_.size(); }
  bool adam() const override { return adam_; }
  std::vector<size_t> layerOffsets() const override { return offsets_; }

  float* params() override { return params_.get(); }
  float* grads() override { return grads_.get(); }
  float* state() override { return state_.get(); }

  void loadParams(const float* host) override { copyToBackend(params_.get(), host, numParams() * sizeof(float)); }
  void storeParams(float* host) override { copyToHost(host, params_.get(), numParams() * sizeof(float)); }
  void loadState(const float* host) override { copyToBackend(state_.get(), host, state_.size() * sizeof(float)); }
  void storeState(float* host) override { copyToHost(host, state_.get(), state_.size() * sizeof(float)); }
  void storeGrads(float* host) override { copyToHost(host, grads_.get(), numParams() * sizeof(float)); }

  void copyToBackend(void* dst, const void* host, size_t bytes) override {
    use();
    if (bytes == 0) return;
    cudaCheck(cudaMemcpyAsync(dst, host, bytes, cudaMemcpyHostToDevice, ctx_.stream()), "cudaMemcpyAsync(H2D)");
    cudaCheck(cudaStreamSynchronize(ctx_.stream()), "cudaStreamSynchronize");
  }
  void copyToHost(void* host, const void* src, size_t bytes) override {
    use();
    if (bytes == 0) return;
    cudaCheck(cudaMemcpyAsync(host, src, bytes, cudaMemcpyDeviceToHost, ctx_.stream()), "cudaMemcpyAsync(D2H)");
    cudaCheck(cudaStreamSynchronize(ctx_.stream()), "cudaStreamSynchronize");
  }
  void* scratch(size_t bytes) override {
    use();
    if (scratch_.size() < bytes) {
      cudaCheck(cudaStreamSynchronize(ctx_.stream()), "cudaStreamSynchronize");
      scratch_.reset(bytes);
    }
    return scratch_.get();
  }

  void forward(const float* x, int n, const float* targets) override {
    use();
    const int L = numLayers();
    const int in = cfg_.layers.front(), C = cfg_.layers.back();
    const bool isMse = cfg_.loss == Loss::kMse;
    const size_t xFloats = static_cast<size_t>(n) * in, yFloats = static_cast<size_t>(n) * (isMse ? C : 1);
    // The pinned staging buffers may still be read by the previous forward's copies.
    if (inputQueued_) cudaCheck(cudaEventSynchronize(inputCopied_.get()), "cudaEventSynchronize");
    if (capacity_ < n) grow(n);
    std::memcpy(xHost_.get(), x, xFloats * sizeof(float));
    std::memcpy(yHost_.get(), targets, yFloats * sizeof(float));
    cudaStream_t s = ctx_.stream();
    cudaCheck(cudaMemcpyAsync(acts_[0].get(), xHost_.get(), xFloats * sizeof(float), cudaMemcpyHostToDevice, s),
              "cudaMemcpyAsync(x)");
    cudaCheck(cudaMemcpyAsync(targets_.get(), yHost_.get(), yFloats * sizeof(float), cudaMemcpyHostToDevice, s),
              "cudaMemcpyAsync(targets)");
    cudaCheck(cudaEventRecord(inputCopied_.get(), s), "cudaEventRecord");
    inputQueued_ = true;

    for (int l = 0; l < L; ++l) {
      const int lin = cfg_.layers[static_cast<size_t>(l)], lout = cfg_.layers[static_cast<size_t>(l) + 1];
      float* z = pre_[static_cast<size_t>(l)].get();
      kernels::fillBias(z, b(l), n, lout, s);
      // z[n x out] += a[n x in] * W^T, W is [out x in]
      gemmRowMajor(false, true, n, lout, lin, 1.0f, acts_[static_cast<size_t>(l)].get(), lin, W(l), lin, 1.0f, z, lout);
      if (l < L - 1)
        kernels::activationForward(z, acts_[static_cast<size_t>(l) + 1].get(), static_cast<size_t>(n) * lout,
                                   cfg_.activation == Activation::kGelu, s);
    }
    // The logits are the last pre-activation (no activation on the output layer).
    const float* logits = pre_[static_cast<size_t>(L) - 1].get();
    if (isMse) kernels::mse(logits, targets_.get(), n, C, rowLoss_.get(), rowCorrect_.get(), delta_.get(), s);
    else kernels::crossEntropy(logits, targets_.get(), n, C, rowLoss_.get(), rowCorrect_.get(), delta_.get(), s);
    LossResult* r = lossDev_.get();
    kernels::reduceLoss(rowLoss_.get(), rowCorrect_.get(), n, &r->loss, &r->correct, s);
    cudaCheck(cudaMemcpyAsync(resultHost_.get(), r, sizeof(LossResult), cudaMemcpyDeviceToHost, s),
              "cudaMemcpyAsync(loss)");
    cudaCheck(cudaEventRecord(resultReady_.get(), s), "cudaEventRecord");
    n_ = n;
  }

  double result(int* correct) override {
    use();
    cudaCheck(cudaEventSynchronize(resultReady_.get()), "cudaEventSynchronize(loss)");
    if (correct) *correct = resultHost_.get()->correct;
    return resultHost_.get()->loss;
  }

  void backward(const std::function<void(int)>& onLayerDone) override {
    use();
    const int L = numLayers();
    const int n = n_;
    cudaStream_t s = ctx_.stream();
    for (int l = L - 1; l >= 0; --l) {
      const int lin = cfg_.layers[static_cast<size_t>(l)], lout = cfg_.layers[static_cast<size_t>(l) + 1];
      const float* aPrev = acts_[static_cast<size_t>(l)].get();
      // dW[out x in] = delta^T[out x n] * aPrev[n x in]
      gemmRowMajor(true, false, lout, lin, n, 1.0f, delta_.get(), lout, aPrev, lin, 0.0f, dW(l), lin);
      kernels::biasGrad(delta_.get(), db(l), n, lout, s);
      if (l > 0) {
        // deltaPrev[n x in] = delta[n x out] * W[out x in], then through the activation.
        gemmRowMajor(false, false, n, lin, lout, 1.0f, delta_.get(), lout, W(l), lin, 0.0f, deltaPrev_.get(), lin);
        kernels::activationBackward(pre_[static_cast<size_t>(l) - 1].get(), deltaPrev_.get(),
                                    static_cast<size_t>(n) * lin, cfg_.activation == Activation::kGelu, s);
      }
      cudaCheck(cudaEventRecord(layerDone_[static_cast<size_t>(l)].get(), s), "cudaEventRecord");
      if (onLayerDone) onLayerDone(l);
      if (l > 0) std::swap(delta_, deltaPrev_);
    }
  }
  bool asyncCompute() const override { return true; }
  void waitLayer(int layer) override {
    use();
    cudaCheck(cudaEventSynchronize(layerDone_[static_cast<size_t>(layer)].get()), "cudaEventSynchronize(layer)");
  }

  void clipGradNorm(double maxNorm) override {
    use();
    kernels::l2Norm(grads_.get(), numParams(), normPartials_.get(), norm_.get(), ctx_.stream());
    kernels::clipByNorm(grads_.get(), numParams(), norm_.get(), maxNorm, ctx_.stream());
  }
  void sgdStep(const SgdParams& p) override {
    use();
    kernels::sgd(params_.get(), grads_.get(), state_.get(), numParams(), p, ctx_.stream());
  }
  void adamwStep(const AdamWParams& p) override {
    use();
    kernels::adamw(params_.get(), grads_.get(), state_.get(), state_.get() + numParams(), numParams(), p,
                   ctx_.stream());
  }
  void synchronize() override {
    use();
    cudaCheck(cudaStreamSynchronize(ctx_.stream()), "cudaStreamSynchronize");
  }

 private:
  int numLayers() const { return static_cast<int>(cfg_.layers.size()) - 1; }
  void use() const { ctx_.use(); }

  float* W(int l) { return params_.get() + offsets_[static_cast<size_t>(l)]; }
  float* b(int l) { return W(l) + weights(l); }
  float* dW(int l) { return grads_.get() + offsets_[static_cast<size_t>(l)]; }
  float* db(int l) { return dW(l) + weights(l); }
  size_t weights(int l) const {
    return static_cast<size_t>(cfg_.layers[static_cast<size_t>(l) + 1]) * cfg_.layers[static_cast<size_t>(l)];
  }

  // Row-major C[M x N] = alpha * op(A) op(B) + beta * C, as cblas_sgemm(CblasRowMajor, ...).
  // cuBLAS is column-major, and a row-major matrix read column-major is its transpose, so
  // this computes C^T = op(B)^T op(A)^T: operands and M/N swapped, ops and leading
  // dimensions unchanged.
  void gemmRowMajor(bool transA, bool transB, int M, int N, int K, float alpha, const float* A, int lda,
                    const float* B, int ldb, float beta, float* C, int ldc) {
    cublasCheck(cublasSgemm(ctx_.cublas(), transB ? CUBLAS_OP_T : CUBLAS_OP_N, transA ? CUBLAS_OP_T : CUBLAS_OP_N, N,
                            M, K, &alpha, B, ldb, A, lda, &beta, C, ldc),
                "cublasSgemm");
  }

  // Activation buffers for batches of up to n rows. Waits for work in flight first.
  void grow(int n) {
    cudaCheck(cudaStreamSynchronize(ctx_.stream()), "cudaStreamSynchronize");
    const int L = numLayers();
    const size_t rows = static_cast<size_t>(n);
    int widest = 0;
    for (int w : cfg_.layers) widest = std::max(widest, w);
    acts_[0].reset(rows * cfg_.layers.front());
    for (int l = 0; l < L; ++l) {
      const size_t out = static_cast<size_t>(cfg_.layers[static_cast<size_t>(l) + 1]);
      pre_[static_cast<size_t>(l)].reset(rows * out);
      if (l < L - 1) acts_[static_cast<size_t>(l) + 1].reset(rows * out);
    }
    delta_.reset(rows * static_cast<size_t>(widest));
    deltaPrev_.reset(rows * static_cast<size_t>(widest));
    const size_t yFloats = rows * static_cast<size_t>(cfg_.loss == Loss::kMse ? cfg_.layers.back() : 1);
    targets_.reset(yFloats);
    rowLoss_.reset(rows);
    rowCorrect_.reset(rows);
    xHost_.ensure(rows * cfg_.layers.front());
    yHost_.ensure(yFloats);
    capacity_ = n;
  }

  MlpConfig cfg_;
  bool adam_;
  DeviceContext ctx_;
  std::vector<size_t> offsets_;
  DeviceBuffer<float> params_, grads_, state_;
  // acts_[l]: input of layer l (acts_[0] = the batch); pre_[l]: layer l's pre-activation.
  std::vector<DeviceBuffer<float>> acts_, pre_;
  DeviceBuffer<float> delta_, deltaPrev_, targets_;
  DeviceBuffer<double> rowLoss_, normPartials_, norm_;
  DeviceBuffer<int> rowCorrect_;
  DeviceBuffer<LossResult> lossDev_;
  DeviceBuffer<char> scratch_;
  PinnedBuffer<float> xHost_, yHost_;
  PinnedBuffer<LossResult> resultHost_;
  Event inputCopied_, resultReady_;
  std::vector<Event> layerDone_;
  bool inputQueued_ = false;
  int capacity_ = 0;
  int n_ = 0;
};

}  // namespace

#ifdef DTRAIN_CUDA_PLUGIN
// Built into libdtrain_train_cuda.so, which dtrain loads only when a worker trains on a GPU:
// cuBLAS costs about half a second of start-up per process, which every other dtrain
// process (launcher, agents, CPU workers, store and bench commands) must not pay. A
// distinct name: the executable's makeCudaBackend (the loader) must not interpose it.
extern "C" __attribute__((visibility("default"))) MathBackend* dtrain_make_cuda_backend(const MlpConfig* cfg, uint64_t seed,
                                                                                       bool adam, int device) {
  return new CudaBackend(*cfg, seed, adam, device);
}
#else
std::unique_ptr<MathBackend> makeCudaBackend(const MlpConfig& cfg, uint64_t seed, bool adam, int device) {
  return std::make_unique<CudaBackend>(cfg, seed, adam, device);
}
#endif

}  // namespace dtrain::train::detail
