// NCCL backend (CUDA builds only; a plugin loaded on first use, see the end of this file).
// Buffers are device pointers. Collectives run on one dedicated stream; each returns a Work
// whose wait()/test() poll its CUDA event together with ncclCommGetAsyncError, and abort the
// communicator when the operation outlives the timeout, so a lost peer becomes a
// PeerLostError instead of a hang.
//
// Nothing here may block without a deadline, or abort could not run: the communicator is
// created non-blocking (ncclConfig_t.blocking = 0, NCCL >= 2.14), so ncclCommInitRank, an
// enqueue that connects lazily to its peers, and finalisation return ncclInProgress at once
// and are polled against the operation's deadline. (Built against an older NCCL, creation and
// enqueueing block as NCCL does; waiting for completion is still bounded.)
#include <cuda_runtime.h>
#include <fmt/format.h>
#include <nccl.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <mutex>
#include <thread>

#include "dtrain/comm/communicator.h"
#include "../detail/rank_list.h"
#include "dtrain/common/errors.h"
#include "dtrain/common/strings.h"

#if defined(NCCL_VERSION_CODE) && NCCL_VERSION_CODE >= NCCL_VERSION(2, 14, 0)
#define DTRAIN_NCCL_NONBLOCKING 1
#else
#define DTRAIN_NCCL_NONBLOCKING 0
#endif

namespace dtrain::comm {
namespace {

using Clock = std::chrono::steady_clock;

void cudaCheck(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw IoError(fmt::format("{}: CUDA error: {}", what, cudaGetErrorString(e)));
}

std::string secondsText(Duration d) { return fmt::format("{:.3g} s", static_cast<double>(d.count()) / 1000.0); }

// An NCCL error as the exception a caller can act on: a peer or the network gone
// (PeerLostError), the CUDA runtime or NCCL itself failing (IoError), or dtrain's caller
// passing something NCCL refuses (SpecError: a host pointer, a size mismatch NCCL noticed).
[[noreturn]] void throwNccl(ncclResult_t r, const std::string& msg) {
  switch (r) {
    case ncclInvalidArgument:
    case ncclInvalidUsage:
      throw SpecError(msg);
    case ncclUnhandledCudaError:
    case ncclInternalError:
      throw IoError(msg);
    default:
      throw PeerLostError(msg);
  }
}

// NCCL's own words for its latest failure (" [NCCL's last warning: Duplicate GPU detected:
// rank 1 and rank 0 both on CUDA device 0]"), "" when it has none: ncclGetErrorString names
// only the class ("invalid usage (run with NCCL_DEBUG=WARN for details)"), and a one-off run
// on a GPU machine should not need a second one with NCCL_DEBUG to say why. NCCL keeps one
// such text per process, whatever communicator the argument names, so it may be an earlier
// warning's: labelled as what it is.
std::string ncclDetail() {
#if defined(NCCL_VERSION_CODE) && NCCL_VERSION_CODE >= NCCL_VERSION(2, 13, 0)
  const char* s = ncclGetLastError(nullptr);
  if (s && *s) {
    std::string t = oneLine(trim(s));
    if (!t.empty()) return fmt::format(" [NCCL's last warning: {}]", t);
  }
#endif
  return "";
}

std::string versionText(int v) {
  // NCCL_VERSION(X,Y,Z): X*1000+Y*100+Z before 2.9, X*10000+Y*100+Z since.
  return v >= 10000 ? fmt::format("{}.{}.{}", v / 10000, v / 100 % 100, v % 100)
                    : fmt::format("{}.{}.{}", v / 1000, v / 100 % 10, v % 100);
}

ncclDataType_t ncclType(DataType t) {
  switch (t) {
    case DataType::kFloat32:
      return ncclFloat32;
    case DataType::kFloat64:
      return ncclFloat64;
    case DataType::kInt32:
      return ncclInt32;
    case DataType::kInt64:
      return ncclInt64;
    case DataType::kFloat16:
      return ncclFloat16;
    case DataType::kBFloat16:
      return ncclBfloat16;
  }
  return ncclFloat32;
}

ncclRedOp_t ncclOp(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return ncclSum;
    case ReduceOp::kAvg:
      return ncclAvg;
    case ReduceOp::kMin:
      return ncclMin;
    case ReduceOp::kMax:
      return ncclMax;
  }
  return ncclSum;
}

// Who this rank is, for messages: its rank in the job, and for a group its place in it.
struct Identity {
  std::string name;        // the communicator's name ("default", "default/stage0")
  int rank = 0;            // in this communicator
  std::vector<int> world;  // world[r]: the job rank of this communicator's rank r
  bool group = false;      // made by group(): its ranks are not the job's
  std::string self() const {
    return group ? fmt::format("rank {} (rank {} of communicator \"{}\")", world[static_cast<size_t>(rank)], rank, name)
                 : fmt::format("rank {}", rank);
  }
  std::string peers() const { return detail::rankList(world); }
};

// Owns the communicator, its streams and a scratch device int for barriers; shared by the
// communicator, its outstanding Works and its Buffers, so the last of them releases it. Not
// copyable.
//
// Thread-safety: mu guards `comm` and the abort state. ncclCommAbort frees the communicator,
// so every NCCL call on it happens under mu after checking `aborted`; a call made under mu
// returns promptly (the communicator is non-blocking, polls are bounded by deadlines), so
// abort never waits long for it. Holding mu from enqueue to event record also fixes the
// issue order across threads.
//
// Nothing here synchronises the device (cudaFree, cudaMemcpy do): with a kernel stuck on a
// lost peer that would block the thread that should abort it. Memory is stream-ordered
// (cudaMallocAsync on the copy stream, cudaFreeAsync on the collectives' stream), copies go
// through the copy stream.
struct NcclState {
  ncclComm_t comm = nullptr;
  cudaStream_t stream = nullptr;      // the collectives'
  cudaStream_t copyStream = nullptr;  // Buffer uploads and downloads, allocations
  int* barrierBuf = nullptr;
  int device = 0;
  int version = 0;
  int rank = 0, size = 1;
  Duration timeout{};
  std::shared_ptr<store::Store> store;
  std::string keyPrefix;  // "comm/<name>/"
  std::mutex mu;
  bool aborted = false;  // under mu
  std::string failure;   // under mu: why it was aborted

