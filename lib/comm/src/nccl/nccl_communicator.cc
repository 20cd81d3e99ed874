// NCCL backend (CUDA builds only; a plugin loaded on first use, see the end of this file). Buffers are device pointers. Collectives run on one
// dedicated stream; each returns a Work whose wait() polls its CUDA event together with
// ncclCommGetAsyncError, and aborts the communicator when the operation outlives the
// timeout, so a lost peer becomes a PeerLostError instead of a hang.
#include <cuda_runtime.h>
#include <nccl.h>

#include <cstdlib>
#include <cstring>
#include <mutex>
#include <thread>

#include <fmt/format.h>

#include "dtrain/comm/communicator.h"
#include "dtrain/common/errors.h"

namespace dtrain::comm {
namespace {

using Clock = std::chrono::steady_clock;

void cudaCheck(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw IoError(fmt::format("{}: CUDA error: {}", what, cudaGetErrorString(e)));
}

void ncclCheck(ncclResult_t r, const char* what) {
  if (r != ncclSuccess) throw PeerLostError(fmt::format("{}: NCCL error: {}", what, ncclGetErrorString(r)));
}

ncclDataType_t ncclType(DataType t) {
  switch (t) {
    case DataType::kFloat32: return ncclFloat32;
    case DataType::kFloat64: return ncclFloat64;
    case DataType::kInt32: return ncclInt32;
    case DataType::kInt64: return ncclInt64;
    case DataType::kFloat16: return ncclFloat16;
    case DataType::kBFloat16: return ncclBfloat16;
  }
  return ncclFloat32;
}

ncclRedOp_t ncclOp(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return ncclSum;
    case ReduceOp::kAvg: return ncclAvg;
    case ReduceOp::kMin: return ncclMin;
    case ReduceOp::kMax: return ncclMax;
  }
  return ncclSum;
}

// Owns the communicator, stream and a scratch device int for barriers. Not copyable.
struct NcclState {
  ncclComm_t comm = nullptr;
  cudaStream_t stream = nullptr;
  int* barrierBuf = nullptr;
  int device = 0;
  std::mutex mu;          // serialises enqueueing, so every rank's order is the issue order
  bool aborted = false;
  std::string failure;
  ~NcclState() {
    if (comm) aborted ? (void)0 : (void)ncclCommDestroy(comm);
    if (barrierBuf) cudaFree(barrierBuf);
    if (stream) cudaStreamDestroy(stream);
  }
};

class NcclWork final : public Work {
 public:
  NcclWork(std::shared_ptr<NcclState> st, cudaEvent_t ev, std::string op, Duration timeout, int rank, int size)
      : st_(std::move(st)), ev_(ev), op_(std::move(op)), deadline_(Clock::now() + timeout), timeout_(timeout),
        rank_(rank), size_(size) {}
  ~NcclWork() override { cudaEventDestroy(ev_); }
  NcclWork(const NcclWork&) = delete;
  NcclWork& operator=(const NcclWork&) = delete;

  bool test() override {
    if (done_) return true;
    cudaError_t e = cudaEventQuery(ev_);
    if (e == cudaSuccess) done_ = true;
    return done_ || e != cudaErrorNotReady;
  }

