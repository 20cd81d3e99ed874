#pragma once
#include "cuda_runtime.h"
enum cublasStatus_t { CUBLAS_STATUS_SUCCESS = 0, CUBLAS_STATUS_INVALID_VALUE = 7 };
enum cublasOperation_t { CUBLAS_OP_N = 0, CUBLAS_OP_T = 1 };
enum cublasMath_t { CUBLAS_DEFAULT_MATH = 0 };
struct cublasContext { cudaStream_t s; };
typedef cublasContext* cublasHandle_t;
inline cublasStatus_t cublasCreate(cublasHandle_t* h) { *h = new cublasContext{nullptr}; return CUBLAS_STATUS_SUCCESS; }
inline cublasStatus_t cublasDestroy(cublasHandle_t h) { delete h; return CUBLAS_STATUS_SUCCESS; }
inline cublasStatus_t cublasSetStream(cublasHandle_t h, cudaStream_t s) { h->s = s; return CUBLAS_STATUS_SUCCESS; }
inline cublasStatus_t cublasSetMathMode(cublasHandle_t, cublasMath_t) { return CUBLAS_STATUS_SUCCESS; }
inline const char* cublasGetStatusString(cublasStatus_t) { return "emulated error"; }
inline const char* cublasGetStatusName(cublasStatus_t) { return "CUBLAS_STATUS_EMU"; }
// Column-major reference SGEMM with cuBLAS's argument checks (naive, so ASan sees every access).
inline cublasStatus_t cublasSgemm(cublasHandle_t, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k,
                                  const float* alpha, const float* A, int lda, const float* B, int ldb, const float* beta,
                                  float* C, int ldc) {
  if (m < 0 || n < 0 || k < 0) return CUBLAS_STATUS_INVALID_VALUE;
  if (lda < (ta == CUBLAS_OP_N ? (m > 1 ? m : 1) : (k > 1 ? k : 1))) return CUBLAS_STATUS_INVALID_VALUE;
  if (ldb < (tb == CUBLAS_OP_N ? (k > 1 ? k : 1) : (n > 1 ? n : 1))) return CUBLAS_STATUS_INVALID_VALUE;
  if (ldc < (m > 1 ? m : 1)) return CUBLAS_STATUS_INVALID_VALUE;
  for (int j = 0; j < n; ++j)
    for (int i = 0; i < m; ++i) {
      float acc = 0;
      for (int p = 0; p < k; ++p) {
        float a = ta == CUBLAS_OP_N ? A[i + static_cast<size_t>(p) * lda] : A[p + static_cast<size_t>(i) * lda];
        float b = tb == CUBLAS_OP_N ? B[p + static_cast<size_t>(j) * ldb] : B[j + static_cast<size_t>(p) * ldb];
        acc += a * b;
      }
      float& c = C[i + static_cast<size_t>(j) * ldc];
      c = *alpha * acc + (*beta == 0 ? 0.0f : *beta * c);
    }
  return CUBLAS_STATUS_SUCCESS;
}