  NcclState() = default;
  NcclState(const NcclState&) = delete;
  NcclState& operator=(const NcclState&) = delete;

  // Aborts the communicator (once) with `why`; mu must be held. Returns true when this call
  // did it (the caller then publishes the failure, outside mu).
  bool abortLocked(const std::string& why) {
    if (aborted) return false;
    if (comm) ncclCommAbort(comm);
    aborted = true;
    failure = why;
    return true;
  }

  // The job's first failure, for peers' messages (as the tcp backend): first wins; best effort
  // (the store may be gone too).
  void publish(const std::string& why) {
    try {
      store->compareSet(keyPrefix + "failure", "", why);
    } catch (const std::exception&) {
    }
  }

  // " [first failure in this job: ...]" when another rank left one that is not ours.
  std::string firstFailure(const std::string& ours) {
    try {
      if (store->check({keyPrefix + "failure"})) {
        std::string f = store->get(keyPrefix + "failure");
        if (f != ours) return fmt::format(" [first failure in this job: {}]", f);
      }
    } catch (const std::exception&) {
    }
    return "";
  }

  // This rank releases its communicator (destroyed or aborted).
  void markClosing() {
    try {
      store->set(keyPrefix + "closing/" + std::to_string(rank), "1");
    } catch (const std::exception&) {
    }
  }
  // Whether every rank releases its communicator too, within `limit`: ncclCommDestroy waits
  // for the host's other ranks (NCCL's proxy thread ends once every local peer closed its
  // connections), for ever when one is gone or releases its communicators in another order;
  // so a destroy is only tried once all have come here, else it is an abort.
  bool allClosing(Duration limit) {
    try {
      std::vector<std::string> keys;
      for (int r = 0; r < size; ++r) keys.push_back(keyPrefix + "closing/" + std::to_string(r));
      store->wait(keys, limit);
      return true;
    } catch (const std::exception&) {
      return false;
    }
  }

