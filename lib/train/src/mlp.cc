#include "dtrain/train/mlp.h"


#include <algorithm>
#include <cmath>
#include <random>

#include "dtrain/common/errors.h"
#include "dtrain/common/memory.h"
#include "blas.h"

namespace dtrain::train {
namespace {

constexpr float kSqrt2OverPi = 0.7978845608028654f;

}  // namespace

float gelu(float x) { return 0.5f * x * (1.0f + std::tanh(kSqrt2OverPi * (x + 0.044715f * x * x * x))); }
float geluGrad(float x) {
  float u = kSqrt2OverPi * (x + 0.044715f * x * x * x);
  float t = std::tanh(u);
  return 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * kSqrt2OverPi * (1.0f + 3 * 0.044715f * x * x);
}

void activate(Activation act, const float* __restrict z, float* __restrict a, size_t n) {
  if (act == Activation::kRelu) {
    for (size_t i = 0; i < n; ++i) a[i] = z[i] > 0 ? z[i] : 0.0f;
  } else {
    for (size_t i = 0; i < n; ++i) a[i] = gelu(z[i]);
  }
}

void activationGrad(Activation act, const float* __restrict z, float* __restrict g, size_t n) {
  if (act == Activation::kRelu) {
    for (size_t i = 0; i < n; ++i) g[i] = z[i] <= 0 ? 0.0f : g[i];
  } else {
    for (size_t i = 0; i < n; ++i) g[i] *= geluGrad(z[i]);
  }
}

void addColumnSums(const float* __restrict m, int rows, int cols, float* __restrict sums) {
  for (int i = 0; i < rows; ++i) {
    const float* row = m + static_cast<size_t>(i) * cols;
    for (int j = 0; j < cols; ++j) sums[j] += row[j];
  }
}

double lossAndGrad(Loss lossType, const float* logits, int n, int C, const float* targets, int denom, float* delta,
                   int* correct) {
  double loss = 0;
  int right = 0;
  for (int i = 0; i < n; ++i) {
    const float* row = logits + static_cast<size_t>(i) * C;
    float* d = delta + static_cast<size_t>(i) * C;
    int best = static_cast<int>(std::max_element(row, row + C) - row);
    if (lossType == Loss::kCrossEntropy) {
      int label = static_cast<int>(targets[i]);
      float mx = row[best];
      double sum = 0;
      for (int k = 0; k < C; ++k) sum += std::exp(static_cast<double>(row[k] - mx));
      double logSum = std::log(sum) + mx;
      loss += logSum - row[label];
      for (int k = 0; k < C; ++k)
        d[k] = static_cast<float>((std::exp(static_cast<double>(row[k]) - logSum) - (k == label ? 1.0 : 0.0)) / denom);
      right += best == label;
    } else {
      const float* t = targets + static_cast<size_t>(i) * C;
      int tbest = static_cast<int>(std::max_element(t, t + C) - t);
      right += best == tbest;
      for (int k = 0; k < C; ++k) {
        float e = row[k] - t[k];
        loss += 0.5 * e * e;
        d[k] = e / static_cast<float>(denom);
      }
    }
  }
  if (correct) *correct = right;
  return n > 0 ? loss / n : 0;
}

Mlp::Mlp(MlpConfig cfg) : cfg_(std::move(cfg)) {
  DTRAIN_CHECK(cfg_.layers.size() >= 2);
  offsets_.push_back(0);
  for (size_t l = 0; l + 1 < cfg_.layers.size(); ++l)
    offsets_.push_back(offsets_.back() + static_cast<size_t>(cfg_.layers[l + 1]) * cfg_.layers[l] + cfg_.layers[l + 1]);
  assignFresh(params_, offsets_.back(), 0.0f);
  assignFresh(grads_, offsets_.back(), 0.0f);
}

void Mlp::init(uint64_t seed) {
  std::mt19937_64 gen(seed);
  for (int l = 0; l < numLayers(); ++l) {
    int in = cfg_.layers[static_cast<size_t>(l)], out = cfg_.layers[static_cast<size_t>(l) + 1];
    float bound = std::sqrt(6.0f / static_cast<float>(in));  // Kaiming uniform for ReLU
    std::uniform_real_distribution<float> d(-bound, bound);
    float* w = W(l);
    for (size_t i = 0; i < static_cast<size_t>(in) * out; ++i) w[i] = d(gen);
    std::fill(b(l), b(l) + out, 0.0f);
  }
}

double Mlp::forward(const float* x, int n, const float* targets, int* correct) {
  n_ = n;
  const int L = numLayers();
  acts_.resize(static_cast<size_t>(L) + 1);
  pre_.resize(static_cast<size_t>(L));
  acts_[0].assign(x, x + static_cast<size_t>(n) * cfg_.layers[0]);
  for (int l = 0; l < L; ++l) {
    int in = cfg_.layers[static_cast<size_t>(l)], out = cfg_.layers[static_cast<size_t>(l) + 1];
    auto& z = pre_[static_cast<size_t>(l)];
    z.resize(static_cast<size_t>(n) * out);
    const float* bias = b(l);
    for (int i = 0; i < n; ++i) std::copy(bias, bias + out, z.data() + static_cast<size_t>(i) * out);
    // z[n x out] += a[n x in] * W^T, W is [out x in]
    detail::sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, out, in, 1.0f, acts_[static_cast<size_t>(l)].data(), in,
                W(l), in, 1.0f, z.data(), out);
    auto& a = acts_[static_cast<size_t>(l) + 1];
    a.resize(z.size());
    if (l == L - 1) {
      std::copy(z.begin(), z.end(), a.begin());
    } else {
      activate(cfg_.activation, z.data(), a.data(), z.size());
    }
  }
  // Loss and the output gradient (delta_ = dLoss/dz of the last layer).
  const int C = cfg_.layers.back();
  const auto& logits = acts_[static_cast<size_t>(L)];
  delta_.resize(logits.size());
  return lossAndGrad(cfg_.loss, logits.data(), n, C, targets, n, delta_.data(), correct);
}

void Mlp::backward(const std::function<void(int)>& onLayerDone) {
  const int L = numLayers();
  const int n = n_;
  for (int l = L - 1; l >= 0; --l) {
    int in = cfg_.layers[static_cast<size_t>(l)], out = cfg_.layers[static_cast<size_t>(l) + 1];
    const auto& aPrev = acts_[static_cast<size_t>(l)];
    // dW[out x in] = delta^T[out x n] * aPrev[n x in]
    detail::sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, out, in, n, 1.0f, delta_.data(), out, aPrev.data(), in, 0.0f,
                dW(l), in);
    float* dbias = db(l);
    std::fill(dbias, dbias + out, 0.0f);
    addColumnSums(delta_.data(), n, out, dbias);
    if (l > 0) {
      // deltaPrev[n x in] = delta[n x out] * W[out x in], then through the activation.
      deltaPrev_.resize(static_cast<size_t>(n) * in);
      detail::sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, in, out, 1.0f, delta_.data(), out, W(l), in, 0.0f,
                  deltaPrev_.data(), in);
      activationGrad(cfg_.activation, pre_[static_cast<size_t>(l) - 1].data(), deltaPrev_.data(), deltaPrev_.size());
    }
    if (onLayerDone) onLayerDone(l);
    if (l > 0) std::swap(delta_, deltaPrev_);
  }
}

}  // namespace dtrain::train
