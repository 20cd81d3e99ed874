// NCCL backend tests: built only in CUDA builds, skipped without a visible device.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

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
        auto c = createNcclCommunicator(store, r, n, {});
        for (size_t count : {size_t{1}, size_t{1000}, size_t{1} << 22}) {
          std::vector<float> host(count, static_cast<float>(r + 1));
          float* dev = nullptr;
          cudaMalloc(&dev, count * sizeof(float));
          cudaMemcpy(dev, host.data(), count * sizeof(float), cudaMemcpyHostToDevice);
          c->allreduce(dev, count, DataType::kFloat32, ReduceOp::kSum);
          cudaMemcpy(host.data(), dev, count * sizeof(float), cudaMemcpyDeviceToHost);
          for (float v : host)
            if (v != static_cast<float>(n * (n + 1) / 2)) throw std::runtime_error("wrong float sum");
          std::vector<int64_t> hi(count, r);
          int64_t* di = nullptr;
          cudaMalloc(&di, count * sizeof(int64_t));
          cudaMemcpy(di, hi.data(), count * sizeof(int64_t), cudaMemcpyHostToDevice);
          c->allreduce(di, count, DataType::kInt64, ReduceOp::kMax);
          cudaMemcpy(hi.data(), di, count * sizeof(int64_t), cudaMemcpyDeviceToHost);
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

}  // namespace
}  // namespace dtrain::comm