  ~NcclState() {
    cudaSetDevice(device);
    if (comm) markClosing();
    if (comm && !aborted) {
      // Destroying waits for outstanding operations, which never end when a peer is gone (or
      // when this runs because an operation failed): abort instead, as NCCL advises.
      const bool idle = stream == nullptr || cudaStreamQuery(stream) == cudaSuccess;
      const Duration limit = std::min<Duration>(timeout, std::chrono::seconds(30));
      bool clean = idle && std::uncaught_exceptions() == 0 && allClosing(limit);
#if DTRAIN_NCCL_NONBLOCKING
      if (clean) {
        // Finalising flushes NCCL's proxy work: bounded too.
        ncclResult_t r = ncclCommFinalize(comm);
        const auto deadline = Clock::now() + limit;
        while (r == ncclInProgress && Clock::now() < deadline) {
          std::this_thread::sleep_for(std::chrono::microseconds(200));
          if (ncclCommGetAsyncError(comm, &r) != ncclSuccess) r = ncclInternalError;
        }
        clean = r == ncclSuccess;
      }
#endif
      clean ? (void)ncclCommDestroy(comm) : (void)ncclCommAbort(comm);
    }
    if (barrierBuf) cudaFreeAsync(barrierBuf, stream);
    if (stream) cudaStreamDestroy(stream);  // (returns at once; released once its work is done)
    if (copyStream) cudaStreamDestroy(copyStream);
  }
};

class NcclWork final : public Work {
 public:
  NcclWork(std::shared_ptr<NcclState> st, cudaEvent_t ev, std::string op, Clock::time_point deadline,
           std::shared_ptr<const Identity> id)
      : st_(std::move(st)), ev_(ev), op_(std::move(op)), deadline_(deadline), id_(std::move(id)) {}
  ~NcclWork() override { cudaEventDestroy(ev_); }
  NcclWork(const NcclWork&) = delete;
  NcclWork& operator=(const NcclWork&) = delete;

  // Done or failed; polls as wait() does (so a lost peer ends a test() loop too), but never
  // waits for the communicator's lock: while another thread holds it (an enqueue connecting to
  // its peers), the answer is "not yet".
  bool test() override {
    if (done_) return true;
    std::unique_lock<std::mutex> l(st_->mu, std::try_to_lock);
    return l.owns_lock() && poll(l);
  }

