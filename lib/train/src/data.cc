#include "dtrain/train/data.h"

#include <algorithm>
#include <cmath>
#include <numeric>

namespace dtrain::train {
namespace {

uint64_t splitmix(uint64_t& s) {
  uint64_t z = (s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// Box-Muller pairs in float (the data generator is on the training hot path).
void gaussians(uint64_t state, float* out, int n) {
  for (int i = 0; i < n; i += 2) {
    uint64_t bits = splitmix(state);
    float u1 = (static_cast<float>(bits >> 40) + 0.5f) * (1.0f / 16777216.0f);
    float u2 = static_cast<float>((bits >> 16) & 0xffffffu) * (1.0f / 16777216.0f);
    float r = std::sqrt(-2.0f * std::log(u1));
    float a = 6.2831853f * u2;
    out[i] = r * std::cos(a);
    if (i + 1 < n) out[i + 1] = r * std::sin(a);
  }
}

}  // namespace

SyntheticData::SyntheticData(int inputs, int outputs, uint64_t seed)
    : inputs_(inputs),
      outputs_(outputs),
      seed_(seed),
      gen_(static_cast<size_t>(inputs) * kLatent),
      teacher_(static_cast<size_t>(outputs) * kLatent) {
  gaussians(seed ^ 0x7ea0c4e5ull, gen_.data(), static_cast<int>(gen_.size()));
  gaussians(seed ^ 0x5eedf00dull, teacher_.data(), static_cast<int>(teacher_.size()));
  float s = 1.0f / std::sqrt(static_cast<float>(kLatent));
  for (auto& w : gen_) w *= s;
  for (auto& w : teacher_) w *= s;
}

void SyntheticData::sample(uint64_t index, bool eval, float* x, int* label, float* targets) const {
  uint64_t st = seed_ * 0x100000001b3ull ^ (eval ? 0xe7a1ull << 48 : 0) ^ (index * 0x9e3779b97f4a7c15ull);
  float z[kLatent];
  gaussians(st, z, kLatent);
  gaussians(st ^ 0xa5a5a5a5a5a5a5a5ull, x, inputs_);
  for (int i = 0; i < inputs_; ++i) {
    const float* g = gen_.data() + static_cast<size_t>(i) * kLatent;
    float v = 0;
    for (int j = 0; j < kLatent; ++j) v += g[j] * z[j];
    x[i] = v + kNoise * x[i];
  }
  int best = 0;
  float bestV = -1e30f;
  for (int k = 0; k < outputs_; ++k) {
    const float* w = teacher_.data() + static_cast<size_t>(k) * kLatent;
    float v = 0;
    for (int j = 0; j < kLatent; ++j) v += w[j] * z[j];
    if (targets) targets[k] = v;
    if (v > bestV) {
      bestV = v;
      best = k;
    }
  }
  if (label) *label = best;
}

std::vector<uint64_t> epochOrder(uint64_t n, uint64_t seed, uint64_t epoch) {
  std::vector<uint64_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  uint64_t s = seed * 0x2545f4914f6cdd1dull + epoch * 0x9e3779b97f4a7c15ull + 1;
  for (uint64_t i = n; i > 1; --i) {
    uint64_t j = splitmix(s) % i;
    std::swap(order[i - 1], order[j]);
  }
  return order;
}

}  // namespace dtrain::train
