// Emulated CUDA runtime and NCCL (see fake/cuda_runtime.h, fake/nccl.h). One global mutex
// guards everything: the emulation is for correctness of the backend's logic, not speed.
#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "emu_nccl.h"

namespace {

std::mutex g_mu;
std::condition_variable g_cv;

// ---- devices, memory, streams, events ----

int deviceCount() {
  const char* v = std::getenv("EMU_GPUS");
  return v ? std::atoi(v) : 4;
}
thread_local int t_device = 0;

struct Allocation {
  size_t bytes;
  int device;
};
std::map<const char*, Allocation> g_allocs;  // under g_mu

// Where `p .. p+bytes` lies in one allocation, its device; -1 when it is not device memory.
int deviceOf(const void* p, size_t bytes) {
  const char* c = static_cast<const char*>(p);
  auto it = g_allocs.upper_bound(c);
  if (it == g_allocs.begin()) return -1;
  --it;
  if (c < it->first || c + bytes > it->first + it->second.bytes) return -1;
  return it->second.device;
}

struct StreamState {
  int device = 0;
  uint64_t enqueued = 0;
  uint64_t completed = 0;  // operations 1..completed have all completed
  std::set<uint64_t> doneOutOfOrder;
  void complete(uint64_t op) {
    doneOutOfOrder.insert(op);
    while (doneOutOfOrder.count(completed + 1)) doneOutOfOrder.erase(++completed);
    g_cv.notify_all();
  }
};

}  // namespace

struct EmuStream {
  std::shared_ptr<StreamState> s;
};
struct EmuEvent {
  std::shared_ptr<StreamState> s;
  uint64_t target = 0;
};