  // Looks back to back for the first 100 us, then every 50 us: a sleep lasts 55-100 us on
  // Linux, which sleeping from the start put under every small synchronous collective (and
  // the bench's latency column), where a kernel ends in a few us.
  void wait() override {
    const auto spinUntil = Clock::now() + std::chrono::microseconds(100);
    while (!done_) {
      std::unique_lock<std::mutex> l(st_->mu);
      if (poll(l)) break;
      l.unlock();
      if (Clock::now() < spinUntil)
        std::this_thread::yield();
      else
        std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
    if (error_) std::rethrow_exception(error_);
  }

 private:
  // One look at the operation, under the communicator's lock `l` (released here before any
  // store I/O): true once it finished or failed (error_ set).
  bool poll(std::unique_lock<std::mutex>& l) {
    if (done_) return true;
    std::string why, published;
    cudaError_t e = cudaSuccess;
    if (st_->aborted) {
      // (its kernels left at the abort and the event completed, over data that is not the
      // result: nothing enqueued before an abort is trusted)
      why = fmt::format("the NCCL communicator was aborted: {}", st_->failure);
    } else {
      e = cudaEventQuery(ev_);
      if (e == cudaSuccess) return done_ = true;
      if (e != cudaErrorNotReady) {
        why = fmt::format("CUDA error: {}", cudaGetErrorString(e));
      } else {
        ncclResult_t async = ncclSuccess;
        if (ncclCommGetAsyncError(st_->comm, &async) != ncclSuccess) async = ncclInternalError;
        if (async != ncclSuccess && async != ncclInProgress) {
          why = fmt::format("NCCL reported: {}{}; the NCCL communicator was aborted", ncclGetErrorString(async),
                            ncclDetail());
        } else if (Clock::now() > deadline_) {
          why = fmt::format(
              "did not finish within {}; a peer among ranks {} is lost or stopped; the NCCL "
              "communicator was aborted",
              secondsText(st_->timeout), id_->peers());
        }
      }
      if (!why.empty() && st_->abortLocked(message(why))) published = message(why);
    }
    if (why.empty()) return false;
    l.unlock();
    if (!published.empty()) st_->publish(published);
    const std::string msg = message(why) + st_->firstFailure(published.empty() ? message(why) : published);
    error_ = e != cudaErrorNotReady && e != cudaSuccess ? std::make_exception_ptr(IoError(msg))
                                                        : std::make_exception_ptr(PeerLostError(msg));
    return done_ = true;
  }

  std::string message(const std::string& why) const { return fmt::format("{} on {}: {}", op_, id_->self(), why); }

  std::shared_ptr<NcclState> st_;
  cudaEvent_t ev_;
  std::string op_;
  Clock::time_point deadline_;
  std::shared_ptr<const Identity> id_;
  bool done_ = false;
  std::exception_ptr error_;
};

// Device memory of the communicator's GPU, stream-ordered (see NcclState): neither making nor
// freeing one waits for the collectives in flight.
class DeviceBuffer final : public Buffer {
 public:
  DeviceBuffer(std::shared_ptr<NcclState> st, size_t bytes) : st_(std::move(st)), bytes_(bytes) {
    cudaCheck(cudaSetDevice(st_->device), "cudaSetDevice");
    cudaError_t e = cudaMallocAsync(&data_, std::max<size_t>(bytes, 1), st_->copyStream);
    if (e == cudaSuccess) e = cudaStreamSynchronize(st_->copyStream);
    if (e != cudaSuccess)
      throw AllocationError(
          fmt::format("cudaMallocAsync of {} bytes on cuda:{}: {}", bytes, st_->device, cudaGetErrorString(e)), true);
  }
  // (after the collectives issued before it on the stream; a stuck one keeps the memory)
  ~DeviceBuffer() override { cudaFreeAsync(data_, st_->stream); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  void* data() override { return data_; }
  size_t bytes() const override { return bytes_; }
  void upload(const void* host, size_t n) override { copy(data_, host, n, cudaMemcpyHostToDevice, "upload"); }
  void download(void* host, size_t n) const override { copy(host, data_, n, cudaMemcpyDeviceToHost, "download"); }

 private:
  // On the copy stream, waited for: done when this returns, before any collective issued
  // after it (a plain cudaMemcpy may return before a pageable upload reached the device, and
  // the legacy stream it uses is not ordered with the collectives' non-blocking one).
  void copy(void* dst, const void* src, size_t n, cudaMemcpyKind kind, const char* what) const {
    if (n > bytes_)
      throw SpecError(fmt::format("Buffer::{}: {} bytes into a buffer of {}", what, n, bytes_));
    cudaCheck(cudaSetDevice(st_->device), "cudaSetDevice");
    cudaCheck(cudaMemcpyAsync(dst, src, n, kind, st_->copyStream), "cudaMemcpyAsync");
    cudaCheck(cudaStreamSynchronize(st_->copyStream), "cudaStreamSynchronize");
  }

  std::shared_ptr<NcclState> st_;
  void* data_ = nullptr;
  size_t bytes_;
};

class NcclCommunicator final : public Communicator {
 public:
  // device: the GPU to use; -1 picks LOCAL_RANK's (else the rank's) among the visible ones. A
  // group passes its parent's: its group rank says nothing about the GPU its buffers are on.
  // world: the job rank of each rank (empty: the ranks are the job's).
  NcclCommunicator(std::shared_ptr<store::Store> store, int rank, int size, const CommOptions& opts, int device = -1,
                   std::vector<int> world = {})
      : store_(store), rank_(rank), size_(size), opts_(opts), st_(std::make_shared<NcclState>()) {
    if (size < 1 || rank < 0 || rank >= size)
      throw SpecError(fmt::format("communicator: rank {} is not within world size {}", rank, size));
    auto id = std::make_shared<Identity>();
    id->name = opts.name;
    id->rank = rank;
    id->group = !world.empty();
    id->world = std::move(world);
    if (id->world.empty())
      for (int r = 0; r < size; ++r) id->world.push_back(r);
    if (id->world.size() != static_cast<size_t>(size)) throw InternalError("nccl: group rank map of the wrong size");
    id_ = id;
    st_->timeout = opts.timeout;
    st_->store = store;
    st_->keyPrefix = "comm/" + opts.name + "/";
    st_->rank = rank;
    st_->size = size;
#if DTRAIN_NCCL_NONBLOCKING
    // NCCL's own override of ncclConfig_t.blocking: everything would block with no deadline.
    if (const char* b = std::getenv("NCCL_COMM_BLOCKING"); b && std::string(b) == "1")
      throw SpecError(
          "NCCL_COMM_BLOCKING=1 makes NCCL block without a deadline, which the nccl backend's timeouts (a lost "
          "peer becoming an error, not a hang) need; unset it");
#endif

    int count = 0;
    cudaError_t e = cudaGetDeviceCount(&count);
    if (e != cudaSuccess || count == 0)
      throw SpecError(
          fmt::format("backend \"nccl\": no CUDA device is visible ({}); use backend \"tcp\" on this machine",
                      e == cudaSuccess ? "0 devices" : cudaGetErrorString(e)));
    ncclGetVersion(&st_->version);
    // (LOCAL_RANK read as the trainer reads it, train::localRankFromEnv: both must pick one GPU)
    st_->device = device >= 0 ? device : envIndex("LOCAL_RANK", id_->world[static_cast<size_t>(rank)]) % count;
    cudaCheck(cudaSetDevice(st_->device), "cudaSetDevice");
    cudaCheck(cudaStreamCreateWithFlags(&st_->stream, cudaStreamNonBlocking), "cudaStreamCreate");
    cudaCheck(cudaStreamCreateWithFlags(&st_->copyStream, cudaStreamNonBlocking), "cudaStreamCreate");
    cudaCheck(cudaMallocAsync(&st_->barrierBuf, sizeof(int), st_->copyStream), "cudaMallocAsync");
    cudaCheck(cudaStreamSynchronize(st_->copyStream), "cudaStreamSynchronize");

    ncclUniqueId uid;
    std::string key = "comm/" + opts.name + "/nccl_id";
    if (rank == 0) {
      ncclResult_t r = ncclGetUniqueId(&uid);
      if (r != ncclSuccess)
        throwNccl(r, fmt::format("ncclGetUniqueId: NCCL error: {}{}", ncclGetErrorString(r), ncclDetail()));
      store->set(key, std::string(reinterpret_cast<const char*>(&uid), sizeof(uid)));
    } else {
      std::string v = store->get(key);
      if (v.size() != sizeof(uid))
        throw PeerLostError(
            fmt::format("nccl: rank 0 of communicator \"{}\" published a malformed ncclUniqueId ({} "
                        "bytes, expected {})",
                        opts.name, v.size(), sizeof(uid)));
      std::memcpy(&uid, v.data(), sizeof(uid));
    }
    init(uid);
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const char* backend() const override { return "nccl"; }

  WorkPtr allreduceAsync(void* data, size_t count, DataType t, ReduceOp op) override {
    checkFeatures(t, op);
    checkBuffer("allreduce", data, count * elementSize(t));
    return launch("allreduce",
                  [&] { return ncclAllReduce(data, data, count, ncclType(t), ncclOp(op), st_->comm, st_->stream); });
  }
  WorkPtr broadcastAsync(void* data, size_t count, DataType t, int root) override {
    checkFeatures(t, ReduceOp::kSum);
    checkPeer(root, "broadcast root", true);
    checkBuffer("broadcast", data, count * elementSize(t));
    return launch("broadcast",
                  [&] { return ncclBroadcast(data, data, count, ncclType(t), root, st_->comm, st_->stream); });
  }
  WorkPtr allgatherAsync(const void* send, void* recv, size_t count, DataType t) override {
    checkFeatures(t, ReduceOp::kSum);
    checkBuffer("allgather", send, count * elementSize(t));
    checkBuffer("allgather", recv, count * elementSize(t) * static_cast<size_t>(size_));
    return launch("allgather", [&] { return ncclAllGather(send, recv, count, ncclType(t), st_->comm, st_->stream); });
  }
  WorkPtr reduceScatterAsync(const void* send, void* recv, size_t recvCount, DataType t, ReduceOp op) override {
    checkFeatures(t, op);
    checkBuffer("reduce_scatter", send, recvCount * elementSize(t) * static_cast<size_t>(size_));
    checkBuffer("reduce_scatter", recv, recvCount * elementSize(t));
    return launch("reduce_scatter", [&] {
      return ncclReduceScatter(send, recv, recvCount, ncclType(t), ncclOp(op), st_->comm, st_->stream);
    });
  }
  WorkPtr barrierAsync() override {
    return launch("barrier", [&] {
      return ncclAllReduce(st_->barrierBuf, st_->barrierBuf, 1, ncclInt32, ncclSum, st_->comm, st_->stream);
    });
  }
  // NCCL does not tell a receiver what size was sent (the tcp backend's length header): the
  // sizes must match, see docs/collectives.md.
  WorkPtr sendAsync(const void* data, size_t bytes, int peer) override {
    checkPeer(peer, "send peer", false);
    checkBuffer("send", data, bytes);
    return launch("send", [&] { return ncclSend(data, bytes, ncclInt8, peer, st_->comm, st_->stream); });
  }
  WorkPtr recvAsync(void* data, size_t bytes, int peer) override {
    checkPeer(peer, "recv peer", false);
    checkBuffer("recv", data, bytes);
    return launch("recv", [&] { return ncclRecv(data, bytes, ncclInt8, peer, st_->comm, st_->stream); });
  }
  WorkPtr sendRecvAsync(const void* sendData, size_t sendBytes, int sendPeer, void* recvData, size_t recvBytes,
                        int recvPeer) override {
    checkPeer(sendPeer, "sendRecv send peer", false);
    checkPeer(recvPeer, "sendRecv recv peer", false);
    checkBuffer("sendrecv", sendData, sendBytes);
    checkBuffer("sendrecv", recvData, recvBytes);
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
    std::vector<int> world;
    for (int x : ranks) world.push_back(id_->world[static_cast<size_t>(x)]);
    return std::make_unique<NcclCommunicator>(store_, r, static_cast<int>(ranks.size()), o, st_->device,
                                              std::move(world));
  }
  std::unique_ptr<Buffer> allocate(size_t bytes) override { return std::make_unique<DeviceBuffer>(st_, bytes); }

 private:
  // ncclCommInitRank, bounded by the timeout: a rank that never joins (dead before it got
  // here, or stuck) fails this one with PeerLostError instead of hanging it.
  void init(const ncclUniqueId& uid) {
    const auto start = Clock::now();
    const auto deadline = start + opts_.timeout;
#if DTRAIN_NCCL_NONBLOCKING
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    ncclResult_t r = ncclCommInitRankConfig(&st_->comm, size_, uid, rank_, &config);
    while (r == ncclInProgress && Clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::microseconds(500));
      if (ncclCommGetAsyncError(st_->comm, &r) != ncclSuccess) r = ncclInternalError;
    }
    if (r == ncclInProgress) {
      std::lock_guard<std::mutex> l(st_->mu);
      st_->abortLocked("ncclCommInitRank timed out");
      throw PeerLostError(
          fmt::format("ncclCommInitRank on {}: not every rank among {} joined within {}; one is lost, "
                      "stopped, or never created its communicator \"{}\"{}",
                      id_->self(), id_->peers(), secondsText(opts_.timeout), opts_.name, st_->firstFailure("")));
    }
#else
    ncclResult_t r = ncclCommInitRank(&st_->comm, size_, uid, rank_);
#endif
    if (r != ncclSuccess) {
      if (st_->comm) {
        std::lock_guard<std::mutex> l(st_->mu);
        st_->abortLocked("ncclCommInitRank failed");
      }
      throwNccl(r, fmt::format("ncclCommInitRank on {} (NCCL {}): NCCL error: {}{}", id_->self(),
                               versionText(st_->version), ncclGetErrorString(r), ncclDetail()));
    }
  }

