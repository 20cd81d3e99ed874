#pragma once
// Collectives for data-parallel training. Contract (as in MPI, gloo and NCCL): every rank
// issues the same collectives in the same order; an operation's buffers must stay valid and
// untouched until its Work completes.
//
// Thread-safety: a Communicator may be called from several threads, but operations are
// executed in the order they were issued, one at a time. Async operations run on the
// communicator's own thread; a blocking call (allreduce(), send(), ...) may instead run on
// the calling thread when nothing issued earlier is still queued or running (the tcp backend
// does, saving two thread hand-offs per operation). Either way the ordering, the errors and
// the buffers' lifetime rules are those of XxxAsync(...)->wait().
#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "dtrain/comm/types.h"
#include "dtrain/store/store.h"

namespace dtrain::comm {

using Duration = std::chrono::milliseconds;

// Handle of an asynchronous operation.
class Work {
 public:
  virtual ~Work() = default;
  // Blocks until done; rethrows the operation's error (PeerLostError, TimeoutError, ...).
  virtual void wait() = 0;
  // True when done (successfully or not); never blocks.
  virtual bool test() = 0;
  // When the operation ran on the host's steady clock, from the start of its work to its end
  // (not its time queued behind earlier ones), where the backend knows it (tcp; not nccl,
  // whose work runs on the GPU). Only after wait() returned without an error.
  struct Span {
    std::chrono::steady_clock::time_point start, end;
  };
  virtual std::optional<Span> ranAt() const { return std::nullopt; }
};

using WorkPtr = std::shared_ptr<Work>;

// Memory for a communicator's buffers: host memory for tcp, device memory on the
// communicator's GPU for nccl. For code that stages data without knowing the backend (dtrain
// bench). Owns the memory; not copyable; must not outlive its communicator.
class Buffer {
 public:
  virtual ~Buffer() = default;
  virtual void* data() = 0;
  virtual size_t bytes() const = 0;
  // Copies `n` bytes (at most bytes()) from host memory into the buffer, or back out.
  // Synchronous: the copy has finished when they return.
  virtual void upload(const void* host, size_t n) = 0;
  virtual void download(void* host, size_t n) const = 0;
};

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual const char* backend() const = 0;
  // How collective data moves: "shm" (same-host shared memory) or "tcp" for the tcp backend,
  // the backend's name otherwise.
  virtual const char* transport() const { return backend(); }
  // The same for send, recv and sendRecv (the tcp backend keeps them on TCP where per-pair
  // shared-memory channels would not scale; see docs/collectives.md).
  virtual const char* p2pTransport() const { return transport(); }

  // In place: data holds count elements on every rank.
  virtual WorkPtr allreduceAsync(void* data, size_t count, DataType t, ReduceOp op) = 0;
  // In place: root's count elements end up on every rank.
  virtual WorkPtr broadcastAsync(void* data, size_t count, DataType t, int root) = 0;
  // send: count elements; recv: size()*count elements, rank r's block at r*count.
  virtual WorkPtr allgatherAsync(const void* send, void* recv, size_t count, DataType t) = 0;
  // send: size()*recvCount elements; rank r receives the reduction of every rank's block r.
  virtual WorkPtr reduceScatterAsync(const void* send, void* recv, size_t recvCount, DataType t, ReduceOp op) = 0;
  virtual WorkPtr barrierAsync() = 0;
  // Point to point; the receiver must expect exactly `bytes`.
  virtual WorkPtr sendAsync(const void* data, size_t bytes, int peer) = 0;
  virtual WorkPtr recvAsync(void* data, size_t bytes, int peer) = 0;
  // Sends to sendPeer and receives from recvPeer at the same time (full duplex), as one
  // operation: the pipeline's "send activation, receive gradient" step. Matches a recv (or
  // the receive half of a sendRecv) on sendPeer and a send (or send half) on recvPeer, so
  // two neighbours exchanging large buffers cannot deadlock on full socket buffers the way
  // send-then-recv on both sides would. The peers may be equal; neither may be this rank.
  virtual WorkPtr sendRecvAsync(const void* sendData, size_t sendBytes, int sendPeer, void* recvData, size_t recvBytes,
                                int recvPeer) = 0;

  // A communicator over some of this one's ranks (MPI_Comm_create_group): `ranks` are ranks
  // of this communicator, distinct, and the position of a rank in the list is its rank in
  // the group. Collective over the listed ranks only: each of them calls it with the same
  // list and name, the others do not; `name` must differ between groups made from one
  // communicator (e.g. "stage0", "stage1"). The group has its own connections and its own
  // executor, so its operations are ordered independently of this communicator's (and can
  // overlap with them). Same backend and options as this one. Throws SpecError when this
  // rank is not in `ranks` or the list is malformed.
  virtual std::unique_ptr<Communicator> group(const std::vector<int>& ranks, const std::string& name) = 0;

  // A buffer of `bytes` where this backend's operations can use it (see Buffer). The
  // default is host memory.
  virtual std::unique_ptr<Buffer> allocate(size_t bytes);