const char* cudaGetErrorString(cudaError_t e) {
  switch (e) {
    case cudaSuccess:
      return "no error";
    case cudaErrorInvalidValue:
      return "invalid argument";
    case cudaErrorMemoryAllocation:
      return "out of memory";
    case cudaErrorNoDevice:
      return "no CUDA-capable device is detected";
    case cudaErrorInvalidDevice:
      return "invalid device ordinal";
    case cudaErrorNotReady:
      return "device not ready";
  }
  return "unknown error";
}
cudaError_t cudaGetDeviceCount(int* n) {
  *n = deviceCount();
  return *n > 0 ? cudaSuccess : cudaErrorNoDevice;
}
cudaError_t cudaSetDevice(int d) {
  if (d < 0 || d >= deviceCount()) return cudaErrorInvalidDevice;
  t_device = d;
  return cudaSuccess;
}
cudaError_t cudaGetDevice(int* d) {
  *d = t_device;
  return cudaSuccess;
}
cudaError_t cudaMalloc(void** p, size_t bytes) {
  char* m = static_cast<char*>(std::malloc(std::max<size_t>(bytes, 1)));
  if (!m) return cudaErrorMemoryAllocation;
  std::lock_guard<std::mutex> l(g_mu);
  g_allocs[m] = {std::max<size_t>(bytes, 1), t_device};
  *p = m;
  return cudaSuccess;
}
cudaError_t cudaFree(void* p) {
  if (!p) return cudaSuccess;
  std::lock_guard<std::mutex> l(g_mu);
  if (!g_allocs.erase(static_cast<char*>(p))) return cudaErrorInvalidValue;
  std::free(p);
  return cudaSuccess;
}
cudaError_t cudaMemcpy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind) {
  {
    std::lock_guard<std::mutex> l(g_mu);
    const bool dDev = deviceOf(dst, bytes) >= 0, sDev = deviceOf(src, bytes) >= 0;
    const bool ok = kind == cudaMemcpyHostToDevice     ? dDev && !sDev
                    : kind == cudaMemcpyDeviceToHost   ? sDev && !dDev
                    : kind == cudaMemcpyDeviceToDevice ? sDev && dDev
                                                       : !sDev && !dDev;
    if (!ok) return cudaErrorInvalidValue;
  }
  std::memcpy(dst, src, bytes);
  return cudaSuccess;
}
cudaError_t cudaMallocAsync(void** p, size_t bytes, cudaStream_t) { return cudaMalloc(p, bytes); }
cudaError_t cudaFreeAsync(void* p, cudaStream_t s) {
  if (cudaStreamQuery(s) != cudaSuccess) return cudaSuccess;  // (kept: the stream may still use it)
  return cudaFree(p);
}
cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind, cudaStream_t) {
  return cudaMemcpy(dst, src, bytes, kind);
}
cudaError_t cudaGetLastError() { return cudaSuccess; }
cudaError_t cudaPointerGetAttributes(cudaPointerAttributes* a, const void* p) {
  std::lock_guard<std::mutex> l(g_mu);
  const int d = deviceOf(p, 1);
  a->type = d >= 0 ? cudaMemoryTypeDevice : cudaMemoryTypeUnregistered;
  a->device = d >= 0 ? d : -2;
  a->devicePointer = d >= 0 ? const_cast<void*>(p) : nullptr;
  a->hostPointer = d >= 0 ? nullptr : const_cast<void*>(p);
  return cudaSuccess;
}
cudaError_t cudaStreamCreateWithFlags(cudaStream_t* s, unsigned) {
  *s = new EmuStream{std::make_shared<StreamState>()};
  (*s)->s->device = t_device;
  return cudaSuccess;
}
cudaError_t cudaStreamDestroy(cudaStream_t s) {
  delete s;
  return cudaSuccess;
}
// Waits for every operation enqueued on `s` (NCCL operations complete when the peers arrive:
// for ever when one never does, as on a GPU).
cudaError_t cudaStreamSynchronize(cudaStream_t s) {
  std::unique_lock<std::mutex> l(g_mu);
  g_cv.wait(l, [&] { return s->s->completed == s->s->enqueued; });
  return cudaSuccess;
}
cudaError_t cudaStreamQuery(cudaStream_t s) {
  std::lock_guard<std::mutex> l(g_mu);
  return s->s->completed == s->s->enqueued ? cudaSuccess : cudaErrorNotReady;
}
cudaError_t cudaEventCreateWithFlags(cudaEvent_t* e, unsigned) {
  *e = new EmuEvent;
  return cudaSuccess;
}
cudaError_t cudaEventDestroy(cudaEvent_t e) {
  delete e;
  return cudaSuccess;
}
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s) {
  std::lock_guard<std::mutex> l(g_mu);
  e->s = s->s;
  e->target = s->s->enqueued;
  return cudaSuccess;
}
cudaError_t cudaEventQuery(cudaEvent_t e) {
  std::lock_guard<std::mutex> l(g_mu);
  return !e->s || e->s->completed >= e->target ? cudaSuccess : cudaErrorNotReady;
}

// ---- NCCL ----

namespace {

struct World;

// One operation on one stream; it completes when all its parts (a grouped send and recv are
// two) have been matched with the peers'.
struct StreamOp {
  std::shared_ptr<StreamState> stream;
  uint64_t index = 0;
  int pending = 0;
  bool finished = false;
  ncclComm* comm = nullptr;
};

enum class Kind { kAllReduce, kBroadcast, kAllGather, kReduceScatter, kSend, kRecv };

struct Part {
  Kind kind;
  const void* send;
  void* recv;
  size_t count;  // elements (send/recv: of type t)
  ncclDataType_t type;
  ncclRedOp_t op;
  int root;  // broadcast root; send/recv peer
  std::shared_ptr<StreamOp> sop;
};

}  // namespace

struct ncclComm {
  std::shared_ptr<World> world;
  int rank = 0;
  int device = 0;
  bool blocking = true;
  bool initDone = false;
  bool freed = false;
  bool connected = false;   // a non-blocking communicator's first enqueue connects
  bool connecting = false;  // that enqueue returned ncclInProgress
  bool finalizing = false;
  ncclResult_t async = ncclSuccess;
  uint64_t collSeq = 0;
  int outstanding = 0;  // stream operations not yet complete
  std::vector<std::shared_ptr<StreamOp>> live;  // this communicator's operations on streams
  // The first enqueue of a non-blocking communicator, posted only once its connect finished
  // (until then nothing is on the stream, as with NCCL).
  std::vector<Part> connectParts;
  cudaStream_t connectStream = nullptr;
};

