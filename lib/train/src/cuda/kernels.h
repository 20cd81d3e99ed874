#pragma once
// Launchers of the GPU trainer's kernels. Each enqueues on `s` and returns at once; the
// formulas mirror the CPU path (mlp.cc, backend.cc) operation for operation, so results
// agree within float rounding. Every reduction runs in a fixed order (no atomics), so
// replicas with identical inputs compute bit-identical results.
#include <cuda_runtime.h>

#include <cstddef>

#include "dtrain/train/backend.h"

namespace dtrain::train::detail::kernels {

// Blocks of the first pass of sumSquares.
inline constexpr int kNormPartials = 256;

// z[i][k] = b[k] for the n x out matrix z (the GEMM then accumulates into it).
void fillBias(float* z, const float* b, int n, int out, cudaStream_t s);
// a = relu(z) or gelu(z) (tanh approximation), count elements.
void activationForward(const float* z, float* a, size_t count, bool gelu, cudaStream_t s);
// d *= relu'(z) or gelu'(z), in place.
void activationBackward(const float* z, float* d, size_t count, bool gelu, cudaStream_t s);
// db[k] = sum over rows i of delta[i][k], rows summed in order (accumulate: db[k] += each
// row in order, the pipeline stage's accumulation over micro-batches).
void biasGrad(const float* delta, float* db, int n, int out, cudaStream_t s, bool accumulate = false);

// Per row of logits [n x C]: rowLoss, rowCorrect, and delta = dLoss/dlogits of the loss
// summed over the rows and divided by denom (0: n, the mean). Cross-entropy: targets are n
// class indices (as floats). MSE: targets [n x C], the loss 0.5 * squared error, correct =
// argmax matches the target's argmax.
void crossEntropy(const float* logits, const float* targets, int n, int C, double* rowLoss, int* rowCorrect,
                  float* delta, cudaStream_t s, int denom = 0);
void mse(const float* logits, const float* targets, int n, int C, double* rowLoss, int* rowCorrect, float* delta,
         cudaStream_t s, int denom = 0);
// *loss = sum(rowLoss) / n, *correct = sum(rowCorrect).
void reduceLoss(const double* rowLoss, const int* rowCorrect, int n, double* loss, int* correct, cudaStream_t s);

// *norm = sqrt(sum of g^2) in double; partials holds kNormPartials doubles.
void l2Norm(const float* g, size_t count, double* partials, double* norm, cudaStream_t s);
// g *= maxNorm / (*norm + 1e-6) when *norm > maxNorm (decided on the device: no host sync).
void clipByNorm(float* g, size_t count, const double* norm, double maxNorm, cudaStream_t s);

void sgd(float* params, const float* grads, float* momentum, size_t count, const SgdParams& p, cudaStream_t s);
// m and v: the first and second moments.
void adamw(float* params, const float* grads, float* m, float* v, size_t count, const AdamWParams& p, cudaStream_t s);

}  // namespace dtrain::train::detail::kernels
