#include "blas.h"

#include <dlfcn.h>

#include <string>

#include <fmt/format.h>

#include "dtrain/common/dynlib.h"
#include "dtrain/common/errors.h"

namespace dtrain::train::detail {
namespace {

using SgemmFn = decltype(&cblas_sgemm);

SgemmFn resolve() {
  // The runtime library's soname first (libopenblas0 alone, no -dev package, provides it),
  // then the library the build found.
  std::string errors;
  if (void* h = openLibrary({"libopenblas.so.0", DTRAIN_BLAS_LIBRARY}, "cblas_sgemm", &errors))
    return reinterpret_cast<SgemmFn>(::dlsym(h, "cblas_sgemm"));
  throw IoError(fmt::format("the CPU trainer needs OpenBLAS and could not load it ({}); install libopenblas0 "
                            "(scripts/setup.sh does)", errors));
}

}  // namespace

void sgemm(CBLAS_ORDER order, CBLAS_TRANSPOSE transA, CBLAS_TRANSPOSE transB, int m, int n, int k, float alpha,
           const float* a, int lda, const float* b, int ldb, float beta, float* c, int ldc) {
  static const SgemmFn fn = resolve();
  fn(order, transA, transB, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

}  // namespace dtrain::train::detail
