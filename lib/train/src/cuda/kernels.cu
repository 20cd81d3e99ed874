#include "kernels.h"

#include "cuda_util.h"

namespace dtrain::train::detail::kernels {
namespace {

constexpr int kThreads = 256;
constexpr float kSqrt2OverPi = 0.7978845608028654f;

unsigned gridFor(size_t count) {
  size_t blocks = (count + kThreads - 1) / kThreads;
  // Grid-stride loops cover the rest; 65535 * 4 blocks saturate any current GPU.
  return static_cast<unsigned>(blocks == 0 ? 1 : (blocks > 65535u * 4 ? 65535u * 4 : blocks));
}

__device__ float gelu(float x) { return 0.5f * x * (1.0f + tanhf(kSqrt2OverPi * (x + 0.044715f * x * x * x))); }
__device__ float geluGrad(float x) {
  float u = kSqrt2OverPi * (x + 0.044715f * x * x * x);
  float t = tanhf(u);
  return 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * kSqrt2OverPi * (1.0f + 3 * 0.044715f * x * x);
}

__global__ void fillBiasKernel(float* z, const float* b, size_t count, int out) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<size_t>(gridDim.x) * blockDim.x)
    z[i] = b[i % static_cast<size_t>(out)];
}

__global__ void activationForwardKernel(const float* z, float* a, size_t count, bool useGelu) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<size_t>(gridDim.x) * blockDim.x)
    a[i] = useGelu ? gelu(z[i]) : (z[i] > 0 ? z[i] : 0.0f);
}

__global__ void activationBackwardKernel(const float* z, float* d, size_t count, bool useGelu) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    if (useGelu) d[i] *= geluGrad(z[i]);
    else if (z[i] <= 0) d[i] = 0.0f;
  }
}

// db[k] = the sum over the rows of delta's column k (accumulate: added onto db's value, as the
// pipeline stage's loop over micro-batches). A block takes kBiasCols adjacent columns (a
// warp's loads of one row coalesce) and splits the rows among kBiasGroups row groups (group
// g sums rows g, g + kBiasGroups, ... in order); the groups' sums meet in a tree of fixed
// shape. Fixed order: the same inputs give the same bits every run (the GPU trainer is
// deterministic). It was one thread per column summing every row: 4 blocks for a 1024-wide
// layer, each thread making `n` dependent loads, strided by the layer's width.
constexpr int kBiasCols = kThreads >= 64 ? 32 : kThreads / 4;  // (kThreads / 4: the emulation's 8-thread blocks)
constexpr int kBiasGroups = kThreads / kBiasCols;              // a power of two
static_assert(kBiasCols * kBiasGroups == kThreads && (kBiasGroups & (kBiasGroups - 1)) == 0, "bias grad tiling");

__global__ void biasGradKernel(const float* delta, float* db, int n, int out, bool accumulate) {
  __shared__ float part[kThreads];
  const int c = static_cast<int>(threadIdx.x) % kBiasCols, g = static_cast<int>(threadIdx.x) / kBiasCols;
  // (k0 is the same for the whole block: every thread meets every __syncthreads)
  for (int k0 = static_cast<int>(blockIdx.x) * kBiasCols; k0 < out; k0 += static_cast<int>(gridDim.x) * kBiasCols) {
    const int k = k0 + c;
    float acc = 0.0f;
    if (k < out)
      for (int i = g; i < n; i += kBiasGroups) acc += delta[static_cast<size_t>(i) * out + k];
    part[threadIdx.x] = acc;
    __syncthreads();
    for (int half = kBiasGroups / 2; half > 0; half /= 2) {
      if (g < half) part[threadIdx.x] += part[threadIdx.x + half * kBiasCols];
      __syncthreads();
    }
    if (g == 0 && k < out) db[k] = accumulate ? db[k] + part[threadIdx.x] : part[threadIdx.x];
    __syncthreads();  // (part is the next tile's)
  }
}

// First index of the maximum, as std::max_element.
__device__ int argmaxRow(const float* row, int C) {
  int best = 0;
  for (int k = 1; k < C; ++k)
    if (row[k] > row[best]) best = k;
  return best;
}

