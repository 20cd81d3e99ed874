// TCP backend: a full mesh of nonblocking sockets between ranks, set up through the store.
// Operations run one at a time in issue order: async ones on an executor thread, blocking
// ones on the caller's thread when nothing is queued or running (see runBlocking).
//
// Every transfer goes through Transfer::run, a poll loop that sends and receives at the same
// time (full duplex) and hands received bytes to a callback in fixed-size grains, so a ring
// step reduces data while the rest of it is still arriving.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <functional>
#include <future>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "dtrain/comm/communicator.h"
#include "dtrain/common/errors.h"
#include "dtrain/common/strings.h"
#include "dtrain/store/tcp_store.h"
#include "tcp/shm_transport.h"

namespace dtrain::comm {
namespace {

using Clock = std::chrono::steady_clock;

constexpr uint32_t kHelloMagic = 0x44545243;  // "DTRC"
constexpr size_t kMaxSendPerCall = 1 << 20;
// The longest single poll: a wait past it wakes, finds its deadline not reached, and polls
// again (an hour; poll's int milliseconds hold 24.8 days).
constexpr long long kMaxPollMs = 3600 * 1000;

class FutureWork final : public Work {
 public:
  // `span` is written by the communicator's thread before the future is made ready, so it
  // is read here only after f_ says done.
  FutureWork(std::shared_future<void> f, std::shared_ptr<const Span> span) : f_(std::move(f)), span_(std::move(span)) {}
  void wait() override { f_.get(); }
  bool test() override { return f_.wait_for(std::chrono::seconds(0)) == std::future_status::ready; }
  std::optional<Span> ranAt() const override {
    if (!span_ || f_.wait_for(std::chrono::seconds(0)) != std::future_status::ready) return std::nullopt;
    return *span_;
  }