namespace {

struct World {
  int size = 0;
  std::vector<ncclComm*> members;
  int joined = 0;
  bool broken = false;  // a member was aborted: nothing completes any more (its kernels are gone)
  std::map<uint64_t, std::vector<Part>> colls;  // by sequence number, one part per rank (in rank order once full)
  std::map<uint64_t, std::vector<int>> collRanks;
  std::map<std::pair<int, int>, std::deque<Part>> sends, recvs;  // by (src, dst)
};

std::map<std::string, std::shared_ptr<World>> g_worlds;
std::vector<ncclComm*> g_comms;  // every communicator ever made (never deleted: use-after-abort detection)
emu_nccl::Counters g_counters;
std::map<int, ncclResult_t> g_failNext, g_asyncError;
std::set<int> g_hangConnect, g_hangFinalize;
int g_version = NCCL_VERSION_CODE;
std::string g_lastError;
uint64_t g_idCounter = 0;
thread_local int t_groupDepth = 0;
struct GroupedPart {
  ncclComm* comm;
  cudaStream_t stream;
  Part part;
};
thread_local std::vector<GroupedPart> t_groupParts;

size_t typeSize(ncclDataType_t t) {
  switch (t) {
    case ncclInt8:
    case ncclUint8:
      return 1;
    case ncclFloat16:
    case ncclBfloat16:
      return 2;
    case ncclInt32:
    case ncclUint32:
    case ncclFloat32:
      return 4;
    default:
      return 8;
  }
}

template <typename T>
void reduceTyped(const std::vector<const void*>& in, void* out, size_t count, ncclRedOp_t op) {
  std::vector<T> acc(count);
  std::memcpy(acc.data(), in[0], count * sizeof(T));
  for (size_t r = 1; r < in.size(); ++r) {
    const T* x = static_cast<const T*>(in[r]);
    for (size_t i = 0; i < count; ++i)
      acc[i] = op == ncclMax ? std::max(acc[i], x[i]) : op == ncclMin ? std::min(acc[i], x[i]) : acc[i] + x[i];
  }
  if (op == ncclAvg)
    for (auto& v : acc) v = static_cast<T>(v / static_cast<T>(in.size()));
  std::memcpy(out, acc.data(), count * sizeof(T));
}

bool reduce(const std::vector<const void*>& in, void* out, size_t count, ncclDataType_t t, ncclRedOp_t op) {
  switch (t) {
    case ncclFloat32:
      reduceTyped<float>(in, out, count, op);
      return true;
    case ncclFloat64:
      reduceTyped<double>(in, out, count, op);
      return true;
    case ncclInt32:
      reduceTyped<int32_t>(in, out, count, op);
      return true;
    case ncclInt64:
      reduceTyped<int64_t>(in, out, count, op);
      return true;
    default:
      return false;  // (16-bit floats: not emulated)
  }
}

void finish(StreamOp& op) {
  if (op.finished) return;
  op.finished = true;
  op.stream->complete(op.index);
  --op.comm->outstanding;
}

void completePart(const Part& p) {
  if (--p.sop->pending == 0) finish(*p.sop);
}

// Every rank's part of collective `seq` arrived: computes it (reading every input before
// writing any output, as in-place operations need) and completes the parts. g_mu held.
void runCollective(World& w, std::vector<Part>& parts) {
  const Part& p0 = parts[0];
  for (const Part& p : parts)
    if (p.kind != p0.kind || p.count != p0.count || p.type != p0.type || p.op != p0.op || p.root != p0.root) {
      for (ncclComm* c : w.members) c->async = ncclInvalidUsage;  // mismatched collectives: NCCL hangs or corrupts
      return;
    }
  const size_t es = typeSize(p0.type), n = parts.size();
  switch (p0.kind) {
    case Kind::kAllReduce: {
      std::vector<const void*> in;
      for (const Part& p : parts) in.push_back(p.send);
      std::vector<char> out(p0.count * es);
      if (!reduce(in, out.data(), p0.count, p0.type, p0.op)) {
        for (ncclComm* c : w.members) c->async = ncclInvalidArgument;
        return;
      }
      for (const Part& p : parts) std::memcpy(p.recv, out.data(), out.size());
      break;
    }
    case Kind::kBroadcast: {
      std::vector<char> data(static_cast<const char*>(parts[static_cast<size_t>(p0.root)].send),
                             static_cast<const char*>(parts[static_cast<size_t>(p0.root)].send) + p0.count * es);
      for (const Part& p : parts) std::memcpy(p.recv, data.data(), data.size());
      break;
    }
    case Kind::kAllGather: {
      std::vector<char> out(n * p0.count * es);
      for (size_t r = 0; r < n; ++r) std::memcpy(out.data() + r * p0.count * es, parts[r].send, p0.count * es);
      for (const Part& p : parts) std::memcpy(p.recv, out.data(), out.size());
      break;
    }
    case Kind::kReduceScatter: {
      std::vector<std::vector<char>> outs(n, std::vector<char>(p0.count * es));
      for (size_t b = 0; b < n; ++b) {
        std::vector<const void*> in;
        for (const Part& p : parts) in.push_back(static_cast<const char*>(p.send) + b * p0.count * es);
        if (!reduce(in, outs[b].data(), p0.count, p0.type, p0.op)) {
          for (ncclComm* c : w.members) c->async = ncclInvalidArgument;
          return;
        }
      }
      for (size_t r = 0; r < n; ++r) std::memcpy(parts[r].recv, outs[r].data(), outs[r].size());
      break;
    }
    default:
      break;
  }
  for (const Part& p : parts) completePart(p);
}

void tryMatch(World& w, std::pair<int, int> key) {
  auto& s = w.sends[key];
  auto& r = w.recvs[key];
  while (!s.empty() && !r.empty()) {
    const Part a = s.front(), b = r.front();
    s.pop_front();
    r.pop_front();
    // (sizes that differ: real NCCL truncates or fails; the emulation copies what fits)
    std::memcpy(b.recv, a.send, std::min(a.count * typeSize(a.type), b.count * typeSize(b.type)));
    completePart(a);
    completePart(b);
  }
}

// Posts one part of an operation. g_mu held.
void post(ncclComm* c, Part p) {
  World& w = *c->world;
  if (w.broken) return;
  if (p.kind == Kind::kSend || p.kind == Kind::kRecv) {
    const auto key = p.kind == Kind::kSend ? std::make_pair(c->rank, p.root) : std::make_pair(p.root, c->rank);
    (p.kind == Kind::kSend ? w.sends : w.recvs)[key].push_back(p);
    tryMatch(w, key);
    return;
  }
  const uint64_t seq = c->collSeq++;
  auto& parts = w.colls[seq];
  auto& ranks = w.collRanks[seq];
  parts.push_back(p);
  ranks.push_back(c->rank);
  if (static_cast<int>(parts.size()) == w.size) {
    std::vector<Part> ordered(parts.size(), parts[0]);
    for (size_t i = 0; i < parts.size(); ++i) ordered[static_cast<size_t>(ranks[i])] = parts[i];
    w.colls.erase(seq);
    w.collRanks.erase(seq);
    runCollective(w, ordered);
  }
}

// Checks a call on `c`; g_mu held.
ncclResult_t usable(ncclComm* c) {
  if (!c) return ncclInvalidArgument;
  if (c->freed) {
    ++g_counters.useAfterAbort;
    return ncclInvalidArgument;
  }
  if (!c->initDone) return ncclInvalidUsage;
  return ncclSuccess;
}

// As NCCL: pointers are checked only with NCCL_CHECK_POINTERS=1 (otherwise a host pointer's
// kernel would fault; here it would simply work, so the backend must check them itself).
ncclResult_t checkBuffer(ncclComm* c, const void* p, size_t bytes) {
  const char* check = std::getenv("NCCL_CHECK_POINTERS");
  if (!check || std::string(check) != "1") return ncclSuccess;
  const int d = deviceOf(p, bytes);
  return d == c->device ? ncclSuccess : ncclInvalidArgument;  // host memory, or another GPU's
}

// Puts `parts` on stream `s` as one operation and posts them to the peers. g_mu held.
void enqueueOnStream(ncclComm* c, cudaStream_t s, std::vector<Part> parts) {
  auto sop = std::make_shared<StreamOp>();
  sop->stream = s->s;
  sop->index = ++s->s->enqueued;
  sop->pending = static_cast<int>(parts.size());
  sop->comm = c;
  ++c->outstanding;
  c->live.push_back(sop);
  for (Part& p : parts) {
    p.sop = sop;
    post(c, p);
  }
}

// Enqueues `parts` of `c` as one stream operation on `s` (a call outside a group, or one
// communicator's share of a group). g_mu held.
ncclResult_t submit(ncclComm* c, cudaStream_t s, std::vector<Part> parts) {
  if (ncclResult_t r = usable(c)) return r;
  auto f = g_failNext.find(c->rank);
  if (f != g_failNext.end()) {
    const ncclResult_t r = f->second;
    g_failNext.erase(f);
    return r;
  }
  for (const Part& p : parts) {
    const size_t es = typeSize(p.type);
    const size_t sendBytes = p.kind == Kind::kAllGather       ? p.count * es
                             : p.kind == Kind::kReduceScatter ? p.count * es * static_cast<size_t>(c->world->size)
                                                              : p.count * es;
    const size_t recvBytes =
        p.kind == Kind::kAllGather ? p.count * es * static_cast<size_t>(c->world->size) : p.count * es;
    if (p.kind != Kind::kRecv && checkBuffer(c, p.send, sendBytes)) return ncclInvalidArgument;
    if (p.kind != Kind::kSend && checkBuffer(c, p.recv, recvBytes)) return ncclInvalidArgument;
    if ((p.kind == Kind::kSend || p.kind == Kind::kRecv || p.kind == Kind::kBroadcast) &&
        (p.root < 0 || p.root >= c->world->size))
      return ncclInvalidArgument;
  }
  if (!c->blocking && !c->connected) {
    c->connected = true;
    c->connecting = true;
    c->connectParts = std::move(parts);
    c->connectStream = s;
    return ncclInProgress;
  }
  enqueueOnStream(c, s, std::move(parts));
  return ncclSuccess;
}

ncclResult_t enqueue(ncclComm* c, cudaStream_t s, Part p) {
  std::lock_guard<std::mutex> l(g_mu);
  if (t_groupDepth > 0) {
    if (ncclResult_t r = usable(c)) return r;
    t_groupParts.push_back({c, s, p});
    return ncclSuccess;
  }
  return submit(c, s, {p});
}

}  // namespace