  // What the loaded NCCL cannot do, refused before anything is enqueued (peers would wait for
  // an operation this rank never issues; SpecError does not break the communicator).
  void checkFeatures(DataType t, ReduceOp op) const {
    constexpr int k210 = 21000;  // NCCL_VERSION(2, 10, 0)
    if (st_->version >= k210) return;
    if (op == ReduceOp::kAvg)
      throw SpecError(
          fmt::format("reduce op avg needs NCCL 2.10 or newer, and this process loaded NCCL {}; use sum "
                      "and divide, or upgrade NCCL",
                      versionText(st_->version)));
    if (t == DataType::kBFloat16)
      throw SpecError(
          fmt::format("bfloat16 needs NCCL 2.10 or newer, and this process loaded NCCL {}", versionText(st_->version)));
  }

  // A buffer NCCL can use: device (or managed) memory of this communicator's GPU. NCCL checks
  // nothing (unless NCCL_CHECK_POINTERS=1): a host pointer's kernel faults and takes the CUDA
  // context with it, or a buffer of another GPU is read across the bus. Refused here instead,
  // before anything is enqueued (SpecError: the communicator stays usable).
  void checkBuffer(const char* op, const void* p, size_t bytes) const {
    if (bytes == 0) return;
    cudaPointerAttributes a{};
    const cudaError_t e = cudaPointerGetAttributes(&a, p);
    if (e != cudaSuccess) cudaGetLastError();  // (not sticky; cleared so later calls do not report it)
    const bool device = e == cudaSuccess && (a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged);
    if (device && (a.type == cudaMemoryTypeManaged || a.device == st_->device)) return;
    throw SpecError(fmt::format("{} on {}: the buffer at {} is {}; the nccl backend needs device memory of cuda:{} "
                                "(its communicator's GPU)",
                                op, id_->self(), p,
                                device ? fmt::format("memory of cuda:{}", a.device) : std::string("host memory"),
                                st_->device));
  }