 private:
  std::shared_future<void> f_;
  std::shared_ptr<const Span> span_;
};

void setNonBlocking(int fd) {
  int flags = ::fcntl(fd, F_GETFL, 0);
  ::fcntl(fd, F_SETFL, flags | O_NONBLOCK);
}

// Socket buffers are left to the kernel: setting SO_SNDBUF/SO_RCVBUF turns autotuning off
// and clamps them to net.core.[rw]mem_max (often 208 KiB), which costs bandwidth.
void tuneSocket(int fd) {
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

std::string secondsText(Duration d) { return fmt::format("{:.3g} s", d.count() / 1000.0); }

class TcpCommunicator final : public Communicator {
 public:
  // world: the job rank of each rank, for messages (empty: the ranks are the job's; group()
  // passes its members' job ranks, so that a message names the rank a user can find).
  TcpCommunicator(std::shared_ptr<store::Store> store, int rank, int size, CommOptions opts,
                  std::vector<int> world = {});
  ~TcpCommunicator() override;
  TcpCommunicator(const TcpCommunicator&) = delete;
  TcpCommunicator& operator=(const TcpCommunicator&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const char* backend() const override { return "tcp"; }
  const char* transport() const override { return shm_ ? "shm" : "tcp"; }
  const char* p2pTransport() const override { return shm_ && shm_->p2p() ? "shm" : "tcp"; }

 private:
  // The operations' bodies, as callables taking the operation's deadline; run() by execute()
  // on whichever thread holds the execution slot. Arguments are checked here, at issue time,
  // so a bad one throws SpecError from the call itself and leaves the communicator usable.
  // CommOptions::check: `fn` runs once every rank has issued this same operation (see
  // agree()); otherwise as it is.
  template <typename F>
  auto checked(F fn, const char* op, size_t count, DataType t, const char* detail = "") {
    std::string what = opts_.check ? fmt::format("{} of {} {}{}", op, count, name(t), detail) : std::string();
    return [this, fn = std::move(fn), what = std::move(what)](Clock::time_point dl) {
      if (!what.empty()) agree(what, dl);
      fn(dl);
    };
  }
  void agree(const std::string& what, Clock::time_point dl);
  uint64_t checked_ = 0;  // operations checked so far (the execution slot's)

  auto allreduceOp(void* data, size_t count, DataType t, ReduceOp op) {
    return checked(
        [=, this](Clock::time_point dl) {
          if (shm_) return shm_->allreduce(static_cast<char*>(data), count, t, op, opts_.small_message_bytes, dl);
          allreduce(static_cast<char*>(data), count, t, op, dl);
        },
        "allreduce", count, t, opts_.check ? fmt::format(" ({})", name(op)).c_str() : "");
  }
  auto broadcastOp(void* data, size_t count, DataType t, int root) {
    checkPeer(root, "broadcast root", /*allowSelf=*/true);
    return checked(
        [=, this](Clock::time_point dl) {
          if (shm_) return shm_->broadcast(static_cast<char*>(data), count * elementSize(t), root, dl);
          broadcast(static_cast<char*>(data), count * elementSize(t), root, dl);
        },
        "broadcast", count, t, opts_.check ? fmt::format(" from rank {}", root).c_str() : "");
  }
  auto allgatherOp(const void* send, void* recv, size_t count, DataType t) {
    return checked(
        [=, this](Clock::time_point dl) {
          if (shm_)
            return shm_->allgather(static_cast<const char*>(send), static_cast<char*>(recv), count * elementSize(t), dl);
          allgather(static_cast<const char*>(send), static_cast<char*>(recv), count * elementSize(t), dl);
        },
        "allgather", count, t);
  }
  auto reduceScatterOp(const void* send, void* recv, size_t recvCount, DataType t, ReduceOp op) {
    return checked(
        [=, this](Clock::time_point dl) {
          if (shm_)
            return shm_->reduceScatter(static_cast<const char*>(send), static_cast<char*>(recv), recvCount, t, op, dl);
          reduceScatter(static_cast<const char*>(send), static_cast<char*>(recv), recvCount, t, op, dl);
        },
        "reduce_scatter", recvCount, t, opts_.check ? fmt::format(" ({})", name(op)).c_str() : "");
  }
  auto barrierOp() {
    return checked(
        [this](Clock::time_point dl) {
          if (shm_) return shm_->barrier(dl);
          int32_t v = 0;
          recursiveDoubling(reinterpret_cast<char*>(&v), 1, DataType::kInt32, ReduceOp::kSum, dl);
        },
        "barrier", 0, DataType::kInt32);
  }
  // A message is an 8-byte length header and the payload, written with one sendmsg (one
  // TCP segment for small messages) and read with one recvmsg where they have arrived.
  auto sendOp(const void* data, size_t bytes, int peer) {
    checkPeer(peer, "send peer", false);
    return [=, this](Clock::time_point dl) {
      if (shm_ && shm_->p2p())
        return shm_->exchange(static_cast<const char*>(data), bytes, peer, nullptr, 0, -1, currentOp_, dl);
      const uint64_t header = bytes;
      transfer(dl).to(peer, static_cast<const char*>(data), bytes).sendHeader(&header).run();
    };
  }
  auto recvOp(void* data, size_t bytes, int peer) {
    checkPeer(peer, "recv peer", false);
    return [=, this](Clock::time_point dl) {
      if (shm_ && shm_->p2p())
        return shm_->exchange(nullptr, 0, -1, static_cast<char*>(data), bytes, peer, currentOp_, dl);
      uint64_t header = 0;
      transfer(dl).from(peer, static_cast<char*>(data), bytes).recvHeader(&header, bytes).run();
    };
  }
  // Same framing as send and recv (a length header, then the payload), both directions in
  // one poll loop, so it matches a plain send/recv on the other side.
  auto sendRecvOp(const void* sendData, size_t sendBytes, int sendPeer, void* recvData, size_t recvBytes, int recvPeer) {
    checkPeer(sendPeer, "sendRecv send peer", false);
    checkPeer(recvPeer, "sendRecv recv peer", false);
    return [=, this](Clock::time_point dl) {
      if (shm_ && shm_->p2p())
        return shm_->exchange(static_cast<const char*>(sendData), sendBytes, sendPeer, static_cast<char*>(recvData),
                              recvBytes, recvPeer, currentOp_, dl);
      const uint64_t out = sendBytes;
      uint64_t in = 0;
      transfer(dl)
          .to(sendPeer, static_cast<const char*>(sendData), sendBytes)
          .sendHeader(&out)
          .from(recvPeer, static_cast<char*>(recvData), recvBytes)
          .recvHeader(&in, recvBytes)
          .run();
    };
  }

 public:
  WorkPtr allreduceAsync(void* data, size_t count, DataType t, ReduceOp op) override {
    return enqueue("allreduce", allreduceOp(data, count, t, op));
  }
  WorkPtr broadcastAsync(void* data, size_t count, DataType t, int root) override {
    return enqueue("broadcast", broadcastOp(data, count, t, root));
  }
  WorkPtr allgatherAsync(const void* send, void* recv, size_t count, DataType t) override {
    return enqueue("allgather", allgatherOp(send, recv, count, t));
  }
  WorkPtr reduceScatterAsync(const void* send, void* recv, size_t recvCount, DataType t, ReduceOp op) override {
    return enqueue("reduce_scatter", reduceScatterOp(send, recv, recvCount, t, op));
  }
  WorkPtr barrierAsync() override { return enqueue("barrier", barrierOp()); }
  WorkPtr sendAsync(const void* data, size_t bytes, int peer) override {
    return enqueue("send", sendOp(data, bytes, peer));
  }
  WorkPtr recvAsync(void* data, size_t bytes, int peer) override { return enqueue("recv", recvOp(data, bytes, peer)); }
  WorkPtr sendRecvAsync(const void* sendData, size_t sendBytes, int sendPeer, void* recvData, size_t recvBytes,
                        int recvPeer) override {
    return enqueue("sendrecv", sendRecvOp(sendData, sendBytes, sendPeer, recvData, recvBytes, recvPeer));
  }
  std::unique_ptr<Communicator> group(const std::vector<int>& ranks, const std::string& name) override {
    const int r = groupRank(ranks, rank_, size_, name);
    CommOptions o = opts_;
    o.name = opts_.name + "/" + name;
    std::vector<int> world;
    for (int x : ranks) world.push_back(job(x));
    return std::make_unique<TcpCommunicator>(store_, r, static_cast<int>(ranks.size()), o, std::move(world));
  }

 protected:
  void allreduceBlocking(void* data, size_t count, DataType t, ReduceOp op) override {
    runBlocking("allreduce", allreduceOp(data, count, t, op));
  }
  void broadcastBlocking(void* data, size_t count, DataType t, int root) override {
    runBlocking("broadcast", broadcastOp(data, count, t, root));
  }
  void allgatherBlocking(const void* send, void* recv, size_t count, DataType t) override {
    runBlocking("allgather", allgatherOp(send, recv, count, t));
  }
  void reduceScatterBlocking(const void* send, void* recv, size_t recvCount, DataType t, ReduceOp op) override {
    runBlocking("reduce_scatter", reduceScatterOp(send, recv, recvCount, t, op));
  }
  void barrierBlocking() override { runBlocking("barrier", barrierOp()); }
  void sendBlocking(const void* data, size_t bytes, int peer) override { runBlocking("send", sendOp(data, bytes, peer)); }
  void recvBlocking(void* data, size_t bytes, int peer) override { runBlocking("recv", recvOp(data, bytes, peer)); }
  void sendRecvBlocking(const void* sendData, size_t sendBytes, int sendPeer, void* recvData, size_t recvBytes,
                        int recvPeer) override {
    runBlocking("sendrecv", sendRecvOp(sendData, sendBytes, sendPeer, recvData, recvBytes, recvPeer));
  }

 private:
  // One poll-driven transfer: optionally send to one peer and receive from one peer at once.
  class Transfer {
   public:
    Transfer(TcpCommunicator& c, Clock::time_point deadline) : c_(c), deadline_(deadline) {}
    Transfer& to(int peer, const char* buf, size_t len) {
      to_ = peer;
      sbuf_ = buf;
      slen_ = len;
      return *this;
    }
    // Sends only as far as *avail (bytes made available by the receive side, for chains).
    Transfer& sendLimit(const size_t* avail) {
      avail_ = avail;
      return *this;
    }
    Transfer& from(int peer, char* buf, size_t len) {
      from_ = peer;
      rbuf_ = buf;
      rlen_ = len;
      return *this;
    }
    // onRecv(begin, end) is called with received byte ranges, in grains (the last may be short).
    Transfer& onRecv(size_t grain, std::function<void(size_t, size_t)> fn) {
      grain_ = grain;
      fn_ = std::move(fn);
      return *this;
    }
    // Streams the receive through a cache-sized bounce buffer of `grain` bytes instead of
    // rbuf: onRecv(begin, end) then finds bytes [begin, end) at bounce[0, end - begin).
    Transfer& streamThrough(char* bounce) {
      bounce_ = bounce;
      return *this;
    }
    // Send the 8-byte message header *h before the payload (send/recv framing).
    Transfer& sendHeader(const uint64_t* h) {
      shead_ = reinterpret_cast<const char*>(h);
      return *this;
    }
    // Receive an 8-byte header into *h before the payload; it must equal `expect` (the
    // receiver's size), checked as soon as it is in, else PeerLostError. Not with onRecv.
    Transfer& recvHeader(uint64_t* h, uint64_t expect) {
      rhead_ = h;
      rheadExpect_ = expect;
      return *this;
    }
    void run();
    size_t received() const { return recvd_; }

   private:
    TcpCommunicator& c_;
    Clock::time_point deadline_;
    int to_ = -1, from_ = -1;
    const char* sbuf_ = nullptr;
    char* rbuf_ = nullptr;
    size_t slen_ = 0, rlen_ = 0, sent_ = 0, recvd_ = 0, delivered_ = 0, grain_ = 0;
    const size_t* avail_ = nullptr;
    char* bounce_ = nullptr;
    std::function<void(size_t, size_t)> fn_;
    const char* shead_ = nullptr;  // header bytes go before sbuf_ (shead_ set: 8 bytes)
    uint64_t* rhead_ = nullptr;
    uint64_t rheadExpect_ = 0;
    size_t sheadDone_ = 0, rheadDone_ = 0;
  };

  Transfer transfer(Clock::time_point dl) { return Transfer(*this, dl); }

  void checkPeer(int peer, const char* what, bool allowSelf) const {
    if (peer < 0 || peer >= size_ || (peer == rank_ && !allowSelf))
      throw SpecError(fmt::format("{} {} is not another rank of this communicator (size {})", what, peer, size_));
  }

  using OpFn = std::function<void(Clock::time_point)>;
  // Async path: queues the operation for the executor thread.
  WorkPtr enqueue(const char* name, OpFn fn);
  // Blocking path: when no operation is queued or running, takes the execution slot and runs
  // fn on the calling thread (no hand-off to the executor and back); otherwise queues it
  // behind the others, like enqueue, and waits. Either way the issue order holds.
  template <typename F>
  void runBlocking(const char* name, F&& fn);
  // Queues a task; mu_ must be held. The caller notifies cv_ after unlocking.
  std::shared_future<void> pushLocked(const char* name, OpFn fn);
  // Runs one operation under the execution slot (busy_), on the executor or on the caller of
  // a blocking op: refuses it once the communicator is broken; a failure other than a
  // SpecError breaks it, leaves the root cause in the store and shuts the sockets down.
  template <typename F>
  void execute(const char* name, F& fn);
  void loop();
  void connectMesh();
  void setupShm();
  // A wait on `peer` cannot complete. stalled: the deadline passed, and `detail` says what
  // this rank was waiting for ("sent 0 of 8 bytes to rank 1, ..."); otherwise the peer hung
  // up or its socket failed, and `detail` says so. Throws PeerLostError naming the rank that
  // holds everyone up, which need not be `peer` (see blame()).
  [[noreturn]] void lost(int peer, bool stalled, const std::string& detail);
  // Where a chain of waits ends: the rank to name, how the last link got to it (true: a wait
  // that timed out; false: a closed connection), and the links after this rank's own
  // (", which waits on rank 2"); via is empty when the chain ends at the awaited peer.
  struct Blame {
    int rank;
    bool stalled;
    std::string via;
  };
  // Records in the store that this rank gave up on `peer` (waits/<rank>: "<peer> waits" or
  // "<peer> lost"), then follows the other ranks' records from `peer` on to the first rank
  // that recorded nothing: a rank that is stopped, hung or dead records nothing, while a rank
  // that was only waiting for it records its own wait when its own deadline passes, nearly
  // when this one's did. On a stall, a missing record is waited for until the grace period
  // ends; a peer that hung up has already followed its chain, so its record is taken as it
  // is. A cycle (ranks waiting on one another) names `peer`. Throws on store errors.
  Blame blame(int peer, bool stalled);
  // How long a stalled rank waits for the records of the ranks it waits on: they time out
  // at nearly the same moment (one operation's skew), so this is short, and bounded by the
  // timeout so that tests with short timeouts stay short.
  Duration blameGrace() const { return std::min<Duration>(std::chrono::seconds(2), opts_.timeout / 4); }
  // Whether `rank` has recorded a wait, waiting for its record until `until` at most (less
  // once every other rank has recorded). Throws on store errors.
  bool recorded(int rank, Clock::time_point until);
  std::string waitsKey(int rank) const { return "comm/" + opts_.name + "/waits/" + std::to_string(rank); }
  std::string waitingKey() const { return "comm/" + opts_.name + "/waiting"; }  // how many have recorded

  void allreduce(char* data, size_t count, DataType t, ReduceOp op, Clock::time_point dl);
  void recursiveDoubling(char* data, size_t count, DataType t, ReduceOp op, Clock::time_point dl);
  void ring(char* data, size_t count, DataType t, ReduceOp op, int shift, bool gather, Clock::time_point dl);
  void broadcast(char* data, size_t bytes, int root, Clock::time_point dl);
  void allgather(const char* send, char* recv, size_t blockBytes, Clock::time_point dl);
  void reduceScatter(const char* send, char* recv, size_t count, DataType t, ReduceOp op, Clock::time_point dl);
  std::string failureKey() const { return "comm/" + opts_.name + "/failure"; }
  // For messages: rank r's rank in the job, and this rank as a user finds it ("rank 3", or in
  // a group "rank 3 (rank 1 of communicator "default/stage1")").
  int job(int r) const { return world_[static_cast<size_t>(r)]; }
  std::string self() const {
    return group_ ? fmt::format("rank {} (rank {} of communicator \"{}\")", job(rank_), rank_, opts_.name)
                  : fmt::format("rank {}", rank_);
  }
  std::string jobRanks(const std::vector<int>& ranks) const {
    std::vector<int> j;
    for (int r : ranks) j.push_back(job(r));
    return fmt::format("{}", fmt::join(j, ", "));
  }
  char* scratch(size_t bytes) {
    if (scratch_.size() < bytes) scratch_.resize(bytes);
    return scratch_.data();
  }

  std::shared_ptr<store::Store> store_;
  int rank_, size_;
  CommOptions opts_;
  std::vector<int> world_;  // world_[r]: the job rank of rank r
  bool group_;              // made by group(): its ranks are not the job's
  std::vector<int> fds_;
  std::vector<char> scratch_;
  // Same-host data path for collectives; null when TCP carries them. Used by whichever thread
  // holds the execution slot; the sockets above stay connected as its liveness channel.
  std::unique_ptr<detail::ShmTransport> shm_;
  const char* currentOp_ = "";

  // Execution state. fds_ data, scratch_, shm_ and currentOp_ are touched only by the thread
  // holding the execution slot (busy_ set under mu_); taking and releasing the slot under
  // mu_ orders one operation's accesses before the next's.
  std::mutex mu_;
  std::condition_variable cv_;  // the executor waits on it for work and for a free slot
  std::deque<std::packaged_task<void()>> queue_;
  bool busy_ = false;  // an operation is running (on the executor or inline on a caller)
  bool stopping_ = false;
  std::string broken_;  // first failure; later operations fail at once
  std::thread thread_;
};

TcpCommunicator::TcpCommunicator(std::shared_ptr<store::Store> store, int rank, int size, CommOptions opts,
                                 std::vector<int> world)
    : store_(std::move(store)),
      rank_(rank),
      size_(size),
      opts_(std::move(opts)),
      world_(std::move(world)),
      group_(!world_.empty()),
      fds_(static_cast<size_t>(std::max(size, 0)), -1) {
  if (size < 1 || rank < 0 || rank >= size)
    throw SpecError(fmt::format("communicator: rank {} is not within world size {}", rank, size));
  if (world_.empty())
    for (int r = 0; r < size; ++r) world_.push_back(r);
  DTRAIN_CHECK(world_.size() == static_cast<size_t>(size));
  try {
    connectMesh();
    setupShm();
  } catch (...) {
    for (int& fd : fds_)
      if (fd >= 0) ::close(fd);
    throw;
  }
  thread_ = std::thread([this] { loop(); });
}

TcpCommunicator::~TcpCommunicator() {
  {
    std::lock_guard<std::mutex> l(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  for (int fd : fds_)
    if (fd >= 0) ::close(fd);
}

void TcpCommunicator::connectMesh() {
  if (size_ == 1) return;
  auto deadline = Clock::now() + opts_.timeout;
  std::string addr = opts_.advertise_addr.empty() ? "127.0.0.1" : opts_.advertise_addr;
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICHOST | AI_PASSIVE;
  addrinfo* res = nullptr;
  if (::getaddrinfo(addr.c_str(), "0", &hints, &res) != 0 || !res)
    throw SpecError(fmt::format("communicator: advertise address '{}' is not a numeric IP address", addr));
  int lfd = ::socket(res->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  int one = 1;
  ::setsockopt(lfd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (lfd < 0 || ::bind(lfd, res->ai_addr, res->ai_addrlen) != 0 || ::listen(lfd, size_ + 16) != 0) {
    ::freeaddrinfo(res);
    if (lfd >= 0) ::close(lfd);
    throwErrno(fmt::format("communicator: listen on {}", addr));
  }
  ::freeaddrinfo(res);
  sockaddr_storage ss{};
  socklen_t sl = sizeof(ss);
  ::getsockname(lfd, reinterpret_cast<sockaddr*>(&ss), &sl);
  int port = ntohs(ss.ss_family == AF_INET ? reinterpret_cast<sockaddr_in*>(&ss)->sin_port
                                           : reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port);
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{lfd};

  std::string prefix = "comm/" + opts_.name + "/";
  std::string nonce = store_->compareSet(prefix + "nonce", "", store::randomBytes(16));
  store_->set(prefix + "addr/" + std::to_string(rank_), fmt::format("{}\t{}", addr, port));

  // Connect to every higher rank; they accept. Connections complete in the listen backlog,
  // so the order cannot deadlock.
  for (int j = rank_ + 1; j < size_; ++j) {
    try {
      store_->wait({prefix + "addr/" + std::to_string(j)}, std::chrono::duration_cast<Duration>(deadline - Clock::now()));
    } catch (const TimeoutError& e) {
      throw PeerLostError(fmt::format("communicator \"{}\" set-up on {}: lost rank {}: it did not publish its "
                                      "address (not started, or failed before it): {}",
                                      opts_.name, self(), job(j), e.what()));
    }
    auto parts = split(store_->get(prefix + "addr/" + std::to_string(j)), '\t');
    if (parts.size() != 2) throw PeerLostError(fmt::format("communicator \"{}\": rank {} published a bad address", opts_.name, job(j)));
    addrinfo h{};
    h.ai_family = AF_UNSPEC;
    h.ai_socktype = SOCK_STREAM;
    addrinfo* r = nullptr;
    if (::getaddrinfo(parts[0].c_str(), parts[1].c_str(), &h, &r) != 0 || !r)
      throw PeerLostError(
          fmt::format("communicator \"{}\": cannot resolve rank {}'s address {}:{}", opts_.name, job(j), parts[0], parts[1]));
    int fd = -1;
    std::string lastErr;
    // Rank j listens from before it publishes its address until every lower rank has
    // connected, and a full backlog drops connections rather than refusing them: refusals
    // that go on mean j is gone (killed after publishing) or a firewall rejects the port.
    // Either way waiting out the whole timeout helps no one; a short grace is left for a
    // network that refuses while it settles.
    constexpr auto kRefusedGrace = std::chrono::seconds(2);
    std::optional<Clock::time_point> refusedSince;
    while (true) {
      fd = ::socket(r->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
      if (::connect(fd, r->ai_addr, r->ai_addrlen) == 0) break;
      const int err = errno;
      lastErr = std::strerror(err);
      ::close(fd);
      fd = -1;
      if (err != ECONNREFUSED) refusedSince.reset();
      else if (!refusedSince) refusedSince = Clock::now();
      if (Clock::now() >= deadline || (refusedSince && Clock::now() - *refusedSince >= kRefusedGrace)) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    ::freeaddrinfo(r);
    if (fd < 0 && refusedSince)
      throw PeerLostError(fmt::format("communicator \"{}\" set-up on {}: lost rank {}: its address {}:{} refused "
                                      "connections for {} (the process exited or was killed after it published the "
                                      "address; or that address, the one it reaches the store from, is not one this "
                                      "host can reach it at; or a firewall rejects the port)",
                                      opts_.name, self(), job(j), parts[0], parts[1],
                                      secondsText(std::chrono::duration_cast<Duration>(Clock::now() - *refusedSince))));
    if (fd < 0)
      throw PeerLostError(fmt::format("communicator \"{}\": cannot connect to rank {} at {}:{}: {}", opts_.name, job(j),
                                      parts[0], parts[1], lastErr));
    tuneSocket(fd);
    std::string hello(8, '\0');
    uint32_t m = htonl(kHelloMagic), rk = htonl(static_cast<uint32_t>(rank_));
    std::memcpy(hello.data(), &m, 4);
    std::memcpy(hello.data() + 4, &rk, 4);
    hello += nonce;
    if (::send(fd, hello.data(), hello.size(), MSG_NOSIGNAL) != static_cast<ssize_t>(hello.size())) {
      ::close(fd);
      throw PeerLostError(fmt::format("communicator \"{}\": lost rank {} during set-up", opts_.name, job(j)));
    }
    setNonBlocking(fd);
    fds_[static_cast<size_t>(j)] = fd;
  }
  // Accept every lower rank. Connections are read side by side, each for its hello (8 + 16
  // bytes, sent right after connect): a stranger that connects and says nothing (a port
  // scanner, a stale peer) cannot hold up the ranks queued behind it, as one read at a time,
  // 5 s each, did (10 such made set-up time out while rank 0 waited in the queue).
  struct Pending {
    int fd;
    std::string hello;
    Clock::time_point until;
  };
  std::vector<Pending> pending;
  constexpr size_t kMaxPending = 64;  // (beyond: the oldest goes; a rank says its hello at once)
  int strangers = 0;
  auto drop = [&](size_t i) {
    ::close(pending[i].fd);
    pending.erase(pending.begin() + static_cast<long>(i));
  };
  for (int accepted = 0; accepted < rank_;) {
    const auto now = Clock::now();
    for (size_t i = 0; i < pending.size();)
      if (now >= pending[i].until) {
        ++strangers;
        drop(i);
      } else {
        ++i;
      }
    auto wakeAt = deadline;
    for (const auto& q : pending) wakeAt = std::min(wakeAt, q.until);
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(wakeAt - now).count();
    std::vector<pollfd> fds{{lfd, POLLIN, 0}};
    for (const auto& q : pending) fds.push_back({q.fd, POLLIN, 0});
    // (capped: a timeout past 24.8 days of milliseconds wrapped negative, which polls for ever)
    int r = left > 0 ? ::poll(fds.data(), fds.size(), static_cast<int>(std::min<long long>(left, kMaxPollMs))) : 0;
    if (r < 0 && errno == EINTR) continue;  // a signal handler ran: the deadline still holds
    if (r <= 0 && Clock::now() >= deadline) {
      std::vector<int> missing;
      for (int j = 0; j < rank_; ++j)
        if (fds_[static_cast<size_t>(j)] < 0) missing.push_back(j);
      for (const auto& q : pending) ::close(q.fd);
      // A lower rank connects to the higher ones in order, each once it has published its
      // address: one that has published but not connected here is held up by a rank before
      // this one in its order, while one that never published is the rank that holds up
      // everyone (not started, stopped, or failed before it); that one is named.
      int unpublished = -1;
      try {
        for (int j : missing)
          if (!store_->check({prefix + "addr/" + std::to_string(j)})) {
            unpublished = j;
            break;
          }
      } catch (const std::exception&) {
      }
      const std::string lost =
          unpublished >= 0 ? fmt::format("lost rank {}: it did not publish its address (not started, stopped, or failed "
                                         "before it); ",
                                         job(unpublished))
                           : std::string();
      throw PeerLostError(fmt::format(
          "communicator \"{}\" set-up on {}: {}timed out after {} waiting for rank(s) {} to connect{}", opts_.name, self(),
          lost, secondsText(opts_.timeout), jobRanks(missing),
          strangers + pending.size() > 0
              ? fmt::format(" ({} other connection(s) to this rank's port said no hello of this job's ranks)",
                            strangers + static_cast<int>(pending.size()))
              : std::string()));
    }
    if (r <= 0) continue;
    // Hellos first (the listener's new connections are taken after, in this same turn).
    for (size_t k = fds.size(); k-- > 1;) {
      if (!(fds[k].revents & (POLLIN | POLLHUP | POLLERR))) continue;
      Pending& q = pending[k - 1];
      char buf[24];
      const ssize_t n = ::recv(q.fd, buf, 24 - q.hello.size(), 0);
      if (n < 0 && (errno == EINTR || errno == EAGAIN)) continue;
      if (n <= 0) {
        ++strangers;
        drop(k - 1);
        continue;
      }
      q.hello.append(buf, static_cast<size_t>(n));
      if (q.hello.size() < 24) continue;
      uint32_t m, rk;
      std::memcpy(&m, q.hello.data(), 4);
      std::memcpy(&rk, q.hello.data() + 4, 4);
      m = ntohl(m);
      rk = ntohl(rk);
      if (m != kHelloMagic || q.hello.substr(8) != nonce || rk >= static_cast<uint32_t>(rank_) || fds_[rk] >= 0) {
        ++strangers;  // a stray or stale connection: not one of ours
        drop(k - 1);
        continue;
      }
      const int fd = q.fd;
      pending.erase(pending.begin() + static_cast<long>(k - 1));
      tuneSocket(fd);
      fds_[rk] = fd;
      ++accepted;
    }
    if (fds[0].revents & POLLIN) {
      int fd = ::accept4(lfd, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
      if (fd < 0) continue;
      if (pending.size() >= kMaxPending) {
        ++strangers;
        drop(0);
      }
      pending.push_back({fd, std::string(), std::min(deadline, Clock::now() + std::chrono::seconds(5))});
    }
  }
  for (const auto& q : pending) ::close(q.fd);
}

void TcpCommunicator::setupShm() {
  if (size_ == 1) return;
  std::string prefix = "comm/" + opts_.name + "/";
  detail::ShmTransport::Setup s;
  s.store = store_.get();
  s.prefix = prefix;
  s.nonce = store_->get(prefix + "nonce");
  s.enabled = opts_.shm;
  s.rank = rank_;
  s.size = size_;
  s.deadline = Clock::now() + opts_.timeout;
  s.fds = &fds_;
  s.world = &world_;
  s.self = self();
  s.lost = [this](int peer, bool stalled, const std::string& detail) { lost(peer, stalled, detail); };
  shm_ = detail::ShmTransport::create(s);
}

template <typename F>
void TcpCommunicator::execute(const char* name, F& fn) {
  {
    std::lock_guard<std::mutex> l(mu_);
    if (!broken_.empty())
      throw PeerLostError(fmt::format("{}: communicator is unusable after an earlier failure: {}", name, broken_));
  }
  currentOp_ = name;
  try {
    fn(Clock::now() + opts_.timeout);
  } catch (const SpecError&) {
    throw;
  } catch (const std::exception& e) {
    {
      std::lock_guard<std::mutex> l(mu_);
      broken_ = e.what();
    }
    // Leave the root cause where peers can find it (first failure wins), then close our
    // sockets: that tells every peer at once, instead of letting them time out.
    try {
      store_->compareSet(failureKey(), "", e.what());
    } catch (const std::exception&) {
    }
    for (int fd : fds_)
      if (fd >= 0) ::shutdown(fd, SHUT_RDWR);
    throw;
  }
}

std::shared_future<void> TcpCommunicator::pushLocked(const char* name, OpFn fn) {
  std::packaged_task<void()> task([this, name, fn = std::move(fn)] { execute(name, fn); });
  auto f = task.get_future().share();
  queue_.push_back(std::move(task));
  return f;
}

WorkPtr TcpCommunicator::enqueue(const char* name, OpFn fn) {
  std::shared_future<void> f;
  auto span = std::make_shared<Work::Span>();
  {
    std::lock_guard<std::mutex> l(mu_);
    f = pushLocked(name, [span, fn = std::move(fn)](Clock::time_point deadline) {
      span->start = Clock::now();
      fn(deadline);
      span->end = Clock::now();
    });
  }
  cv_.notify_one();
  return std::make_shared<FutureWork>(std::move(f), std::move(span));
}

template <typename F>
void TcpCommunicator::runBlocking(const char* name, F&& fn) {
  std::unique_lock<std::mutex> l(mu_);
  if (!queue_.empty() || busy_) {
    // Earlier operations are pending: go behind them (queued under the same lock hold as the
    // check, so nothing issued later can overtake this one).
    auto f = pushLocked(name, OpFn(std::forward<F>(fn)));
    l.unlock();
    cv_.notify_one();
    f.get();
    return;
  }
  busy_ = true;
  l.unlock();
  // Releases the slot however fn ends, and hands the executor what was queued meanwhile.
  struct Release {
    TcpCommunicator& c;
    ~Release() {
      bool pending;
      {
        std::lock_guard<std::mutex> g(c.mu_);
        c.busy_ = false;
        pending = !c.queue_.empty();
      }
      if (pending) c.cv_.notify_one();
    }
  } release{*this};
  execute(name, fn);
}

void TcpCommunicator::loop() {
  while (true) {
    std::packaged_task<void()> task;
    {
      std::unique_lock<std::mutex> l(mu_);
      // A queued task waits while a blocking op runs inline on a caller's thread.
      cv_.wait(l, [&] { return (!queue_.empty() && !busy_) || (stopping_ && queue_.empty()); });
      if (queue_.empty()) return;  // stopping, and every issued operation has run
      task = std::move(queue_.front());
      queue_.pop_front();
      busy_ = true;
    }
    task();  // a packaged_task keeps the operation's exception for its future
    std::lock_guard<std::mutex> l(mu_);
    busy_ = false;
  }
}

bool TcpCommunicator::recorded(int rank, Clock::time_point until) {
  const std::string key = waitsKey(rank);
  // Slices of the wait between looks at the count: longer with more ranks, so that a large
  // job's ranks all waiting out their grace do not flood the store.
  const Duration slice = std::max<Duration>(Duration(50), Duration(size_));
  while (true) {
    if (store_->check({key})) return true;
    const auto left = std::chrono::duration_cast<Duration>(until - Clock::now());
    if (left < Duration(1)) return false;
    // Every other rank has recorded: nobody but this one can be holding them up.
    if (store_->add(waitingKey(), 0) >= size_ - 1) return store_->check({key});
    try {
      store_->wait({key}, std::min(left, slice));
      return true;
    } catch (const TimeoutError&) {
    }
  }
}

TcpCommunicator::Blame TcpCommunicator::blame(int peer, bool stalled) {
  store_->set(waitsKey(rank_), fmt::format("{} {}", peer, stalled ? "waits" : "lost"));
  store_->add(waitingKey(), 1);
  const auto graceEnd = Clock::now() + (stalled ? blameGrace() : Duration(0));
  Blame b{peer, stalled, ""};
  std::vector<int> seen{rank_};
  while (true) {
    if (std::find(seen.begin(), seen.end(), b.rank) != seen.end()) return {peer, stalled, ""};
    seen.push_back(b.rank);
    if (!recorded(b.rank, b.stalled ? graceEnd : Clock::now())) return b;
    const auto parts = split(store_->get(waitsKey(b.rank)), ' ');
    if (parts.size() != 2 || (parts[1] != "waits" && parts[1] != "lost"))
      throw PeerLostError(fmt::format("rank {} recorded a malformed wait", job(b.rank)));
    const int next = static_cast<int>(parseInteger(parts[0], "a recorded wait", 0, size_ - 1));
    b.stalled = parts[1] == "waits";
    b.via += fmt::format(", which {} rank {}", b.stalled ? "waits on" : "lost", job(next));
    b.rank = next;
  }
}

// Each rank posts what it is about to do as the communicator's operation #n and reads every
// rank's: ranks that disagree (another count, type, op or root, or another operation) would
// otherwise go on with wrong or diverging results and say nothing (over shared memory a
// shorter allreduce simply leaves the longer one's tail unreduced). All ranks read the same
// posts, so all refuse alike, with SpecError (a program's mistake: no restart fixes it). A rank
// that never posts #n (it issues nothing more, or has died) is named as lost at the deadline.
// A rank's post #n-1 is removed once #n has been read from every rank: all have read #n-1 then.
void TcpCommunicator::agree(const std::string& what, Clock::time_point dl) {
  const uint64_t n = checked_++;
  auto key = [&](uint64_t op, int r) { return fmt::format("comm/{}/check/{}/{}", opts_.name, op, r); };
  store_->set(key(n, rank_), what);
  std::vector<std::string> keys;
  for (int r = 0; r < size_; ++r) keys.push_back(key(n, r));
  // Waited for in short slices: a store client shared with other communicators (group()) is
  // not held by one wait for the operation's whole timeout.
  for (;;) {
    const auto left = std::chrono::duration_cast<Duration>(dl - Clock::now());
    try {
      store_->wait(keys, std::clamp(left, Duration(1), Duration(std::chrono::milliseconds(100))));
      break;
    } catch (const TimeoutError&) {
      if (Clock::now() < dl) continue;
    }
    std::vector<int> missing;
    try {
      for (int r = 0; r < size_; ++r)
        if (!store_->check({keys[static_cast<size_t>(r)]})) missing.push_back(r);
    } catch (const std::exception& e) {
      throw PeerLostError(fmt::format("{} on {}: the store failed while the ranks' posts of operation #{} were "
                                      "awaited (DTRAIN_COMM_CHECK): {}",
                                      currentOp_, self(), n, e.what()));
    }
    if (missing.empty()) break;  // (all came at the deadline)
    throw PeerLostError(fmt::format("{} on {}: lost rank {}: it did not issue operation #{} ({}) within the {} "
                                    "timeout (DTRAIN_COMM_CHECK; ranks not there: {})",
                                    currentOp_, self(), job(missing.front()), n, what, secondsText(opts_.timeout),
                                    jobRanks(missing)));
  }
  const std::vector<store::Bytes> posts = store_->multiGet(keys);
  if (n > 0) store_->deleteKey(key(n - 1, rank_));
  std::vector<std::pair<std::string, std::vector<int>>> groups;  // what, the ranks doing it
  for (int r = 0; r < size_; ++r) {
    const std::string& p = posts[static_cast<size_t>(r)];
    auto g = std::find_if(groups.begin(), groups.end(), [&](const auto& x) { return x.first == p; });
    if (g == groups.end()) g = groups.insert(groups.end(), {p, {}});
    g->second.push_back(r);
  }
  if (groups.size() == 1) return;
  std::vector<std::string> said;
  for (const auto& [p, ranks] : groups)
    said.push_back(fmt::format("rank{} {} {}", ranks.size() == 1 ? "" : "s", jobRanks(ranks), oneLine(p)));
  throw SpecError(fmt::format("{} on {}: the ranks disagree on operation #{} of communicator \"{}\" "
                              "(DTRAIN_COMM_CHECK): {}; every rank must issue the same collectives in the same "
                              "order, with the same count, type, op and root",
                              currentOp_, self(), n, opts_.name, fmt::join(said, "; ")));
}

void TcpCommunicator::lost(int peer, bool stalled, const std::string& detail) {
  Blame b{peer, stalled, ""};
  try {
    b = blame(peer, stalled);
  } catch (const std::exception&) {
    // The store failed (or held nonsense): name the awaited peer, as before there were records.
    b = {peer, stalled, ""};
  }
  // (the deadline is the operation's, from its start: data may have been moving, only too
  // slowly, so "no progress" would blame a healthy peer on a slow link)
  const std::string noProgress = fmt::format("not done within the {} per-operation timeout", secondsText(opts_.timeout));
  const char* ask = "; is it stopped or overloaded, or the timeout too short for this size?";
  std::string why;
  if (b.rank == peer) {
    why = stalled ? fmt::format("{} ({}){}", noProgress, detail, ask) : detail;
  } else {
    why = fmt::format("{} (rank {} waited on rank {}{}; {}){}", b.stalled ? noProgress : "connection closed or reset",
                      job(rank_), job(peer), b.via,
                      stalled ? detail : fmt::format("rank {} failed and closed its connections", job(peer)),
                      b.stalled ? ask : "");
  }
  std::string msg = fmt::format("{} on {}: lost rank {}: {}", currentOp_, self(), job(b.rank), why);
  // A peer that gave up on someone else closes its sockets too; say what it saw.
  try {
    if (store_->check({failureKey()})) msg += fmt::format(" [first failure in this job: {}]", store_->get(failureKey()));
  } catch (const std::exception&) {
  }
  throw PeerLostError(msg);
}

// Tries both directions without waiting and polls only when neither can move: fewer
// syscalls and wake-ups than polling before every call. A send/recv header travels in the
// same sendmsg/recvmsg call as the start of its payload.
void TcpCommunicator::Transfer::run() {
  constexpr size_t kHead = sizeof(uint64_t);
  auto& fds = c_.fds_;
  const int rfd = from_ >= 0 ? fds[static_cast<size_t>(from_)] : -1;
  const int sfd = to_ >= 0 ? fds[static_cast<size_t>(to_)] : -1;
  const size_t sheadLen = shead_ ? kHead : 0, rheadLen = rhead_ ? kHead : 0;
  auto sending = [&](size_t limit) { return sheadDone_ < sheadLen || sent_ < limit; };
  auto receiving = [&] { return rheadDone_ < rheadLen || recvd_ < rlen_; };
  while (sending(slen_) || receiving()) {
    bool progress = false;
    if (receiving()) {
      ssize_t n;
      size_t head = 0;  // header bytes among the n received
      if (rheadDone_ < rheadLen) {
        iovec iov[2] = {{reinterpret_cast<char*>(rhead_) + rheadDone_, rheadLen - rheadDone_}, {rbuf_ + recvd_, rlen_ - recvd_}};
        msghdr m{};
        m.msg_iov = iov;
        m.msg_iovlen = rlen_ > recvd_ ? 2 : 1;
        n = ::recvmsg(rfd, &m, 0);
        if (n > 0) head = std::min(static_cast<size_t>(n), rheadLen - rheadDone_);
      } else {
        n = bounce_ ? ::recv(rfd, bounce_ + (recvd_ - delivered_), std::min(rlen_ - recvd_, grain_ - (recvd_ - delivered_)), 0)
                    : ::recv(rfd, rbuf_ + recvd_, rlen_ - recvd_, 0);
      }
      if (n == 0) c_.lost(from_, false, "connection closed (the process exited or was killed)");
      if (n < 0 && errno != EAGAIN && errno != EINTR) c_.lost(from_, false, std::strerror(errno));
      if (n > 0) {
        progress = true;
        if (head) {
          rheadDone_ += head;
          if (rheadDone_ == rheadLen && *rhead_ != rheadExpect_)
            throw PeerLostError(fmt::format("{} from rank {}: expected {} bytes, the peer sent {}", c_.currentOp_,
                                            c_.job(from_), rheadExpect_, *rhead_));
        }
        recvd_ += static_cast<size_t>(n) - head;
        if (fn_) {
          size_t g = grain_ ? grain_ : rlen_;
          while (delivered_ < recvd_ && (recvd_ - delivered_ >= g || recvd_ == rlen_)) {
            size_t end = std::min(recvd_, delivered_ + g);
            if (recvd_ != rlen_) end = delivered_ + (recvd_ - delivered_) / g * g;
            fn_(delivered_, end);
            delivered_ = end;
          }
        }
      }
    }
    size_t limit = avail_ ? std::min(slen_, *avail_) : slen_;
    if (sending(limit)) {
      ssize_t n;
      size_t head = 0;
      if (sheadDone_ < sheadLen) {
        iovec iov[2] = {{const_cast<char*>(shead_ + sheadDone_), sheadLen - sheadDone_},
                        {const_cast<char*>(sbuf_ + sent_), std::min(limit - sent_, kMaxSendPerCall)}};
        msghdr m{};
        m.msg_iov = iov;
        m.msg_iovlen = limit > sent_ ? 2 : 1;
        n = ::sendmsg(sfd, &m, MSG_NOSIGNAL);
        if (n > 0) head = std::min(static_cast<size_t>(n), sheadLen - sheadDone_);
      } else {
        n = ::send(sfd, sbuf_ + sent_, std::min(limit - sent_, kMaxSendPerCall), MSG_NOSIGNAL);
      }
      if (n < 0 && errno != EAGAIN && errno != EINTR) c_.lost(to_, false, std::strerror(errno));
      if (n > 0) {
        progress = true;
        sheadDone_ += head;
        sent_ += static_cast<size_t>(n) - head;
      }
    }
    if (progress || (!sending(slen_) && !receiving())) continue;
    pollfd p[2];
    int np = 0;
    if (receiving()) p[np++] = {rfd, POLLIN, 0};
    if (sending(limit)) {
      if (np == 1 && sfd == rfd)
        p[0].events |= POLLOUT;
      else
        p[np++] = {sfd, POLLOUT, 0};
    }
    // (rounded up: under a millisecond left is a 1 ms poll, not a spin)
    auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline_ - Clock::now()).count();
    int r = left > 0 ? ::poll(p, static_cast<nfds_t>(np), static_cast<int>(std::min<long long>(left, kMaxPollMs))) : 0;
    if (r < 0 && errno == EINTR) continue;
    if (r == 0 && Clock::now() < deadline_) continue;  // (a capped poll ended before the deadline)
    if (r <= 0) {
      std::string progress;
      if (to_ >= 0) progress = fmt::format("sent {} of {} bytes to rank {}", sent_, slen_, c_.job(to_));
      if (from_ >= 0)
        progress += fmt::format("{}received {} of {} {}from rank {}", progress.empty() ? "" : ", ", recvd_, rlen_,
                                progress.empty() ? "bytes " : "", c_.job(from_));
      c_.lost(receiving() ? from_ : to_, true, progress);
    }
  }
}

void TcpCommunicator::allreduce(char* data, size_t count, DataType t, ReduceOp op, Clock::time_point dl) {
  if (size_ == 1 || count == 0) return;
  size_t bytes = count * elementSize(t);
  if (bytes <= opts_.small_message_bytes || count < static_cast<size_t>(size_))
    return recursiveDoubling(data, count, t, op, dl);
  ring(data, count, t, op, 0, true, dl);
}

void TcpCommunicator::recursiveDoubling(char* data, size_t count, DataType t, ReduceOp op, Clock::time_point dl) {
  if (size_ == 1) {
    if (op == ReduceOp::kAvg) finishAvg(data, count, t, 1);
    return;
  }
  size_t bytes = count * elementSize(t);
  char* tmp = scratch(bytes);
  int p2 = 1;
  while (p2 * 2 <= size_) p2 *= 2;
  int extra = size_ - p2;
  if (rank_ >= p2) {  // fold into a partner below p2, get the result back
    transfer(dl).to(rank_ - p2, data, bytes).run();
    transfer(dl).from(rank_ - p2, data, bytes).run();
    return;
  }
  if (rank_ < extra) {
    transfer(dl).from(rank_ + p2, tmp, bytes).run();
    reduceInto(data, tmp, count, t, op);
  }
  for (int mask = 1; mask < p2; mask <<= 1) {
    int partner = rank_ ^ mask;
    transfer(dl).to(partner, data, bytes).from(partner, tmp, bytes).run();
    // The lower rank's value is always the left operand, so both sides get the same bits.
    if (rank_ < partner) {
      reduceInto(data, tmp, count, t, op);
    } else {
      reduceInto(tmp, data, count, t, op);
      std::memcpy(data, tmp, bytes);
    }
  }
  if (op == ReduceOp::kAvg) finishAvg(data, count, t, size_);
  if (rank_ < extra) transfer(dl).to(rank_ + p2, data, bytes).run();
}

// Ring reduce-scatter (then all-gather when `gather`). After the reduce-scatter, rank r holds
// the finished segment (r + 1 - shift) mod n.
void TcpCommunicator::ring(char* data, size_t count, DataType t, ReduceOp op, int shift, bool gather, Clock::time_point dl) {
  const int n = size_;
  const size_t es = elementSize(t);
  auto segBegin = [&](int s) { return count * static_cast<size_t>(s) / static_cast<size_t>(n); };
  auto segCount = [&](int s) { return segBegin(s + 1) - segBegin(s); };
  auto mod = [&](int v) { return ((v % n) + n) % n; };
  int right = mod(rank_ + 1), left = mod(rank_ - 1);
  // Incoming data streams through a 256 KiB bounce buffer (stays in cache) and is reduced
  // grain by grain while the rest is still arriving. 256 KiB is a multiple of every element.
  const size_t grain = 256 * 1024;
  char* bounce = scratch(grain);
  for (int step = 0; step < n - 1; ++step) {
    int sendSeg = mod(rank_ - step - shift), recvSeg = mod(rank_ - step - 1 - shift);
    char* dst = data + segBegin(recvSeg) * es;
    transfer(dl)
        .to(right, data + segBegin(sendSeg) * es, segCount(sendSeg) * es)
        .from(left, nullptr, segCount(recvSeg) * es)
        .onRecv(grain, [&](size_t b, size_t e) { reduceInto(dst + b, bounce, (e - b) / es, t, op); })
        .streamThrough(bounce)
        .run();
  }
  int mine = mod(rank_ + 1 - shift);
  if (op == ReduceOp::kAvg) finishAvg(data + segBegin(mine) * es, segCount(mine), t, n);
  if (!gather) return;
  for (int step = 0; step < n - 1; ++step) {
    int sendSeg = mod(rank_ + 1 - step), recvSeg = mod(rank_ - step);
    transfer(dl)
        .to(right, data + segBegin(sendSeg) * es, segCount(sendSeg) * es)
        .from(left, data + segBegin(recvSeg) * es, segCount(recvSeg) * es)
        .run();
  }
}

// Pipelined chain from the root: each rank forwards what it has received so far.
void TcpCommunicator::broadcast(char* data, size_t bytes, int root, Clock::time_point dl) {
  if (size_ == 1 || bytes == 0) return;
  int pos = (rank_ - root + size_) % size_;
  int prev = (rank_ - 1 + size_) % size_, next = (rank_ + 1) % size_;
  bool last = pos == size_ - 1;
  if (pos == 0) return transfer(dl).to(next, data, bytes).run();
  if (last) return transfer(dl).from(prev, data, bytes).run();
  size_t avail = 0;
  transfer(dl)
      .from(prev, data, bytes)
      .to(next, data, bytes)
      .sendLimit(&avail)
      .onRecv(64 * 1024, [&](size_t, size_t e) { avail = e; })
      .run();
}

void TcpCommunicator::allgather(const char* send, char* recv, size_t block, Clock::time_point dl) {
  if (recv + rank_ * block != send) std::memmove(recv + static_cast<size_t>(rank_) * block, send, block);
  int n = size_;
  int right = (rank_ + 1) % n, left = (rank_ - 1 + n) % n;
  for (int step = 0; step < n - 1; ++step) {
    int sendBlk = ((rank_ - step) % n + n) % n, recvBlk = ((rank_ - step - 1) % n + n) % n;
    transfer(dl)
        .to(right, recv + static_cast<size_t>(sendBlk) * block, block)
        .from(left, recv + static_cast<size_t>(recvBlk) * block, block)
        .run();
  }
}

void TcpCommunicator::reduceScatter(const char* send, char* recv, size_t count, DataType t, ReduceOp op, Clock::time_point dl) {
  size_t es = elementSize(t);
  size_t total = count * static_cast<size_t>(size_);
  std::vector<char> work(send, send + total * es);
  if (size_ > 1 && count > 0) ring(work.data(), total, t, op, 1, false, dl);
  else if (op == ReduceOp::kAvg) finishAvg(work.data(), total, t, 1);
  std::memcpy(recv, work.data() + static_cast<size_t>(rank_) * count * es, count * es);
}

}  // namespace

std::unique_ptr<Communicator> createTcpCommunicator(std::shared_ptr<store::Store> store, int rank, int size,
                                                    const CommOptions& opts) {
  return std::make_unique<TcpCommunicator>(std::move(store), rank, size, opts);
}

}  // namespace dtrain::comm