  // Blocking: same as XxxAsync(...)->wait() (see the thread-safety note above).
  void allreduce(void* data, size_t count, DataType t, ReduceOp op) { allreduceBlocking(data, count, t, op); }
  void broadcast(void* data, size_t count, DataType t, int root) { broadcastBlocking(data, count, t, root); }
  void allgather(const void* send, void* recv, size_t count, DataType t) { allgatherBlocking(send, recv, count, t); }
  void reduceScatter(const void* send, void* recv, size_t recvCount, DataType t, ReduceOp op) {
    reduceScatterBlocking(send, recv, recvCount, t, op);
  }
  void barrier() { barrierBlocking(); }
  void send(const void* data, size_t bytes, int peer) { sendBlocking(data, bytes, peer); }
  void recv(void* data, size_t bytes, int peer) { recvBlocking(data, bytes, peer); }
  void sendRecv(const void* sendData, size_t sendBytes, int sendPeer, void* recvData, size_t recvBytes, int recvPeer) {
    sendRecvBlocking(sendData, sendBytes, sendPeer, recvData, recvBytes, recvPeer);
  }

 protected:
  // Execution hooks of the blocking wrappers. The default issues the async op and waits for
  // it. A backend may override them to run the operation on the calling thread, but only
  // with exactly the async op's observable behaviour: it must still execute after every
  // operation issued before it and before every one issued after it (on any thread), one at
  // a time, and fail with the same errors and the same effect on later operations.
  virtual void allreduceBlocking(void* data, size_t count, DataType t, ReduceOp op) {
    allreduceAsync(data, count, t, op)->wait();
  }
  virtual void broadcastBlocking(void* data, size_t count, DataType t, int root) {
    broadcastAsync(data, count, t, root)->wait();
  }
  virtual void allgatherBlocking(const void* send, void* recv, size_t count, DataType t) {
    allgatherAsync(send, recv, count, t)->wait();
  }
  virtual void reduceScatterBlocking(const void* send, void* recv, size_t recvCount, DataType t, ReduceOp op) {
    reduceScatterAsync(send, recv, recvCount, t, op)->wait();
  }
  virtual void barrierBlocking() { barrierAsync()->wait(); }
  virtual void sendBlocking(const void* data, size_t bytes, int peer) { sendAsync(data, bytes, peer)->wait(); }
  virtual void recvBlocking(void* data, size_t bytes, int peer) { recvAsync(data, bytes, peer)->wait(); }
  virtual void sendRecvBlocking(const void* sendData, size_t sendBytes, int sendPeer, void* recvData, size_t recvBytes,
                                int recvPeer) {
    sendRecvAsync(sendData, sendBytes, sendPeer, recvData, recvBytes, recvPeer)->wait();
  }
};

struct CommOptions {
  std::string backend = "tcp";  // "tcp" or "nccl"
  // Every operation must finish within this; a silent or dead peer fails it with
  // PeerLostError naming the rank instead of hanging.
  Duration timeout{std::chrono::seconds(300)};
  // Messages up to this size use recursive doubling (latency); larger ones the ring.
  size_t small_message_bytes = 64 * 1024;
  // Address peers should connect to; "" = the address this host uses to reach the store.
  std::string advertise_addr;
  std::string name = "default";  // distinguishes several communicators of one job
  // tcp backend: when every rank is on the same host (same boot id, host name and network
  // namespace), collectives move data through a shared-memory segment instead of loopback
  // TCP; send/recv and liveness stay on the sockets. Every rank must allow it, otherwise
  // all use TCP. createFromEnvironment: DTRAIN_COMM_SHM=0 turns it off.
  bool shm = true;
  // backend "nccl": when some rank of the job cannot use NCCL (asks for "tcp"), every rank
  // uses "tcp" instead of failing. createFromEnvironment checks that all ranks ask for the
  // same backend (NCCL and TCP ranks would never meet) and fails at once, naming the ranks,
  // when they differ and this does not allow the fallback.
  bool tcp_fallback = false;
  // tcp backend: before each collective every rank posts what it is about to do (operation,
  // count, type, op, root) through the store and checks that all agree; a mismatch fails
  // every rank at once with SpecError naming each rank's call, where it would otherwise give
  // wrong or diverging results in silence. Costs four store round trips per collective: a
  // debugging aid (torch's TORCH_DISTRIBUTED_DEBUG=DETAIL). createFromEnvironment:
  // DTRAIN_COMM_CHECK=1 turns it on.
  bool check = false;
};

// Checks a group() rank list against a communicator of `size` ranks and returns this rank's
// position in it; throws SpecError naming the problem.
int groupRank(const std::vector<int>& ranks, int rank, int size, const std::string& name);

// TCP backend over an existing store (peers meet through it).
std::unique_ptr<Communicator> createTcpCommunicator(std::shared_ptr<store::Store> store, int rank, int size,
                                                    const CommOptions& opts);

// From the environment `dtrain run` gives a worker: RANK, WORLD_SIZE, DTRAIN_STORE_ADDR/PORT/
// TOKEN, DTRAIN_RUN_ID, TORCHELASTIC_RESTART_COUNT, and DTRAIN_COMM_SHM (0: no shared memory,
// see CommOptions::shm). Throws SpecError naming a missing variable.
std::unique_ptr<Communicator> createFromEnvironment(const CommOptions& opts);

// The backend every rank of a communicator about to be created will use (createFromEnvironment
// calls it, through the same store): each rank offers its opts.backend (and tcp_fallback);
// rank 0 decides, all read the decision. Throws SpecError on all ranks, naming who asked for
// what, when the offers cannot agree. One set and one get per rank (rank 0: a multiGet).
std::string agreeOnBackend(store::Store& store, int rank, int size, const CommOptions& opts);

// True when this build has the NCCL backend.
bool ncclAvailable();

}  // namespace dtrain::comm
