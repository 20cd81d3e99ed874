#pragma once
// Same-host shared-memory data path of the "tcp" backend (see docs/collectives.md).
//
// One shared-memory segment per communicator (a memfd that rank 0 creates and the others
// open through /proc/<pid>/fd, so nothing is ever left in /dev/shm) holds, per rank, a
// control block of sequence counters and a ring of `depth` staging buffers of `chunk` bytes
// (8 x 256 KiB). Collectives are cut into chunks; chunk g of the communicator's life uses
// buffer g % depth of every slot, and its steps are published through monotonic 32-bit
// counters (posted / reduced / consumed), so copies, reductions and copy-outs of different
// chunks overlap and the segment stays a few MiB whatever the message size.
//
// Reductions reproduce the TCP path's operand order exactly (ring order per ring segment
// for large messages, recursive-doubling tree order for small ones, the same segment
// boundaries and the same Avg division), so results are bit-identical on every rank AND
// bit-identical to DTRAIN_COMM_SHM=0.
//
// Point-to-point messages use separate channels in the same segment, one per ordered pair of
// ranks (a ring of 4 slots, a `written` counter owned by the sender and a `read` counter
// owned by the receiver), and a doorbell word per rank that every point-to-point
// publication rings; a send/recv never touches the collectives' sequence.
//
// Thread-safety: not thread-safe; the owning communicator calls it for one operation at a
// time (on its executor thread, or inline on the caller of a blocking operation; the
// communicator's lock orders one operation's accesses before the next's). Liveness: the TCP mesh stays connected; while sleeping, waits poll the peer sockets
// for hang-ups and every wait is bounded by the operation's deadline.
#include <sys/types.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "dtrain/comm/types.h"
#include "dtrain/store/store.h"

namespace dtrain::comm::detail {

// The identity ranks compare to decide whether they share a host: boot id, host name and the
// network namespace (so netns-simulated "hosts" on one machine count as different hosts).
std::string hostIdentity();

// Owns one mapping of a shared-memory object (an anonymous memfd: nothing in /dev/shm).
// Move-only.
class ShmMapping {
 public:
  ShmMapping() = default;
  ShmMapping(void* base, size_t bytes) : base_(base), bytes_(bytes) {}
  ~ShmMapping();
  ShmMapping(const ShmMapping&) = delete;
  ShmMapping& operator=(const ShmMapping&) = delete;
  ShmMapping(ShmMapping&& o) noexcept : base_(o.base_), bytes_(o.bytes_) { o.base_ = nullptr; }
  ShmMapping& operator=(ShmMapping&& o) noexcept;
  char* data() const { return static_cast<char*>(base_); }
  size_t size() const { return bytes_; }
  explicit operator bool() const { return base_ != nullptr; }

 private:
  void* base_ = nullptr;
  size_t bytes_ = 0;
};

class ShmTransport {
 public:
  using Clock = std::chrono::steady_clock;
  // Must throw (PeerLostError); called when a wait on `peer` cannot complete. stalled: the
  // deadline passed and `detail` says what was awaited; otherwise the peer hung up.
  using LostFn = std::function<void(int peer, bool stalled, const std::string& detail)>;

  struct Setup {
    store::Store* store = nullptr;
    std::string prefix;    // store key prefix of this communicator ("comm/<name>/")
    std::string nonce;     // the communicator's random nonce (written into the segment, checked by its openers)
    bool enabled = true;   // CommOptions::shm; a rank that opts out makes every rank use TCP
    int rank = 0, size = 1;
    Clock::time_point deadline;
    const std::vector<int>* fds = nullptr;  // peer sockets (liveness), index = rank, -1 = self
    // The job rank of each rank, for messages (null: the same; a group's ranks are not).
    const std::vector<int>* world = nullptr;
    std::string self;  // this rank in messages, as the communicator says it ("": "rank N")
    LostFn lost;
  };

  // Collective over the store: returns a transport when every rank is on the same host (same
  // hostIdentity()), has shm enabled and could map the segment; nullptr otherwise (TCP then
  // carries the data). Every rank reaches the same decision. Throws when a peer does not
  // show up before the deadline, like the mesh set-up.
  static std::unique_ptr<ShmTransport> create(const Setup& s);

  ~ShmTransport();
  ShmTransport(const ShmTransport&) = delete;
  ShmTransport& operator=(const ShmTransport&) = delete;