// One thread per row (C, the class count, is small).
__global__ void crossEntropyKernel(const float* logits, const float* targets, int n, int C, double* rowLoss,
                                   int* rowCorrect, float* delta, int denom) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    const float* row = logits + static_cast<size_t>(i) * C;
    float* d = delta + static_cast<size_t>(i) * C;
    int best = argmaxRow(row, C);
    int label = static_cast<int>(targets[i]);
    label = label < 0 ? 0 : (label >= C ? C - 1 : label);  // the data sets validate labels; stay in bounds
    float mx = row[best];
    double sum = 0;
    for (int k = 0; k < C; ++k) sum += exp(static_cast<double>(row[k] - mx));
    double logSum = log(sum) + mx;
    rowLoss[i] = logSum - row[label];
    for (int k = 0; k < C; ++k)
      d[k] = static_cast<float>((exp(static_cast<double>(row[k]) - logSum) - (k == label ? 1.0 : 0.0)) / denom);
    rowCorrect[i] = best == label;
  }
}

__global__ void mseKernel(const float* logits, const float* targets, int n, int C, double* rowLoss, int* rowCorrect,
                          float* delta, int denom) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    const float* row = logits + static_cast<size_t>(i) * C;
    const float* t = targets + static_cast<size_t>(i) * C;
    float* d = delta + static_cast<size_t>(i) * C;
    rowCorrect[i] = argmaxRow(row, C) == argmaxRow(t, C);
    double loss = 0;
    for (int k = 0; k < C; ++k) {
      float e = row[k] - t[k];
      loss += 0.5 * e * e;
      d[k] = e / static_cast<float>(denom);
    }
    rowLoss[i] = loss;
  }
}

// Fixed-shape tree reduction of kThreads values in shared memory.
template <typename T>
__device__ T blockSum(T v, T* shared) {
  shared[threadIdx.x] = v;
  __syncthreads();
  for (int stride = kThreads / 2; stride > 0; stride /= 2) {
    if (threadIdx.x < stride) shared[threadIdx.x] += shared[threadIdx.x + stride];
    __syncthreads();
  }
  return shared[0];
}

// One block of kThreads.
__global__ void reduceLossKernel(const double* rowLoss, const int* rowCorrect, int n, double* loss, int* correct) {
  __shared__ double sl[kThreads];
  __shared__ int sc[kThreads];
  double l = 0;
  int c = 0;
  for (int i = threadIdx.x; i < n; i += kThreads) {
    l += rowLoss[i];
    c += rowCorrect[i];
  }
  double tl = blockSum(l, sl);
  int tc = blockSum(c, sc);
  if (threadIdx.x == 0) {
    *loss = n > 0 ? tl / n : 0.0;
    *correct = tc;
  }
}

// kNormPartials blocks of kThreads; each block's sum of squares into partials[block].
__global__ void sumSquaresKernel(const float* g, size_t count, double* partials) {
  __shared__ double s[kThreads];
  double acc = 0;
  for (size_t i = blockIdx.x * static_cast<size_t>(kThreads) + threadIdx.x; i < count;
       i += static_cast<size_t>(kNormPartials) * kThreads)
    acc += static_cast<double>(g[i]) * g[i];
  double t = blockSum(acc, s);
  if (threadIdx.x == 0) partials[blockIdx.x] = t;
}

__global__ void finishNormKernel(const double* partials, double* norm) {
  __shared__ double s[kThreads];
  double acc = 0;
  for (int i = threadIdx.x; i < kNormPartials; i += kThreads) acc += partials[i];
  double t = blockSum(acc, s);
  if (threadIdx.x == 0) *norm = sqrt(t);
}

__global__ void clipKernel(float* g, size_t count, const double* normPtr, double maxNorm) {
  const double norm = *normPtr;
  if (!(norm > maxNorm)) return;
  const float scale = static_cast<float>(maxNorm / (norm + 1e-6));
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<size_t>(gridDim.x) * blockDim.x)
    g[i] *= scale;
}

__global__ void sgdKernel(float* params, const float* grads, float* momentum, size_t count, SgdParams p) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    float g = grads[i] + p.weight_decay * params[i];
    if (p.momentum > 0) {
      momentum[i] = p.momentum * momentum[i] + g;
      g = p.nesterov ? g + p.momentum * momentum[i] : momentum[i];
    }
    params[i] -= p.lr * g;
  }
}

