#include "blas.h"

#include <dlfcn.h>

#include <algorithm>
#include <cstdlib>
#include <string>

#include <fmt/format.h>

#include "dtrain/common/dynlib.h"
#include "dtrain/common/errors.h"
#include "dtrain/common/system_cpus.h"
#include "dtrain/train/device.h"

namespace dtrain::train::detail {
namespace {

using SgemmFn = decltype(&cblas_sgemm);
using GetThreadsFn = int (*)();
using SetThreadsFn = void (*)(int);

struct Blas {
  SgemmFn sgemm = nullptr;
  GetThreadsFn threads = nullptr;  // (absent from a BLAS other than OpenBLAS)
};

Blas resolve() {
  // The runtime library's soname first (libopenblas0 alone, no -dev package, provides it),
  // then the library the build found.
  std::string errors;
  void* h = openLibrary({"libopenblas.so.0", DTRAIN_BLAS_LIBRARY}, "cblas_sgemm", &errors);
  if (!h)
    throw IoError(fmt::format("the CPU trainer needs OpenBLAS and could not load it ({}); install libopenblas0 "
                              "(scripts/setup.sh does)", errors));
  Blas b;
  b.sgemm = reinterpret_cast<SgemmFn>(::dlsym(h, "cblas_sgemm"));
  b.threads = reinterpret_cast<GetThreadsFn>(::dlsym(h, "openblas_get_num_threads"));
  if (!std::getenv("OPENBLAS_NUM_THREADS") && !std::getenv("GOTO_NUM_THREADS") && !std::getenv("OMP_NUM_THREADS")) {
    const CpuAvailability cpus = cpuAvailability();
    if (cpus.quotaBinds())
      if (auto set = reinterpret_cast<SetThreadsFn>(::dlsym(h, "openblas_set_num_threads")))
        set(std::max(1, cpus.usable / std::max(1, localWorldSizeFromEnv(1))));
  }
  return b;
}

const Blas& blas() {
  static const Blas b = resolve();
  return b;
}

}  // namespace

void sgemm(CBLAS_ORDER order, CBLAS_TRANSPOSE transA, CBLAS_TRANSPOSE transB, int m, int n, int k, float alpha,
           const float* a, int lda, const float* b, int ldb, float beta, float* c, int ldc) {
  blas().sgemm(order, transA, transB, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

int blasThreads() { return blas().threads ? blas().threads() : 0; }

std::string cpuMathDescription() {
  const int n = blasThreads();
  return n > 0 ? fmt::format("cpu (OpenBLAS, {} thread{})", n, n == 1 ? "" : "s") : std::string("cpu");
}

}  // namespace dtrain::train::detail
