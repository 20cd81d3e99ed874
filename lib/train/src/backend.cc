// The CPU backend: Mlp (OpenBLAS) plus the optimizer loops. Everything completes before a
// call returns, so waitLayer() and synchronize() have nothing to wait for. Also the loader of
// the GPU plugin (makeCudaBackend, makeCudaStage).
#include <dlfcn.h>

#include <cmath>
#include <cstring>

#include <fmt/format.h>

#include "dtrain/common/dynlib.h"
#include "dtrain/common/errors.h"
#include "dtrain/common/memory.h"
#include "blas.h"
#include "dtrain/train/backend.h"
#include "stage_math.h"

namespace dtrain::train::detail {
namespace {

class CpuBackend final : public MathBackend {
 public:
  CpuBackend(const MlpConfig& cfg, uint64_t seed, bool adam) : model_(cfg), adam_(adam) {
    model_.init(seed);
    n_ = model_.params().size();
    assignFresh(state_, model_.params().size() * (adam ? 2 : 1), 0.0f);
  }

  std::string describe() const override { return cpuMathDescription(); }
  bool onDevice() const override { return false; }
  const MlpConfig& config() const override { return model_.config(); }
  size_t numParams() const override { return n_; }
  bool adam() const override { return adam_; }
  std::vector<size_t> layerOffsets() const override {
    std::vector<size_t> off;
    for (int l = 0; l < model_.numLayers(); ++l) off.push_back(model_.layerOffset(l));
    off.push_back(numParams());
    return off;
  }

  float* params() override { return model_.params().data(); }
  float* grads() override { return model_.grads().data(); }
  float* state() override { return state_.data(); }

  void loadParams(const float* host) override { std::memcpy(params(), host, numParams() * sizeof(float)); }
  void storeParams(float* host) override { std::memcpy(host, params(), numParams() * sizeof(float)); }
  void loadState(const float* host) override { std::memcpy(state(), host, state_.size() * sizeof(float)); }
  void storeState(float* host) override { std::memcpy(host, state(), state_.size() * sizeof(float)); }
  void storeGrads(float* host) override { std::memcpy(host, grads(), numParams() * sizeof(float)); }
  void copyToBackend(void* dst, const void* host, size_t bytes) override { std::memcpy(dst, host, bytes); }
  void copyToHost(void* host, const void* src, size_t bytes) override { std::memcpy(host, src, bytes); }
  void* scratch(size_t bytes) override {
    if (scratch_.size() < bytes) scratch_.resize(bytes);
    return scratch_.data();
  }

  void forward(const float* x, int n, const float* targets) override {
    loss_ = model_.forward(x, n, targets, &correct_);
  }
  double result(int* correct) override {
    if (correct) *correct = correct_;
    return loss_;
  }
  void backward(const std::function<void(int)>& onLayerDone) override { model_.backward(onLayerDone); }
  bool asyncCompute() const override { return false; }
  void waitLayer(int) override {}

  void clipGradNorm(double maxNorm) override {
    auto& grads = model_.grads();
    double sq = 0;
    for (float g : grads) sq += static_cast<double>(g) * g;
    double norm = std::sqrt(sq);
    if (norm > maxNorm) {
      float scale = static_cast<float>(maxNorm / (norm + 1e-6));
      for (float& g : grads) g *= scale;
    }
  }

  void sgdStep(const SgdParams& p) override {
    cpuSgdStep(model_.params().data(), model_.grads().data(), state_.data(), model_.params().size(), p);
  }

  void adamwStep(const AdamWParams& p) override {
    cpuAdamwStep(model_.params().data(), model_.grads().data(), state_.data(), model_.params().size(), p);
  }

  void synchronize() override {}