namespace emu_nccl {

Counters counters() {
  std::lock_guard<std::mutex> l(g_mu);
  return g_counters;
}
void reset() {
  std::lock_guard<std::mutex> l(g_mu);
  for (ncclComm* c : g_comms) c->freed = true;
  g_worlds.clear();
  g_counters = {};
  g_failNext.clear();
  g_asyncError.clear();
  g_hangConnect.clear();
  g_hangFinalize.clear();
  g_version = NCCL_VERSION_CODE;
  g_lastError.clear();
}
void setLastError(const char* text) {
  std::lock_guard<std::mutex> l(g_mu);
  g_lastError = text;
}
void failNextEnqueue(int rank, ncclResult_t r) {
  std::lock_guard<std::mutex> l(g_mu);
  g_failNext[rank] = r;
}
void setAsyncError(int rank, ncclResult_t r) {
  std::lock_guard<std::mutex> l(g_mu);
  g_asyncError[rank] = r;
}
void hangConnect(int rank) {
  std::lock_guard<std::mutex> l(g_mu);
  g_hangConnect.insert(rank);
}
void hangFinalize(int rank) {
  std::lock_guard<std::mutex> l(g_mu);
  g_hangFinalize.insert(rank);
}
void setVersion(int version) {
  std::lock_guard<std::mutex> l(g_mu);
  g_version = version;
}

}  // namespace emu_nccl

