#pragma once
// A multi-layer perceptron on the CPU, forward and backward by hand with BLAS GEMMs.
// Parameters and gradients each live in one flat buffer, layer by layer (W0, b0, W1, b1, ...),
// so that a bucket of gradients is a contiguous range that can be all-reduced in place.
//
// Thread-safety: none; one Mlp per worker thread.
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace dtrain::train {

enum class Activation { kRelu, kGelu };
enum class Loss { kCrossEntropy, kMse };

struct MlpConfig {
  std::vector<int> layers;  // input, hidden..., output
  Activation activation = Activation::kRelu;
  Loss loss = Loss::kCrossEntropy;
};

// GELU (tanh approximation, as PyTorch's approximate="tanh") and its derivative: one
// definition for every path (MLP, pipeline stages; the CUDA kernels mirror it).
float gelu(float x);
float geluGrad(float x);

// The hidden layers' activation and its gradient over n values, shared by the MLP and the
// pipeline stages: a[i] = act(z[i]), and g[i] *= act'(z[i]). Branch-free, so that ReLU's
// mask vectorises: a data-dependent branch per element mispredicted about half the time and
// cost a CPU stage about 5% of its backward.
void activate(Activation act, const float* z, float* a, size_t n);
void activationGrad(Activation act, const float* z, float* g, size_t n);
// sums[j] += sum over the rows of m [rows x cols] (the bias gradient), row by row.
void addColumnSums(const float* m, int rows, int cols, float* sums);

// The mean loss of n rows of logits [n x C] against targets (class indices as floats, or
// [n x C] for MSE), the number of correct argmaxes, and dLoss/dlogits into delta, divided by
// `denom` samples (n for a whole batch; the batch size for one micro-batch of it).
double lossAndGrad(Loss loss, const float* logits, int n, int C, const float* targets, int denom, float* delta,
                   int* correct);

class Mlp {
 public:
  explicit Mlp(MlpConfig cfg);

  // Deterministic init from seed (Kaiming-uniform weights, zero biases).
  void init(uint64_t seed);

  // Forward on batch x [n x in]; returns the mean loss against targets (class indices for
  // cross-entropy, an [n x out] matrix for MSE) and counts correct argmax predictions.
  double forward(const float* x, int n, const float* targets, int* correct);

  // Backward of the last forward: fills grads(). Calls onLayerDone(l) right after layer l's
  // gradients (its W and b) are final, from the last layer to the first, so that callers
  // can start communicating them while the earlier layers are still being computed.
  void backward(const std::function<void(int layer)>& onLayerDone = {});

  std::vector<float>& params() { return params_; }
  std::vector<float>& grads() { return grads_; }
  int numLayers() const { return static_cast<int>(cfg_.layers.size()) - 1; }
  // Offset and size (floats) of layer l's parameters (W then b) in the flat buffers.
  size_t layerOffset(int l) const { return offsets_[static_cast<size_t>(l)]; }
  size_t layerSize(int l) const { return offsets_[static_cast<size_t>(l) + 1] - offsets_[static_cast<size_t>(l)]; }
  const MlpConfig& config() const { return cfg_; }

 private:
  float* W(int l) { return params_.data() + offsets_[static_cast<size_t>(l)]; }
  float* b(int l) { return W(l) + static_cast<size_t>(cfg_.layers[static_cast<size_t>(l) + 1]) * cfg_.layers[static_cast<size_t>(l)]; }
  float* dW(int l) { return grads_.data() + offsets_[static_cast<size_t>(l)]; }
  float* db(int l) { return dW(l) + static_cast<size_t>(cfg_.layers[static_cast<size_t>(l) + 1]) * cfg_.layers[static_cast<size_t>(l)]; }

  MlpConfig cfg_;
  std::vector<size_t> offsets_;
  std::vector<float> params_, grads_;
  // Activations of the last forward: acts_[0] = input, acts_[l+1] = output of layer l;
  // pre_[l] = layer l's pre-activation.
  std::vector<std::vector<float>> acts_, pre_;
  std::vector<float> delta_, deltaPrev_;
  int n_ = 0;
};

}  // namespace dtrain::train
