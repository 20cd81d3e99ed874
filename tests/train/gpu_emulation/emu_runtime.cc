// Runtime of the GPU emulation (run.sh): device memory, the thread pool that runs kernel
// blocks, and an "nccl" communicator that is TCP underneath.
#include <barrier>
#include <cstdlib>
#include <mutex>
#include <thread>
#include <vector>
#include "emu.h"
#include "dtrain/comm/communicator.h"
#include "dtrain/common/errors.h"

EmuDim blockIdx, blockDim, gridDim;
thread_local EmuDim threadIdx;
int emuDeviceCount() { const char* e = std::getenv("EMU_GPUS"); return e ? std::atoi(e) : 1; }
size_t emuDeviceBytes() {
  const char* e = std::getenv("EMU_DEVICE_BYTES");
  return e ? std::strtoull(e, nullptr, 10) : size_t{16} << 30;
}
void* emuAlloc(size_t bytes) { return std::malloc(bytes ? bytes : 1); }
void emuFree(void* p) { std::free(p); }

namespace {
constexpr int K = 8;
struct Pool {
  std::barrier<> start{K + 1}, end{K + 1}, sync{K};
  const std::function<void()>* job = nullptr;
  bool quit = false;
  std::vector<std::thread> ts;
  Pool() {
    for (int t = 0; t < K; ++t)
      ts.emplace_back([this, t] {
        threadIdx.x = static_cast<unsigned>(t);
        for (;;) {
          start.arrive_and_wait();
          if (quit) return;
          (*job)();
          end.arrive_and_wait();
        }
      });
  }
  ~Pool() { quit = true; start.arrive_and_wait(); for (auto& t : ts) t.join(); }
};
Pool& pool() { static Pool p; return p; }
std::mutex mu;
}  // namespace

void __syncthreads() { pool().sync.arrive_and_wait(); }

void emuLaunch(unsigned grid, unsigned block, const std::function<void()>& body) {
  if (block != K) std::abort();
  std::lock_guard<std::mutex> l(mu);
  auto& p = pool();
  gridDim.x = grid;
  blockDim.x = block;
  p.job = &body;
  for (unsigned b = 0; b < grid; ++b) {
    blockIdx.x = b;
    p.start.arrive_and_wait();
    p.end.arrive_and_wait();
  }
}

namespace dtrain::comm {
namespace {
// TCP underneath (emulated device memory is host memory), "nccl" to the trainer.
class FakeNccl final : public Communicator {
 public:
  explicit FakeNccl(std::unique_ptr<Communicator> c) : c_(std::move(c)) {}
  int rank() const override { return c_->rank(); }
  int size() const override { return c_->size(); }
  const char* backend() const override { return "nccl"; }
  WorkPtr allreduceAsync(void* d, size_t n, DataType t, ReduceOp op) override { return c_->allreduceAsync(d, n, t, op); }
  WorkPtr broadcastAsync(void* d, size_t n, DataType t, int r) override { return c_->broadcastAsync(d, n, t, r); }
  WorkPtr allgatherAsync(const void* s, void* r, size_t n, DataType t) override { return c_->allgatherAsync(s, r, n, t); }
  WorkPtr reduceScatterAsync(const void* s, void* r, size_t n, DataType t, ReduceOp op) override { return c_->reduceScatterAsync(s, r, n, t, op); }
  WorkPtr barrierAsync() override { return c_->barrierAsync(); }
  WorkPtr sendAsync(const void* d, size_t b, int p) override { return c_->sendAsync(d, b, p); }
  WorkPtr recvAsync(void* d, size_t b, int p) override { return c_->recvAsync(d, b, p); }
  WorkPtr sendRecvAsync(const void* sd, size_t sb, int sp, void* rd, size_t rb, int rp) override {
    return c_->sendRecvAsync(sd, sb, sp, rd, rb, rp);
  }
  std::unique_ptr<Communicator> group(const std::vector<int>& ranks, const std::string& name) override {
    return std::make_unique<FakeNccl>(c_->group(ranks, name));
  }
 private:
  std::unique_ptr<Communicator> c_;
};
}  // namespace
std::unique_ptr<Communicator> createNcclCommunicator(std::shared_ptr<store::Store> store, int rank, int size, const CommOptions& opts) {
  if (emuDeviceCount() == 0) throw SpecError("backend \"nccl\": no CUDA device is visible");
  return std::make_unique<FakeNccl>(createTcpCommunicator(std::move(store), rank, size, opts));
}
}  // namespace dtrain::comm