ncclResult_t ncclGetVersion(int* version) {
  std::lock_guard<std::mutex> l(g_mu);
  *version = g_version;
  return ncclSuccess;
}

const char* ncclGetLastError(ncclComm_t) {
  // (NCCL's is one process-wide buffer too; the tests set it before the failure they cause)
  std::lock_guard<std::mutex> l(g_mu);
  return g_lastError.c_str();
}

const char* ncclGetErrorString(ncclResult_t r) {
  switch (r) {
    case ncclSuccess:
      return "no error";
    case ncclUnhandledCudaError:
      return "unhandled cuda error (run with NCCL_DEBUG=INFO for details)";
    case ncclSystemError:
      return "unhandled system error (run with NCCL_DEBUG=INFO for details)";
    case ncclInternalError:
      return "internal error - please report this issue to the NCCL developers";
    case ncclInvalidArgument:
      return "invalid argument (run with NCCL_DEBUG=WARN for details)";
    case ncclInvalidUsage:
      return "invalid usage (run with NCCL_DEBUG=WARN for details)";
    case ncclRemoteError:
      return "remote process exited or there was a network error";
    case ncclInProgress:
      return "NCCL operation in progress";
  }
  return "unknown result code";
}

ncclResult_t ncclGetUniqueId(ncclUniqueId* id) {
  std::lock_guard<std::mutex> l(g_mu);
  std::memset(id->internal, 0, sizeof(id->internal));
  std::snprintf(id->internal, sizeof(id->internal), "emu-%llu", static_cast<unsigned long long>(++g_idCounter));
  return ncclSuccess;
}