__global__ void adamwKernel(float* params, const float* grads, float* m, float* v, size_t count, AdamWParams p) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    float w = params[i];
    const float g = grads[i];
    w -= p.lr * p.weight_decay * w;
    const float mi = p.beta1 * m[i] + (1 - p.beta1) * g;
    const float vi = p.beta2 * v[i] + (1 - p.beta2) * g * g;
    m[i] = mi;
    v[i] = vi;
    w -= p.lr * (mi / p.c1) / (sqrtf(vi) / p.c2 + p.eps);
    params[i] = w;
  }
}

}  // namespace

void fillBias(float* z, const float* b, int n, int out, cudaStream_t s) {
  size_t count = static_cast<size_t>(n) * out;
  if (count == 0) return;
  fillBiasKernel<<<gridFor(count), kThreads, 0, s>>>(z, b, count, out);
  checkLaunch("fillBias");
}

void activationForward(const float* z, float* a, size_t count, bool useGelu, cudaStream_t s) {
  if (count == 0) return;
  activationForwardKernel<<<gridFor(count), kThreads, 0, s>>>(z, a, count, useGelu);
  checkLaunch("activationForward");
}

void activationBackward(const float* z, float* d, size_t count, bool useGelu, cudaStream_t s) {
  if (count == 0) return;
  activationBackwardKernel<<<gridFor(count), kThreads, 0, s>>>(z, d, count, useGelu);
  checkLaunch("activationBackward");
}

void biasGrad(const float* delta, float* db, int n, int out, cudaStream_t s, bool accumulate) {
  if (out == 0) return;
  biasGradKernel<<<gridFor((static_cast<size_t>(out) + kBiasCols - 1) / kBiasCols * kThreads), kThreads, 0, s>>>(
      delta, db, n, out, accumulate);
  checkLaunch("biasGrad");
}

void crossEntropy(const float* logits, const float* targets, int n, int C, double* rowLoss, int* rowCorrect,
                  float* delta, cudaStream_t s, int denom) {
  if (n == 0) return;
  crossEntropyKernel<<<gridFor(static_cast<size_t>(n)), kThreads, 0, s>>>(logits, targets, n, C, rowLoss, rowCorrect,
                                                                           delta, denom > 0 ? denom : n);
  checkLaunch("crossEntropy");
}

void mse(const float* logits, const float* targets, int n, int C, double* rowLoss, int* rowCorrect, float* delta,
         cudaStream_t s, int denom) {
  if (n == 0) return;
  mseKernel<<<gridFor(static_cast<size_t>(n)), kThreads, 0, s>>>(logits, targets, n, C, rowLoss, rowCorrect, delta,
                                                                  denom > 0 ? denom : n);
  checkLaunch("mse");
}

void reduceLoss(const double* rowLoss, const int* rowCorrect, int n, double* loss, int* correct, cudaStream_t s) {
  reduceLossKernel<<<1, kThreads, 0, s>>>(rowLoss, rowCorrect, n, loss, correct);
  checkLaunch("reduceLoss");
}

void l2Norm(const float* g, size_t count, double* partials, double* norm, cudaStream_t s) {
  sumSquaresKernel<<<kNormPartials, kThreads, 0, s>>>(g, count, partials);
  checkLaunch("sumSquares");
  finishNormKernel<<<1, kThreads, 0, s>>>(partials, norm);
  checkLaunch("finishNorm");
}

void clipByNorm(float* g, size_t count, const double* norm, double maxNorm, cudaStream_t s) {
  if (count == 0) return;
  clipKernel<<<gridFor(count), kThreads, 0, s>>>(g, count, norm, maxNorm);
  checkLaunch("clipByNorm");
}

void sgd(float* params, const float* grads, float* momentum, size_t count, const SgdParams& p, cudaStream_t s) {
  if (count == 0) return;
  sgdKernel<<<gridFor(count), kThreads, 0, s>>>(params, grads, momentum, count, p);
  checkLaunch("sgd");
}

void adamw(float* params, const float* grads, float* m, float* v, size_t count, const AdamWParams& p, cudaStream_t s) {
  if (count == 0) return;
  adamwKernel<<<gridFor(count), kThreads, 0, s>>>(params, grads, m, v, count, p);
  checkLaunch("adamw");
}

}  // namespace dtrain::train::detail::kernels