  // Same contracts as the Communicator methods. smallBytes: the TCP path's
  // small_message_bytes, which picks the operand order to reproduce.
  void allreduce(char* data, size_t count, DataType t, ReduceOp op, size_t smallBytes, Clock::time_point dl);
  void reduceScatter(const char* send, char* recv, size_t count, DataType t, ReduceOp op, Clock::time_point dl);
  void broadcast(char* data, size_t bytes, int root, Clock::time_point dl);
  void allgather(const char* send, char* recv, size_t block, Clock::time_point dl);
  void barrier(Clock::time_point dl);

  // Point-to-point (send, recv and sendRecv: exchange with sendPeer or recvPeer -1 for one
  // direction) over per-pair channels, when the segment has them (p2p()). Same contracts as
  // the Communicator methods, the TCP path's framing included: the receiver checks the
  // sender's size. Independent of the collectives' chunk sequence: only the two ranks of a
  // pair take part. A channel holds p2pDepth() x p2pChunkBytes() in flight; a larger send
  // waits for its receiver, as a TCP send waits when the socket buffers are full.
  bool p2p() const { return p2pChunk_ != 0; }
  // op: the operation's name, for the size-mismatch message.
  void exchange(const char* send, size_t sendBytes, int sendPeer, char* recv, size_t recvBytes, int recvPeer,
                const char* op, Clock::time_point dl);

  size_t chunkBytes() const { return chunk_; }
  size_t p2pChunkBytes() const { return p2pChunk_; }
  size_t p2pDepth() const { return p2pDepth_; }
  size_t depth() const { return depth_; }

  struct Layout;  // shared-memory layout, defined in the .cc
  struct Flag;

 private:
  ShmTransport(const Setup& s, ShmMapping map);

  char* buffer(int rank, uint32_t seq) const;
  Flag& flag(int rank, int which) const;
  void publish(int which, uint32_t value);
  // Blocks until rank `peer`'s counter `which` reaches `target` (wrap-around compare).
  void waitFor(int peer, int which, uint32_t target, Clock::time_point dl);
  void waitAll(int which, uint32_t target, Clock::time_point dl, bool includeSelf = false);
  // Before writing this rank's buffer for chunk `seq`: every rank is done with chunk seq - depth.
  void waitBufferFree(uint32_t seq, Clock::time_point dl);
  void checkPeers();

  // Point-to-point channel src -> dst: `written` counts the pieces src has put in (src
  // writes it), `read` those dst has taken out (dst writes it); piece i is in slot i % depth.
  Flag& written(int src, int dst) const;
  Flag& read(int src, int dst) const;
  char* slot(int src, int dst, uint32_t piece) const;  // a PieceHeader, then the payload
  // Every p2p publication rings the peer's doorbell; a rank waiting for any of its channels
  // sleeps on its own doorbell (an eventcount: no wake-up lost, one futex for both directions).
  void ring(int peer);
  // Waits until the doorbell moved past `seen` (or a short slice passed): spin, yield, then
  // sleep; checks the deadline and whether one of `peers` hung up.
  // peers: the ranks it waits for (the first is named on a timeout).
  void waitDoorbell(uint32_t seen, std::initializer_list<int> peers, Clock::time_point dl,
                    const std::function<std::string()>& progress);
  bool hungUp(int peer) const;  // peer's mesh socket says it exited, was killed or failed

  void ringReduce(char* data, const char* send, char* recv, size_t count, DataType t, ReduceOp op, int shift,
                  bool gather, Clock::time_point dl);
  void replicatedRing(char* data, size_t count, DataType t, ReduceOp op, Clock::time_point dl);
  void treeReduce(char* data, size_t count, DataType t, ReduceOp op, Clock::time_point dl);

  int rank_, size_;
  ShmMapping map_;
  Layout* layout_ = nullptr;
  size_t chunk_ = 0, depth_ = 0;
  size_t p2pChunk_ = 0, p2pDepth_ = 0;
  std::vector<uint32_t> sent_, taken_;  // per peer: pieces written to it / read from it
  uint32_t seq_ = 0;                    // next chunk number; identical on every rank (same op sequence)
  const std::vector<int>* fds_;
  std::vector<int> world_;  // world_[r]: the job rank of rank r (messages)
  int job(int r) const { return world_[static_cast<size_t>(r)]; }
  LostFn lost_;
  const char* waitWhat_ = "";
  bool oversubscribed_ = false;  // more ranks than CPUs: do not spin
  std::vector<char> scratch_;
  volatile unsigned touched_ = 0;  // keeps the pre-touch reads from being optimised away
};

}  // namespace dtrain::comm::detail
