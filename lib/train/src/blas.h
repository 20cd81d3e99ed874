#pragma once
// The CPU GEMM: cblas_sgemm from OpenBLAS, loaded on first use (dlopen) instead of linked.
// OpenBLAS starts a thread pool (a thread per core) when it is loaded; linked, every dtrain
// process paid for it, though only CPU trainer workers multiply matrices: the launcher, each
// node's agent, the `dtrain --version` pre-flight over ssh, bench and store commands, GPU
// workers (measured: ~4.5 ms of start-up per process, plus the idle threads).
// Thread-safe (the first call resolves the symbol under the static-initialisation guard).
#include <cblas.h>

#include <string>

namespace dtrain::train::detail {

// Same arguments and semantics as cblas_sgemm. Throws IoError, naming the fix, when OpenBLAS
// cannot be loaded.
void sgemm(CBLAS_ORDER order, CBLAS_TRANSPOSE transA, CBLAS_TRANSPOSE transB, int m, int n, int k, float alpha,
           const float* a, int lda, const float* b, int ldb, float beta, float* c, int ldc);

// The threads OpenBLAS computes a GEMM on (loads it, as sgemm does). With no
// OPENBLAS_NUM_THREADS, GOTO_NUM_THREADS or OMP_NUM_THREADS set, and a cgroup CPU quota below
// the affinity mask, the load caps them at this worker's share of the quota (its whole CPUs
// / LOCAL_WORLD_SIZE): OpenBLAS would start one per host CPU, and the quota throttles them
// all (`dtrain run` sets OMP_NUM_THREADS for that; this is for `dtrain train` by hand).
int blasThreads();

// "cpu (OpenBLAS, N threads)": the CPU math's description for the trainers' start line.
std::string cpuMathDescription();

}  // namespace dtrain::train::detail