ncclResult_t ncclCommInitRankConfig(ncclComm_t* out, int nranks, ncclUniqueId id, int rank, ncclConfig_t* config) {
  std::unique_lock<std::mutex> l(g_mu);
  if (nranks < 1 || rank < 0 || rank >= nranks) return ncclInvalidArgument;
  auto& w = g_worlds[std::string(id.internal, sizeof(id.internal))];
  if (!w) {
    w = std::make_shared<World>();
    w->size = nranks;
    w->members.assign(static_cast<size_t>(nranks), nullptr);
  }
  if (w->size != nranks || w->members[static_cast<size_t>(rank)]) return ncclInvalidUsage;
  for (ncclComm* m : w->members)
    if (m && m->device == t_device) return ncclInvalidUsage;  // "Duplicate GPU detected"
  auto* c = new ncclComm;
  g_comms.push_back(c);
  c->world = w;
  c->rank = rank;
  c->device = t_device;
  c->blocking = !config || config->blocking != 0;
  w->members[static_cast<size_t>(rank)] = c;
  *out = c;
  if (++w->joined == w->size) {
    for (ncclComm* m : w->members) m->initDone = true;
    g_cv.notify_all();
  }
  if (c->initDone) return ncclSuccess;
  if (!c->blocking) return ncclInProgress;
  g_cv.wait(l, [&] { return c->initDone; });  // as NCCL: no timeout
  return ncclSuccess;
}

ncclResult_t ncclCommInitRank(ncclComm_t* comm, int nranks, ncclUniqueId id, int rank) {
  return ncclCommInitRankConfig(comm, nranks, id, rank, nullptr);
}

ncclResult_t ncclCommGetAsyncError(ncclComm_t c, ncclResult_t* state) {
  std::lock_guard<std::mutex> l(g_mu);
  if (!c) return ncclInvalidArgument;
  if (c->freed) {
    ++g_counters.useAfterAbort;
    return ncclInvalidArgument;
  }
  auto e = g_asyncError.find(c->rank);
  if (!c->initDone) {
    *state = ncclInProgress;
  } else if (c->connecting) {
    if (!g_hangConnect.count(c->rank)) {
      c->connecting = false;
      enqueueOnStream(c, c->connectStream, std::move(c->connectParts));
    }
    *state = c->connecting ? ncclInProgress : c->async;
  } else if (e != g_asyncError.end()) {
    *state = e->second;
  } else if (c->finalizing && (c->outstanding > 0 || g_hangFinalize.count(c->rank))) {
    *state = ncclInProgress;
  } else {
    *state = c->async;
  }
  return ncclSuccess;
}

ncclResult_t ncclCommFinalize(ncclComm_t c) {
  std::lock_guard<std::mutex> l(g_mu);
  if (ncclResult_t r = usable(c)) return r;
  c->finalizing = true;
  return c->blocking || (c->outstanding == 0 && !g_hangFinalize.count(c->rank)) ? ncclSuccess : ncclInProgress;
}