  void checkPeer(int peer, const char* what, bool allowSelf) const {
    if (peer < 0 || peer >= size_ || (peer == rank_ && !allowSelf))
      throw SpecError(fmt::format("{} {} is not another rank of this communicator (size {})", what, peer, size_));
  }

  // Enqueues one operation on the stream and returns its Work. Any failure here breaks the
  // communicator (it is aborted; the failure is published for the peers, which would
  // otherwise wait for this rank until their timeout), and every later operation fails at
  // once naming it.
  template <typename F>
  WorkPtr launch(const char* op, F&& enqueue) {
    std::string failed;
    std::exception_ptr error;
    {
      std::lock_guard<std::mutex> l(st_->mu);
      // (from here: a launch queued behind another's slow connect gets its whole timeout)
      const auto deadline = Clock::now() + opts_.timeout;
      if (st_->aborted)
        throw PeerLostError(
            fmt::format("{} on {}: the NCCL communicator was aborted earlier: {}", op, id_->self(), st_->failure));
      try {
        cudaCheck(cudaSetDevice(st_->device), "cudaSetDevice");
        ncclResult_t r = enqueue();
        // Non-blocking: an enqueue that must first connect to its peers returns
        // ncclInProgress; nothing else may be issued until it completes.
        while (r == ncclInProgress) {
          if (Clock::now() > deadline) {
            throw PeerLostError(
                fmt::format("{} on {}: could not reach its peers among ranks {} within {}; one is lost "
                            "or stopped; the NCCL communicator was aborted",
                            op, id_->self(), id_->peers(), secondsText(opts_.timeout)));
          }
          std::this_thread::sleep_for(std::chrono::microseconds(50));
          if (ncclCommGetAsyncError(st_->comm, &r) != ncclSuccess) r = ncclInternalError;
        }
        if (r != ncclSuccess)
          throwNccl(r, fmt::format("{} on {}: NCCL error: {}{}; the NCCL communicator was aborted", op, id_->self(),
                                   ncclGetErrorString(r), ncclDetail()));
        cudaEvent_t ev;
        cudaCheck(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), "cudaEventCreate");
        cudaError_t e = cudaEventRecord(ev, st_->stream);
        if (e != cudaSuccess) {
          cudaEventDestroy(ev);
          cudaCheck(e, "cudaEventRecord");
        }
        return std::make_shared<NcclWork>(st_, ev, op, deadline, id_);
      } catch (const std::exception& ex) {
        error = std::current_exception();
        failed = ex.what();
        st_->abortLocked(failed);
      }
    }
    st_->publish(failed);
    std::rethrow_exception(error);
  }

  std::shared_ptr<store::Store> store_;
  int rank_, size_;
  CommOptions opts_;
  std::shared_ptr<NcclState> st_;
  std::shared_ptr<const Identity> id_;
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
