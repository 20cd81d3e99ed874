// NCCL backend tests: built only in CUDA builds, skipped without a visible device.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <chrono>
#include <thread>

#include "dtrain/comm/communicator.h"
#include "dtrain/common/errors.h"
#include "dtrain/store/hash_store.h"

namespace dtrain::comm {
std::unique_ptr<Communicator> createNcclCommunicator(std::shared_ptr<store::Store> store, int rank, int size,
                                                     const CommOptions& opts);
namespace {

int devices() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
}

// A CUDA call of the test itself that must work.
void ok(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}

// Well under gpu_check.sh's step limit: a hang fails this test, not the whole check's budget.
CommOptions shortTimeout(std::chrono::seconds s = std::chrono::seconds(60)) {
  CommOptions o;
  o.timeout = s;
  return o;
}

TEST(NcclComm, NoDeviceIsAClearError) {
  if (devices() > 0) GTEST_SKIP() << "a GPU is visible";
  auto store = std::make_shared<store::HashStore>();
  try {
    createNcclCommunicator(store, 0, 1, {});
    FAIL();
  } catch (const SpecError& e) {
    EXPECT_NE(std::string(e.what()).find("no CUDA device is visible"), std::string::npos) << e.what();
  }
}

// One rank per visible device (up to 4), each in its own thread.
TEST(NcclComm, AllreduceAcrossDtypesAndSizes) {
  int n = std::min(devices(), 4);
  if (n == 0) GTEST_SKIP() << "no CUDA device";
  auto store = std::make_shared<store::HashStore>();
  std::vector<std::thread> ts;
  std::vector<std::string> errors(static_cast<size_t>(n));
  // Rank r on GPU r: without LOCAL_RANK the communicator takes its rank's device (LOCAL_RANK=0
  // put every rank on GPU 0, which NCCL refuses with two or more: "duplicate GPU").
  ::unsetenv("LOCAL_RANK");
  for (int r = 0; r < n; ++r)
    ts.emplace_back([&, r] {
      try {
        cudaSetDevice(r);
        auto c = createNcclCommunicator(store, r, n, shortTimeout());
        for (size_t count : {size_t{1}, size_t{1000}, size_t{1} << 22}) {
          std::vector<float> host(count, static_cast<float>(r + 1));
          float* dev = nullptr;
          ok(cudaMalloc(&dev, count * sizeof(float)), "cudaMalloc");
          ok(cudaMemcpy(dev, host.data(), count * sizeof(float), cudaMemcpyHostToDevice), "cudaMemcpy");
          // (a pageable cudaMemcpy may return before the data is on the device, and the
          // collectives' stream is not ordered after the legacy stream it used)
          ok(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
          c->allreduce(dev, count, DataType::kFloat32, ReduceOp::kSum);
          ok(cudaMemcpy(host.data(), dev, count * sizeof(float), cudaMemcpyDeviceToHost), "cudaMemcpy");
          for (float v : host)
            if (v != static_cast<float>(n * (n + 1) / 2)) throw std::runtime_error("wrong float sum");
          std::vector<int64_t> hi(count, r);
          int64_t* di = nullptr;
          ok(cudaMalloc(&di, count * sizeof(int64_t)), "cudaMalloc");
          ok(cudaMemcpy(di, hi.data(), count * sizeof(int64_t), cudaMemcpyHostToDevice), "cudaMemcpy");
          ok(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
          c->allreduce(di, count, DataType::kInt64, ReduceOp::kMax);
          ok(cudaMemcpy(hi.data(), di, count * sizeof(int64_t), cudaMemcpyDeviceToHost), "cudaMemcpy");
          for (auto v : hi)
            if (v != n - 1) throw std::runtime_error("wrong int64 max");
          cudaFree(dev);
          cudaFree(di);
        }
        c->barrier();
      } catch (const std::exception& e) {
        errors[static_cast<size_t>(r)] = e.what();
      }
    });
  for (auto& t : ts) t.join();
  for (const auto& e : errors) EXPECT_EQ(e, "");
}

// Real NCCL, real driver: a communicator whose peer never comes fails its creation within the
// timeout (the non-blocking ncclCommInitRankConfig polled, then ncclCommAbort on a
// communicator still initialising), and the process goes on. The emulation checks the
// logic; only a device shows that NCCL lets the abort end it.
TEST(NcclComm, MissingPeerFailsInit) {
  if (devices() == 0) GTEST_SKIP() << "no CUDA device";
  ::unsetenv("LOCAL_RANK");
  auto store = std::make_shared<store::HashStore>();
  const auto t0 = std::chrono::steady_clock::now();
  try {
    createNcclCommunicator(store, 0, 2, shortTimeout(std::chrono::seconds(5)));
    FAIL() << "rank 1 never came, and creation succeeded";
  } catch (const PeerLostError& e) {
    EXPECT_NE(std::string(e.what()).find("ncclCommInitRank on rank 0"), std::string::npos) << e.what();
  }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LT(s, 20.0) << "the 5 s timeout took " << s << " s";
  // The device is still usable after the abort.
  int* p = nullptr;
  EXPECT_EQ(cudaMalloc(&p, 4), cudaSuccess);
  cudaFree(p);
}

}  // namespace
}  // namespace dtrain::comm