ncclResult_t ncclCommDestroy(ncclComm_t c) {
  std::lock_guard<std::mutex> l(g_mu);
  if (!c) return ncclInvalidArgument;
  if (c->freed) {
    ++g_counters.useAfterAbort;
    return ncclInvalidArgument;
  }
  ++(c->outstanding > 0 ? g_counters.hungDestroys : g_counters.destroys);
  c->freed = true;
  return ncclSuccess;
}

ncclResult_t ncclCommAbort(ncclComm_t c) {
  std::lock_guard<std::mutex> l(g_mu);
  if (!c) return ncclSuccess;
  if (c->freed) {
    ++g_counters.useAfterAbort;
    return ncclInvalidArgument;
  }
  ++g_counters.aborts;
  c->freed = true;
  c->world->broken = true;
  // Its kernels see the abort and exit: the stream drains, the events complete (over data
  // that is not the result).
  for (auto& op : c->live) finish(*op);
  return ncclSuccess;
}

ncclResult_t ncclAllReduce(const void* send, void* recv, size_t count, ncclDataType_t t, ncclRedOp_t op, ncclComm_t c,
                           cudaStream_t s) {
  return enqueue(c, s, Part{Kind::kAllReduce, send, recv, count, t, op, 0, nullptr});
}
ncclResult_t ncclBroadcast(const void* send, void* recv, size_t count, ncclDataType_t t, int root, ncclComm_t c,
                           cudaStream_t s) {
  return enqueue(c, s, Part{Kind::kBroadcast, send, recv, count, t, ncclSum, root, nullptr});
}
ncclResult_t ncclAllGather(const void* send, void* recv, size_t sendCount, ncclDataType_t t, ncclComm_t c,
                           cudaStream_t s) {
  return enqueue(c, s, Part{Kind::kAllGather, send, recv, sendCount, t, ncclSum, 0, nullptr});
}
ncclResult_t ncclReduceScatter(const void* send, void* recv, size_t recvCount, ncclDataType_t t, ncclRedOp_t op,
                               ncclComm_t c, cudaStream_t s) {
  return enqueue(c, s, Part{Kind::kReduceScatter, send, recv, recvCount, t, op, 0, nullptr});
}
ncclResult_t ncclSend(const void* send, size_t count, ncclDataType_t t, int peer, ncclComm_t c, cudaStream_t s) {
  return enqueue(c, s, Part{Kind::kSend, send, nullptr, count, t, ncclSum, peer, nullptr});
}
ncclResult_t ncclRecv(void* recv, size_t count, ncclDataType_t t, int peer, ncclComm_t c, cudaStream_t s) {
  return enqueue(c, s, Part{Kind::kRecv, nullptr, recv, count, t, ncclSum, peer, nullptr});
}
ncclResult_t ncclGroupStart() {
  std::lock_guard<std::mutex> l(g_mu);
  ++t_groupDepth;
  return ncclSuccess;
}
// Each communicator's grouped parts become one stream operation (on the stream of its first
// part), so a grouped send and recv complete together, as NCCL runs them as one kernel.
ncclResult_t ncclGroupEnd() {
  std::lock_guard<std::mutex> l(g_mu);
  if (t_groupDepth == 0) return ncclInvalidUsage;
  if (--t_groupDepth > 0) return ncclSuccess;
  std::vector<GroupedPart> parts;
  parts.swap(t_groupParts);
  ncclResult_t result = ncclSuccess;
  while (!parts.empty()) {
    ncclComm* c = parts.front().comm;
    cudaStream_t s = parts.front().stream;
    std::vector<Part> mine;
    std::vector<GroupedPart> rest;
    for (GroupedPart& g : parts) (g.comm == c ? mine.push_back(g.part) : rest.push_back(g));
    parts.swap(rest);
    const ncclResult_t r = submit(c, s, std::move(mine));
    if (result == ncclSuccess || result == ncclInProgress) result = r == ncclSuccess ? result : r;
  }
  return result;
}