 private:
  Mlp model_;
  bool adam_;
  size_t n_ = 0;
  std::vector<float> state_;
  std::vector<char> scratch_;
  double loss_ = 0;
  int correct_ = 0;
};

}  // namespace

void cpuSgdStep(float* params, const float* grads, float* state, size_t n, const SgdParams& p) {
  const float lr = p.lr, wd = p.weight_decay, mu = p.momentum;
  for (size_t i = 0; i < n; ++i) {
    float g = grads[i] + wd * params[i];
    if (mu > 0) {
      state[i] = mu * state[i] + g;
      g = p.nesterov ? g + mu * state[i] : state[i];
    }
    params[i] -= lr * g;
  }
}

void cpuAdamwStep(float* params, const float* grads, float* state, size_t n, const AdamWParams& p) {
  const float lr = p.lr, wd = p.weight_decay, b1 = p.beta1, b2 = p.beta2, eps = p.eps, c1 = p.c1, c2 = p.c2;
  float* m = state;
  float* v = state + n;
  for (size_t i = 0; i < n; ++i) {
    params[i] -= lr * wd * params[i];
    m[i] = b1 * m[i] + (1 - b1) * grads[i];
    v[i] = b2 * v[i] + (1 - b2) * grads[i] * grads[i];
    params[i] -= lr * (m[i] / c1) / (std::sqrt(v[i]) / c2 + eps);
  }
}

std::unique_ptr<MathBackend> makeCpuBackend(const MlpConfig& cfg, uint64_t seed, bool adam) {
  return std::make_unique<CpuBackend>(cfg, seed, adam);
}

#ifndef DTRAIN_HAVE_CUDA
std::unique_ptr<MathBackend> makeCudaBackend(const MlpConfig&, uint64_t, bool, int) {
  throw SpecError("trainer.device is \"cuda\" but this is a CPU build; rebuild with -DDTRAIN_WITH_CUDA=ON");
}
std::unique_ptr<StageMath> makeCudaStage(const MlpConfig&, int, int, uint64_t, bool, int) {
  throw SpecError("trainer.device is \"cuda\" but this is a CPU build; rebuild with -DDTRAIN_WITH_CUDA=ON");
}
#elif defined(DTRAIN_CUDA_PLUGIN_LOADER)
namespace {

// The GPU math lives in libdtrain_train_cuda.so next to the executable, loaded on first use
// (see cuda_backend.cu for why); returns its factory `name`. Thread-safe: a function-local
// static. The library counts as found when it has the data-parallel factory.
void* cudaPluginSymbol(const char* name) {
  static void* handle = [] {
    std::string errors;
    void* h = openLibrary(pluginCandidates("libdtrain_train_cuda.so"), "dtrain_make_cuda_backend", &errors);
    if (!h)
      throw IoError("cannot load the GPU trainer, libdtrain_train_cuda.so (" + errors +
                    "); it is built beside the dtrain binary in CUDA builds (copy it along with dtrain, also to "
                    "ssh.dtrain_path on remote hosts) and needs CUDA's runtime and cuBLAS; or use trainer.device \"cpu\"");
    return h;
  }();
  void* f = ::dlsym(handle, name);
  if (!f)
    throw IoError(fmt::format("cannot load the GPU trainer: libdtrain_train_cuda.so has no {} (a stale build?)", name));
  return f;
}

}  // namespace

std::unique_ptr<MathBackend> makeCudaBackend(const MlpConfig& cfg, uint64_t seed, bool adam, int device) {
  using Factory = MathBackend* (*)(const MlpConfig*, uint64_t, bool, int);
  static auto factory = reinterpret_cast<Factory>(cudaPluginSymbol("dtrain_make_cuda_backend"));
  return std::unique_ptr<MathBackend>(factory(&cfg, seed, adam, device));
}

std::unique_ptr<StageMath> makeCudaStage(const MlpConfig& cfg, int lo, int hi, uint64_t seed, bool adam, int device) {
  using Factory = StageMath* (*)(const MlpConfig*, int, int, uint64_t, bool, int);
  static auto factory = reinterpret_cast<Factory>(cudaPluginSymbol("dtrain_make_cuda_stage"));
  return std::unique_ptr<StageMath>(factory(&cfg, lo, hi, seed, adam, device));
}
#endif

}  // namespace dtrain::train::detail