  void wait() override {
    while (!done_) {
      cudaError_t e = cudaEventQuery(ev_);
      if (e == cudaSuccess) {
        done_ = true;
        break;
      }
      if (e != cudaErrorNotReady) cudaCheck(e, op_.c_str());
      ncclResult_t async = ncclSuccess;
      ncclCommGetAsyncError(st_->comm, &async);
      if (async != ncclSuccess) abort(fmt::format("NCCL reported: {}", ncclGetErrorString(async)));
      if (Clock::now() > deadline_)
        abort(fmt::format("did not finish within {:.3g} s; a peer among ranks 0..{} is lost or stopped",
                          timeout_.count() / 1000.0, size_ - 1));
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }

 private:
  [[noreturn]] void abort(const std::string& why) {
    std::lock_guard<std::mutex> l(st_->mu);
    if (!st_->aborted) {
      ncclCommAbort(st_->comm);
      st_->aborted = true;
      st_->failure = why;
    }
    throw PeerLostError(fmt::format("{} on rank {}: {}; the NCCL communicator was aborted", op_, rank_, why));
  }

  std::shared_ptr<NcclState> st_;
  cudaEvent_t ev_;
  std::string op_;
  Clock::time_point deadline_;
  Duration timeout_;
  int rank_, size_;
  bool done_ = false;
};

class NcclCommunicator final : public Communicator {
 public:
  // device: the GPU to use; -1 picks LOCAL_RANK's (else the rank's) among the visible ones. A
  // group passes its parent's: its group rank says nothing about the GPU its buffers are on.
  NcclCommunicator(std::shared_ptr<store::Store> store, int rank, int size, const CommOptions& opts, int device = -1)
      : store_(store), rank_(rank), size_(size), opts_(opts), st_(std::make_shared<NcclState>()) {
    int count = 0;
    cudaError_t e = cudaGetDeviceCount(&count);
    if (e != cudaSuccess || count == 0)
      throw SpecError(fmt::format("backend \"nccl\": no CUDA device is visible ({}); use backend \"tcp\" on this machine",
                                  e == cudaSuccess ? "0 devices" : cudaGetErrorString(e)));
    const char* lr = std::getenv("LOCAL_RANK");
    st_->device = device >= 0 ? device : (lr ? std::atoi(lr) : rank) % count;
    cudaCheck(cudaSetDevice(st_->device), "cudaSetDevice");
    cudaCheck(cudaStreamCreateWithFlags(&st_->stream, cudaStreamNonBlocking), "cudaStreamCreate");
    cudaCheck(cudaMalloc(&st_->barrierBuf, sizeof(int)), "cudaMalloc");
    ncclUniqueId id;
    std::string key = "comm/" + opts.name + "/nccl_id";
    if (rank == 0) {
      ncclCheck(ncclGetUniqueId(&id), "ncclGetUniqueId");
      store->set(key, std::string(reinterpret_cast<const char*>(&id), sizeof(id)));
    } else {
      std::string v = store->get(key);
      if (v.size() != sizeof(id)) throw PeerLostError("nccl: rank 0 published a malformed ncclUniqueId");
      std::memcpy(&id, v.data(), sizeof(id));
    }
    ncclCheck(ncclCommInitRank(&st_->comm, size, id, rank), "ncclCommInitRank");
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const char* backend() const override { return "nccl"; }

  WorkPtr allreduceAsync(void* data, size_t count, DataType t, ReduceOp op) override {
    return launch("allreduce", [&] { return ncclAllReduce(data, data, count, ncclType(t), ncclOp(op), st_->comm, st_->stream); });
  }
  WorkPtr broadcastAsync(void* data, size_t count, DataType t, int root) override {
    return launch("broadcast", [&] { return ncclBroadcast(data, data, count, ncclType(t), root, st_->comm, st_->stream); });
  }
  WorkPtr allgatherAsync(const void* send, void* recv, size_t count, DataType t) override {
    return launch("allgather", [&] { return ncclAllGather(send, recv, count, ncclType(t), st_->comm, st_->stream); });
  }
  WorkPtr reduceScatterAsync(const void* send, void* recv, size_t recvCount, DataType t, ReduceOp op) override {
    return launch("reduce_scatter",
                  [&] { return ncclReduceScatter(send, recv, recvCount, ncclType(t), ncclOp(op), st_->comm, st_->stream); });
  }
  WorkPtr barrierAsync() override {
    return launch("barrier", [&] { return ncclAllReduce(st_->barrierBuf, st_->barrierBuf, 1, ncclInt32, ncclSum, st_->comm, st_->stream); });
  }
  WorkPtr sendAsync(const void* data, size_t bytes, int peer) override {
    return launch("send", [&] { return ncclSend(data, bytes, ncclInt8, peer, st_->comm, st_->stream); });
  }
  WorkPtr recvAsync(void* data, size_t bytes, int peer) override {
    return launch("recv", [&] { return ncclRecv(data, bytes, ncclInt8, peer, st_->comm, st_->stream); });
  }
  WorkPtr sendRecvAsync(const void* sendData, size_t sendBytes, int sendPeer, void* recvData, size_t recvBytes,
                        int recvPeer) override {
    return launch("sendrecv", [&] {
      // Grouped so NCCL runs both at once (no ordering deadlock between neighbours).
      ncclResult_t r = ncclGroupStart();
      if (r != ncclSuccess) return r;
      ncclResult_t s = ncclSend(sendData, sendBytes, ncclInt8, sendPeer, st_->comm, st_->stream);
      ncclResult_t v = s == ncclSuccess ? ncclRecv(recvData, recvBytes, ncclInt8, recvPeer, st_->comm, st_->stream) : s;
      r = ncclGroupEnd();
      return v != ncclSuccess ? v : r;
    });
  }
  // A new NCCL communicator over the group, its unique id through the store under the
  // group's name (ncclCommSplit would need every rank of this communicator to call it).
  std::unique_ptr<Communicator> group(const std::vector<int>& ranks, const std::string& name) override {
    const int r = groupRank(ranks, rank_, size_, name);
    CommOptions o = opts_;
    o.name = opts_.name + "/" + name;
    return std::make_unique<NcclCommunicator>(store_, r, static_cast<int>(ranks.size()), o, st_->device);
  }

 private:
  template <typename F>
  WorkPtr launch(const char* op, F&& enqueue) {
    std::lock_guard<std::mutex> l(st_->mu);
    if (st_->aborted) throw PeerLostError(fmt::format("{}: the NCCL communicator was aborted earlier: {}", op, st_->failure));
    cudaCheck(cudaSetDevice(st_->device), "cudaSetDevice");
    ncclCheck(enqueue(), op);
    cudaEvent_t ev;
    cudaCheck(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), "cudaEventCreate");
    cudaCheck(cudaEventRecord(ev, st_->stream), "cudaEventRecord");
    return std::make_shared<NcclWork>(st_, ev, op, opts_.timeout, rank_, size_);
  }

  std::shared_ptr<store::Store> store_;
  int rank_, size_;
  CommOptions opts_;
  std::shared_ptr<NcclState> st_;
};

}  // namespace

// Built into libdtrain_comm_nccl.so, which dtrain loads only when an NCCL communicator is
// made (factory.cc): linking NCCL and cudart cost every dtrain process (launcher, agents,
// CPU workers) ~3 ms of start-up and tied a CUDA build to hosts that have them. A distinct
// name: the executable's createNcclCommunicator (the loader) must not interpose it.
// Exceptions cross the boundary (same compiler and C++ runtime); dtrain's own symbols
// resolve against the executable (ENABLE_EXPORTS).
extern "C" __attribute__((visibility("default"))) Communicator* dtrain_create_nccl_communicator(
    const std::shared_ptr<store::Store>* store, int rank, int size, const CommOptions* opts) {
  return new NcclCommunicator(*store, rank, size, *opts);
}

}  // namespace dtrain::comm
