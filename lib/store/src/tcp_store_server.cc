// Asio server for the store. One io_context on one thread: every session, waiter and
// timer is touched only from that thread, so the key-value state needs no lock.
#include <utility>  // before Asio: Boost 1.74 under C++20 needs std::exchange

#include <boost/asio.hpp>

#include <poll.h>

#include <algorithm>
#include <deque>
#include <list>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include <fmt/format.h>

#include "dtrain/common/errors.h"
#include "dtrain/common/signal_mask.h"
#include "dtrain/store/auth.h"
#include "dtrain/store/tcp_store.h"

#include <fcntl.h>

namespace dtrain::store {

namespace asio = boost::asio;
using asio::ip::tcp;
using Clock = std::chrono::steady_clock;
using wire::ErrorCode;
using wire::Op;

namespace {

class Session;

struct State {
  std::unordered_map<std::string, std::string> map;
  size_t bytes = 0;
  // key -> sessions waiting on it (weak: a session may close while waiting)
  std::unordered_multimap<std::string, std::weak_ptr<Session>> waiters;
};

}  // namespace

struct TcpStoreServer::Impl {
  explicit Impl(TcpStoreServerOptions o) : opts(std::move(o)), acceptor(io), sweep(io), acceptRetry(io) {}
  void accept();
  void scheduleSweep();
  void notifyKey(const std::string& key);

  TcpStoreServerOptions opts;
  // What a Session's destructor touches is declared before `io`, so that it outlives the
  // sessions that handlers still queued in `io` hold when the server is destroyed.
  std::atomic<size_t> connections{0};
  size_t authenticated = 0;    // io thread only
  // Bytes held by authenticated sessions' buffers: unfinished frames in, replies on their
  // way out. io thread; `heldBytes` and
  // `waiterEntries` mirror it and state.waiters' size for other threads (diagnostics, tests).
  size_t buffered = 0;
  size_t held = 0;  // the memory behind them: the buffers' capacity (io thread)
  std::atomic<size_t> heldBytes{0}, waiterEntries{0};
  std::list<Session*> pending;  // sessions still authenticating, oldest first (each leaves it itself)
  asio::io_context io;
  tcp::acceptor acceptor;
  asio::steady_timer sweep;
  asio::steady_timer acceptRetry;  // after a failed accept (EMFILE, ...): no busy retry loop
  bool stopping = false;           // io thread only
  State state;
  std::list<std::weak_ptr<Session>> sessions;
  std::thread thread;
  int port = 0;
};

namespace {

// A wrong AUTH is answered this much later: each guess at a token costs a connection and
// this wait, and at most max_unauthenticated connections wait at once.
constexpr auto kAuthFailureDelay = std::chrono::milliseconds(100);
// A session's buffers keep at most this much room between frames.
constexpr size_t kKeptBuffer = 64 * 1024;
// Read chunks: small until the session authenticates (its frames are at most
// wire::kMaxHandshakeFrame), so that a flood of connections that never authenticate costs
// little memory each; then large enough for big frames to arrive in few reads.
constexpr size_t kHandshakeChunk = 256;
constexpr size_t kChunk = 16 * 1024;
// What a wait holds beyond its keys' bytes: a std::string per key in the session's list,
// and per missing key a node of state.waiters (the key's copy, a weak_ptr, the hash).
constexpr size_t kWaitKeyOverhead = sizeof(std::string);
constexpr size_t kWaiterEntryOverhead = sizeof(std::string) + sizeof(std::weak_ptr<Session>) + 32;

class Session : public std::enable_shared_from_this<Session> {
 public:
  Session(TcpStoreServer::Impl& srv, tcp::socket sock)
      : srv_(srv), sock_(std::move(sock)), waitTimer_(srv.io), connected_(Clock::now()), lastActivity_(connected_) {}

  void start() {
    pendingAt_ = srv_.pending.insert(srv_.pending.end(), this);
    pending_ = true;
    nonce_ = randomBytes(wire::kNonceSize);
    wire::Reply c;
    c.op = Op::kChallenge;
    c.num = wire::kVersion;
    c.value = nonce_;
    reply(c);
  }

  // Dropped to make room for a newer connection while still authenticating: told so with
  // QUOTA (an honest client that was this slow retries), then closed.
  void evict() {
    auto keep = shared_from_this();
    leavePending();
    // The challenge may still be on its way out: the error follows it (see send()).
    if (writing_) {
      evictAfterWrite_ = true;
      return;
    }
    fatal(ErrorCode::kQuota, evictionNotice());
  }

  // Called by the sweep: drops connections that break the deadlines.
  void sweep(Clock::time_point now) {
    const auto& o = srv_.opts;
    if (!authed_ && now - connected_ > o.handshake_timeout) return close();
    // (only while a frame is being read: not behind a wait or a reply being written, when
    // the next request's bytes, pipelined, wait for this one's end)
    if (frameStarted_ && !waiting_ && !writing_ && now - frameStart_ > o.frame_timeout) return close();
    if (o.idle_timeout > Duration::zero() && !waiting_ && now - lastActivity_ > o.idle_timeout) return close();
    if (waiting_ && peerGone()) return close();
  }

  // A key this session waits on was written.
  void keyWritten() {
    if (!waiting_) return;
    for (const auto& k : waitKeys_)
      if (!srv_.state.map.count(k)) {
        // (a key written before and deleted since: notifyKey dropped its entry then)
        registerWaiter(k);
        return;
      }
    finishWait();
  }

  void close() {
    if (closed_) return;
    closed_ = true;
    leavePending();
    // Every caller holds its own reference, so dropping the wait's is safe here.
    auto keep = std::move(waitHold_);
    if (waiting_) dropWaiterEntries();
    waiting_ = false;
    releaseWait();
    boost::system::error_code ec;
    waitTimer_.cancel();
    sock_.shutdown(tcp::socket::shutdown_both, ec);
    sock_.close(ec);
  }

 private:
  void readMore() {
    if (closed_) return;
    // (no read is pending here: the chunk can be replaced)
    const size_t want = authed_ ? kChunk : kHandshakeChunk;
    if (chunk_.size() != want) std::vector<char>(want).swap(chunk_);
    auto self = shared_from_this();
    sock_.async_read_some(asio::buffer(chunk_), [this, self](boost::system::error_code ec, size_t n) {
      if (ec) return close();
      if (closeAfterWrite_) return;  // evicted while this read was pending: its last word is on its way
      lastActivity_ = Clock::now();
      if (in_.empty() && n > 0 && !frameStarted_) {
        frameStarted_ = true;
        frameStart_ = lastActivity_;
      }
      in_.append(chunk_.data(), n);
      account();
      if (authed_ && srv_.buffered > srv_.opts.max_buffered_bytes)
        return fatal(ErrorCode::kQuota, fmt::format("server holds more than {} bytes of unfinished frames; retry later",
                                                    srv_.opts.max_buffered_bytes));
      processBuffer();
    });
  }

  // Handles at most one complete frame, then either replies (and continues after the write)
  // or keeps reading. Memory per session stays below one frame plus one read chunk.
  void processBuffer() {
    if (closed_ || closeAfterWrite_) return;
    if (in_.size() < wire::kHeaderSize) {
      frameStarted_ = !in_.empty();
      return readMore();
    }
    uint32_t len;
    try {
      // Before authentication only a frame the size of AUTH: nobody without the token can
      // make the server hold more than that per connection.
      wire::Limits handshake = srv_.opts.limits;
      handshake.max_frame = std::min(handshake.max_frame, wire::kMaxHandshakeFrame);
      len = wire::decodeHeader(in_, authed_ ? srv_.opts.limits : handshake);
    } catch (const wire::WireError& e) {
      return fatal(e.code(), e.what());
    }
    if (in_.size() < wire::kHeaderSize + len) return readMore();
    std::string frame = in_.substr(0, wire::kHeaderSize + len);
    in_.erase(0, wire::kHeaderSize + len);
    // A large frame's room goes with it: kept, every idle connection that once sent 16 MiB
    // would hold 16 MiB.
    if (in_.capacity() > kKeptBuffer && in_.capacity() > 2 * in_.size()) std::string(in_).swap(in_);
    account();
    frameStarted_ = !in_.empty();
    if (frameStarted_) frameStart_ = Clock::now();
    std::string_view body = std::string_view(frame).substr(wire::kHeaderSize);
    if (recvMac_) {
      // Nothing of a frame that fails its MAC is acted on, and the stream cannot be trusted
      // after it: answered (under our MAC, so the client knows it is from us), then closed.
      auto opened = recvMac_->open(std::string_view(frame).substr(0, wire::kHeaderSize), body);
      if (!opened)
        return fatal(ErrorCode::kIntegrity, "a request failed its integrity check: it was altered, dropped, replayed "
                                            "or injected on the way");
      body = *opened;
    }
    wire::Request req;
    try {
      req = wire::decodeRequest(body, srv_.opts.limits);
    } catch (const wire::WireError& e) {
      // The frame boundary is intact, so the connection can go on after a typed error,
      // except before authentication, where nothing but AUTH is accepted.
      if (!authed_)
        return e.code() == ErrorCode::kUnknownOpcode
                   ? fatal(ErrorCode::kNotAuthenticated, "authenticate first (AUTH with the job token)")
                   : fatal(e.code(), e.what());
      return reply(wire::errorReply(e.code(), e.what()));
    }
    handle(req);
  }

  // The last frame of the connection: an error, then close.
  void fatal(ErrorCode code, const std::string& msg) {
    if (closed_ || closeAfterWrite_) return;
    closeAfterWrite_ = true;
    leavePending();
    reply(wire::errorReply(code, msg));
  }

  // One frame at a time: a session writes only when it has no write in flight (it reads
  // the next request after its reply is written; evict() defers to the write's end).
  void send(std::string frame) {
    if (closed_) return;
    out_ = std::move(frame);
    account();
    writing_ = true;
    auto self = shared_from_this();
    asio::async_write(sock_, asio::buffer(out_), [this, self](boost::system::error_code ec, size_t) {
      writing_ = false;
      // (a large reply's memory is not kept for the next one)
      if (out_.capacity() > kKeptBuffer) std::string().swap(out_);
      account();
      if (ec || closeAfterWrite_) return close();
      lastActivity_ = Clock::now();
      if (evictAfterWrite_) return fatal(ErrorCode::kQuota, evictionNotice());
      // Pipelined bytes of the next request waited for this one's end: its deadline runs
      // from now.
      if (!in_.empty()) frameStart_ = lastActivity_;
      processBuffer();
    });
  }

  std::string evictionNotice() const {
    return fmt::format("more than {} connections are authenticating; this one, the oldest, is dropped; retry",
                       srv_.opts.max_unauthenticated);
  }

  // Every frame the session sends goes here: after the handshake it carries our MAC.
  // Sealed once, as sent: every seal takes the next sequence number, and the client checks
  // each reply's against the one it expects (a reply sealed and then replaced by QUOTA's
  // error took two, and the client read the error as tampering).
  void reply(const wire::Reply& r) {
    std::string frame;
    try {
      frame = wire::encodeReply(r);
    } catch (const wire::WireError& e) {
      // A reply too large for its frame is refused before it is built (finishWait), so this
      // is a bug; still a typed answer rather than a frame with a wrapped length.
      frame = wire::encodeReply(wire::errorReply(e.code(), e.what()));
    }
    // Replies count against the same budget as unfinished frames: clients that ask for
    // large values and do not read them would otherwise hold one reply each.
    const size_t size = frame.size() + (sendMac_ ? auth::kMacSize : 0);
    if (authed_ && size > kKeptBuffer && srv_.buffered + size > srv_.opts.max_buffered_bytes)
      frame = wire::encodeReply(wire::errorReply(
          ErrorCode::kQuota, fmt::format("server holds more than {} bytes of requests and replies in flight; retry later",
                                         srv_.opts.max_buffered_bytes)));
    if (sendMac_) frame = sendMac_->seal(std::move(frame));
    send(std::move(frame));
  }
  void ok() { reply(wire::Reply{}); }
  void error(ErrorCode c, std::string m) { reply(wire::errorReply(c, std::move(m))); }

  // Quota check for writing `key` with a value of `newSize` bytes.
  bool admit(const std::string& key, size_t newSize) {
    auto& st = srv_.state;
    auto it = st.map.find(key);
    size_t old = it == st.map.end() ? 0 : it->second.size() + key.size();
    if (it == st.map.end() && st.map.size() >= srv_.opts.max_total_keys) {
      error(ErrorCode::kQuota, fmt::format("store holds its limit of {} keys", srv_.opts.max_total_keys));
      return false;
    }
    if (st.bytes - old + newSize + key.size() > srv_.opts.max_total_bytes) {
      error(ErrorCode::kQuota, fmt::format("store holds its limit of {} bytes", srv_.opts.max_total_bytes));
      return false;
    }
    return true;
  }

  // Quota check for a MULTI_SET, as a whole: its keys one by one against the store as it is
  // would let the batch go over by all but one of its values. (A key given twice counts
  // its last value, which is the one that stays.)
  bool admitAll(const std::vector<std::string>& keys, const std::vector<std::string>& values) {
    auto& st = srv_.state;
    std::unordered_map<std::string_view, size_t> last;
    for (size_t i = 0; i < keys.size(); ++i) last[keys[i]] = values[i].size();
    size_t added = 0, bytes = st.bytes;
    for (const auto& [key, size] : last) {
      auto it = st.map.find(std::string(key));
      if (it == st.map.end())
        ++added;
      else
        bytes -= it->second.size() + key.size();
      bytes += size + key.size();
    }
    if (st.map.size() + added > srv_.opts.max_total_keys) {
      error(ErrorCode::kQuota, fmt::format("store holds its limit of {} keys", srv_.opts.max_total_keys));
      return false;
    }
    if (bytes > srv_.opts.max_total_bytes) {
      error(ErrorCode::kQuota, fmt::format("store holds its limit of {} bytes", srv_.opts.max_total_bytes));
      return false;
    }
    return true;
  }

  void put(const std::string& key, std::string value) {
    auto& st = srv_.state;
    auto it = st.map.find(key);
    if (it != st.map.end()) st.bytes -= it->second.size() + key.size();
    st.bytes += value.size() + key.size();
    st.map[key] = std::move(value);
    srv_.notifyKey(key);
  }

  void handle(wire::Request& q) {
    auto& st = srv_.state;
    if (!authed_) return authenticate(q);
    switch (q.op) {
      case Op::kSet:
        if (!admit(q.keys[0], q.values[0].size())) return;
        put(q.keys[0], std::move(q.values[0]));
        return ok();
      case Op::kAppend: {
        auto it = st.map.find(q.keys[0]);
        size_t cur = it == st.map.end() ? 0 : it->second.size();
        if (cur + q.values[0].size() > srv_.opts.limits.max_value)
          return error(ErrorCode::kTooLarge, fmt::format("appending would make key '{}' larger than {} bytes", q.keys[0], srv_.opts.limits.max_value));
        if (!admit(q.keys[0], cur + q.values[0].size())) return;
        std::string v = it == st.map.end() ? std::string() : it->second;
        v += q.values[0];
        put(q.keys[0], std::move(v));
        return ok();
      }
      case Op::kAdd: {
        auto it = st.map.find(q.keys[0]);
        int64_t sum = 0;
        try {
          sum = addToCounter(q.keys[0], it == st.map.end() ? nullptr : &it->second, q.num);
        } catch (const NotIntegerError& e) {
          return error(ErrorCode::kNotInteger, e.what());
        } catch (const OutOfRangeError& e) {
          return error(ErrorCode::kOutOfRange, e.what());
        }
        std::string v = std::to_string(sum);
        if (!admit(q.keys[0], v.size())) return;
        put(q.keys[0], v);
        wire::Reply r;
        r.op = Op::kInt;
        r.num = sum;
        return reply(r);
      }
      case Op::kCompareSet: {
        auto it = st.map.find(q.keys[0]);
        wire::Reply r;
        r.op = Op::kValue;
        if ((it == st.map.end() && q.values[0].empty()) || (it != st.map.end() && it->second == q.values[0])) {
          if (!admit(q.keys[0], q.values[1].size())) return;
          r.value = q.values[1];
          put(q.keys[0], std::move(q.values[1]));
        } else {
          r.value = it == st.map.end() ? q.values[0] : it->second;
        }
        return reply(r);
      }
      case Op::kCheck: {
        wire::Reply r;
        r.op = Op::kBool;
        r.flag = true;
        for (const auto& k : q.keys) r.flag = r.flag && st.map.count(k);
        return reply(r);
      }
      case Op::kGet:
      case Op::kWait:
      case Op::kMultiGet: return startWait(q);
      case Op::kDelete: {
        auto it = st.map.find(q.keys[0]);
        wire::Reply r;
        r.op = Op::kBool;
        r.flag = it != st.map.end();
        if (r.flag) {
          st.bytes -= it->second.size() + it->first.size();
          st.map.erase(it);
        }
        return reply(r);
      }
      case Op::kNumKeys: {
        wire::Reply r;
        r.op = Op::kInt;
        r.num = static_cast<int64_t>(st.map.size());
        return reply(r);
      }
      case Op::kMultiSet: {
        if (q.keys.size() != q.values.size()) return error(ErrorCode::kMalformed, "multiSet: key and value counts differ");
        if (!admitAll(q.keys, q.values)) return;
        for (size_t i = 0; i < q.keys.size(); ++i) put(q.keys[i], std::move(q.values[i]));
        return ok();
      }
      case Op::kPing: return ok();
      case Op::kAuth: return error(ErrorCode::kMalformed, "already authenticated");
      default: return error(ErrorCode::kUnknownOpcode, "unknown opcode");
    }
  }

  // The AUTH: the client's proof of the token over both nonces; ours back (PROOF), and from
  // then on every frame both ways carries a MAC under the session key (auth.h).
  void authenticate(const wire::Request& q) {
    if (q.op != Op::kAuth) return fatal(ErrorCode::kNotAuthenticated, "authenticate first (AUTH with the job token)");
    if (q.num != wire::kVersion)
      return fatal(ErrorCode::kVersion, fmt::format("the client speaks store protocol version {}, this store speaks "
                                                    "version {}", q.num, wire::kVersion));
    const std::string& clientNonce = q.values[0];
    if (clientNonce.size() != wire::kNonceSize)
      return fatal(ErrorCode::kMalformed, fmt::format("client nonce of {} bytes; it must be {}", clientNonce.size(), wire::kNonceSize));
    if (!auth::macEqual(q.values[1], auth::clientProof(srv_.opts.token, nonce_, clientNonce))) {
      waitTimer_.expires_after(kAuthFailureDelay);
      auto self = shared_from_this();
      waitTimer_.async_wait([this, self](boost::system::error_code ec) {
        if (!ec) fatal(ErrorCode::kAuthFailed, "wrong token");
      });
      return;
    }
    if (srv_.authenticated >= srv_.opts.max_connections)
      return fatal(ErrorCode::kQuota, fmt::format("the store holds its limit of {} connections; retry later",
                                                  srv_.opts.max_connections));
    authed_ = true;
    ++srv_.authenticated;
    leavePending();
    account();  // pipelined bytes already read count from now on
    wire::Reply proof;
    proof.op = Op::kProof;
    proof.value = auth::serverProof(srv_.opts.token, nonce_, clientNonce);
    reply(proof);  // (encoded before the session key is set: PROOF carries its own MAC)
    std::string key = auth::sessionKey(srv_.opts.token, nonce_, clientNonce);
    sendMac_.emplace(key, auth::Direction::kServerToClient);
    recvMac_.emplace(std::move(key), auth::Direction::kClientToServer);
  }

  void startWait(wire::Request& q) {
    // A wait holds its keys, and a copy of each missing one in state.waiters, for as long as
    // it lasts (4096 keys of 4 KiB: 33 MB, for ever with timeout -1): counted in the budget
    // of bytes in flight, as unfinished frames and unread replies are, and refused past it
    // as a large reply is (small ones always pass: they cannot wedge the job's barriers).
    const size_t cost = waitCost(q.keys);
    if (cost > kKeptBuffer && srv_.buffered + cost > srv_.opts.max_buffered_bytes)
      return error(
          ErrorCode::kQuota,
          fmt::format("a wait on these {} keys would hold {} bytes, and the server holds more than {} bytes of "
                      "requests, replies and waits in flight; retry later, or wait on fewer keys at a time",
                      q.keys.size(), cost, srv_.opts.max_buffered_bytes));
    waitOp_ = q.op;
    waitKeys_ = std::move(q.keys);
    waitBytes_ = cost;
    account();
    waiting_ = true;
    // A waiting session has no read pending (the next frame is read after this reply) and
    // state.waiters holds it weakly; without a timer (timeout_ms = -1) nothing else would
    // keep it alive. It lives until woken, timed out, or its socket closes (the sweep
    // notices a waiter's peer that hung up, see peerGone).
    waitHold_ = shared_from_this();
    // (each key once; no entry of this session's can exist yet, so none is looked for: a
    // thousand workers waiting on one barrier key register in linear time)
    std::unordered_set<std::string_view> seen;
    for (const auto& k : waitKeys_)
      if (!srv_.state.map.count(k) && seen.insert(k).second) registerWaiter(k, false);
    keyWritten();
    if (!waiting_) return;
    if (q.num >= 0) {
      // The timer counts nanoseconds: a timeout_ms beyond ~292 years would wrap in the
      // conversion, possibly to a deadline already past. A century is as good as forever.
      waitFor_ = std::min(Duration(q.num), Duration(std::chrono::hours(24 * 365 * 100)));
      waitTimer_.expires_after(waitFor_);
      auto self = shared_from_this();
      waitTimer_.async_wait([this, self](boost::system::error_code ec) {
        if (ec || !waiting_ || closed_) return;
        waiting_ = false;
        dropWaiterEntries();  // (else each timed-out wait's keys stay in the table)
        waitHold_.reset();  // self is held by this handler
        std::vector<std::string> missing;
        for (const auto& k : waitKeys_)
          if (!srv_.state.map.count(k)) missing.push_back(k);
        std::string why = describeWaitTimeout(waitFor_, missing);
        missing.clear();
        releaseWait();
        error(ErrorCode::kTimeout, std::move(why));
      });
    }
  }

  void finishWait() {
    auto keep = std::move(waitHold_);  // alive until the reply's write holds its own reference
    waiting_ = false;
    dropWaiterEntries();
    waitTimer_.cancel();
    auto& st = srv_.state;
    wire::Reply r;
    if (waitOp_ == Op::kWait) {
      r.op = Op::kOk;
    } else if (waitOp_ == Op::kGet) {
      r.op = Op::kValue;
      r.value = st.map.at(waitKeys_[0]);
    } else {
      // The reply's size is known before anything is copied: keys may repeat, and 4096 of a
      // 16 MiB value would be 64 GiB. One over the frame limit is refused as too large.
      size_t length = 1 + 4 + (sendMac_ ? auth::kMacSize : 0);
      for (const auto& k : waitKeys_) length += 4 + st.map.at(k).size();
      if (length > srv_.opts.limits.max_frame) {
        const size_t count = waitKeys_.size();
        releaseWait();
        return error(ErrorCode::kTooLarge, fmt::format("the values of these {} keys make a reply of {} bytes, over the "
                                                       "frame limit of {}; get them in smaller batches",
                                                       count, length, srv_.opts.limits.max_frame));
      }
      r.op = Op::kValues;
      r.values.reserve(waitKeys_.size());
      for (const auto& k : waitKeys_) r.values.push_back(st.map.at(k));
    }
    releaseWait();  // (before the reply, whose own budget check then sees the room)
    reply(r);
  }

  // The memory a wait on `keys` holds while it lasts (see startWait): each key in
  // waitKeys_, and each distinct missing one again in state.waiters.
  size_t waitCost(const std::vector<std::string>& keys) const {
    size_t cost = 0;
    std::unordered_set<std::string_view> seen;
    for (const auto& k : keys) {
      cost += k.size() + kWaitKeyOverhead;
      if (!srv_.state.map.count(k) && seen.insert(k).second) cost += k.size() + kWaiterEntryOverhead;
    }
    return cost;
  }

  // The wait is over (answered, timed out, closed; its waiter entries already dropped): its
  // keys go, and their bytes leave the budget.
  void releaseWait() {
    std::vector<std::string>().swap(waitKeys_);
    waitBytes_ = 0;
    account();
  }

  // This session's entry for `key` in state.waiters, once (a wait on 4096 keys, or a key
  // rewritten and deleted over and over, must not pile up entries).
  void registerWaiter(const std::string& key, bool mayExist = true) {
    auto& w = srv_.state.waiters;
    auto range = w.equal_range(key);
    for (auto it = range.first; mayExist && it != range.second; ++it)
      if (it->second.lock().get() == this) return;
    w.emplace(key, weak_from_this());
    srv_.waiterEntries = w.size();
  }
  // Removes this session's entries: its wait ended (woken, timed out, closed).
  void dropWaiterEntries() {
    auto& w = srv_.state.waiters;
    for (const auto& k : waitKeys_) {
      auto range = w.equal_range(k);
      for (auto it = range.first; it != range.second;) {
        const auto s = it->second.lock();
        it = !s || s.get() == this ? w.erase(it) : std::next(it);
      }
    }
    srv_.waiterEntries = w.size();
  }

  // True when the peer of a waiting session hung up (or its socket failed). No read is
  // pending while waiting, so Asio would not tell us; POLLRDHUP sees the FIN even behind
  // pipelined bytes we have not read yet. A half-close counts as gone, as EOF does in
  // readMore.
  bool peerGone() {
    pollfd p{sock_.native_handle(), POLLRDHUP, 0};
    return ::poll(&p, 1, 0) > 0 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL));
  }

  TcpStoreServer::Impl& srv_;
  tcp::socket sock_;
  asio::steady_timer waitTimer_;
  std::shared_ptr<Session> waitHold_;  // self while waiting; see startWait
  std::vector<char> chunk_;            // kHandshakeChunk or kChunk bytes, see readMore
  size_t accounted_ = 0;  // our share of srv_.buffered
  size_t heldRoom_ = 0;   // and of srv_.held

  // Only authenticated sessions spend the shared budget (see max_buffered_bytes).
  void account() {
    // (sizes: the room beyond them is at most the string's doubling while a frame arrives,
    // and is given back after each frame and reply, see kKeptBuffer)
    const size_t mine = authed_ ? in_.size() + out_.size() + waitBytes_ : 0;
    const size_t room = authed_ ? in_.capacity() + out_.capacity() + waitBytes_ : 0;
    srv_.buffered = srv_.buffered - accounted_ + mine;
    srv_.held = srv_.held - heldRoom_ + room;
    srv_.heldBytes = srv_.held;
    accounted_ = mine;
    heldRoom_ = room;
  }
  void leavePending() {
    if (!pending_) return;
    srv_.pending.erase(pendingAt_);
    pending_ = false;
  }
  std::string in_, out_, nonce_;
  std::optional<auth::FrameMac> sendMac_, recvMac_;  // after the handshake
  std::list<Session*>::iterator pendingAt_;           // in srv_.pending while pending_
  bool pending_ = false;
  bool authed_ = false, closed_ = false, closeAfterWrite_ = false, writing_ = false, evictAfterWrite_ = false;
  bool frameStarted_ = false, waiting_ = false;
  Clock::time_point connected_, lastActivity_, frameStart_;
  Op waitOp_ = Op::kWait;
  std::vector<std::string> waitKeys_;  // while waiting_ (released when the wait ends)
  size_t waitBytes_ = 0;               // what the wait holds, in srv_.buffered (waitCost)
  Duration waitFor_{0};

 public:
  ~Session() {
    leavePending();
    srv_.buffered -= accounted_;
    srv_.held -= heldRoom_;
    srv_.heldBytes = srv_.held;
    if (authed_) --srv_.authenticated;
    --srv_.connections;
  }
};

}  // namespace

void TcpStoreServer::Impl::notifyKey(const std::string& key) {
  auto range = state.waiters.equal_range(key);
  std::vector<std::shared_ptr<Session>> wake;
  for (auto it = range.first; it != range.second; ++it)
    if (auto s = it->second.lock()) wake.push_back(std::move(s));
  state.waiters.erase(range.first, range.second);
  waiterEntries = state.waiters.size();
  for (auto& s : wake) s->keyWritten();
}

void TcpStoreServer::Impl::accept() {
  acceptor.async_accept([this](boost::system::error_code ec, tcp::socket sock) {
    // A completion queued before stop() closed the acceptor must not re-arm it.
    if (ec == asio::error::operation_aborted || stopping || !acceptor.is_open()) return;
    if (ec) {
      // Out of fds or a transient error: try again shortly instead of spinning.
      acceptRetry.expires_after(std::chrono::milliseconds(20));
      acceptRetry.async_wait([this](boost::system::error_code e) {
        if (!e && !stopping) accept();
      });
      return;
    }
    // Connections still authenticating are bounded apart from authenticated ones: past the
    // limit the oldest goes (an honest client authenticates within a round trip; one that
    // has not is most likely one of a flood). Authenticated ones are limited at their AUTH,
    // which is answered QUOTA: never a silent close.
    while (!pending.empty() && pending.size() >= std::max<size_t>(opts.max_unauthenticated, 1)) pending.front()->evict();
    sock.set_option(tcp::no_delay(true), ec);
    // (accepted without SOCK_CLOEXEC: a process spawned now, an ssh or a guard, would hold
    // the client's connection open after we close it)
    ::fcntl(sock.native_handle(), F_SETFD, FD_CLOEXEC);
    ++connections;
    // Not make_shared: `sessions` holds weak references until the next sweep, and with
    // make_shared they would keep each closed session's memory (its object and buffers
    // are in the same block as the counts) until then; under a flood of connections that
    // is hundreds of MB, which the allocator then keeps. Apart, only the counts linger.
    std::shared_ptr<Session> s(new Session(*this, std::move(sock)));
    sessions.push_back(s);
    s->start();
    accept();
  });
}

void TcpStoreServer::Impl::scheduleSweep() {
  sweep.expires_after(std::chrono::milliseconds(250));
  sweep.async_wait([this](boost::system::error_code ec) {
    if (ec || stopping) return;  // a completion queued before stop() must not re-arm
    auto now = Clock::now();
    for (auto it = sessions.begin(); it != sessions.end();) {
      if (auto s = it->lock()) {
        s->sweep(now);
        ++it;
      } else {
        it = sessions.erase(it);
      }
    }
    // Waiter entries of sessions that went away.
    for (auto it = state.waiters.begin(); it != state.waiters.end();)
      it = it->second.expired() ? state.waiters.erase(it) : std::next(it);
    waiterEntries = state.waiters.size();
    scheduleSweep();
  });
}

TcpStoreServer::TcpStoreServer(TcpStoreServerOptions opts) : impl_(std::make_unique<Impl>(std::move(opts))) {
  if (impl_->opts.token.empty()) throw SpecError("store server: a non-empty token is required");
  boost::system::error_code ec;
  auto addr = asio::ip::make_address(impl_->opts.bind, ec);
  if (ec) throw SpecError(fmt::format("store server: bind address '{}' is not an IP address", impl_->opts.bind));
  tcp::endpoint ep(addr, static_cast<unsigned short>(impl_->opts.port));
  auto& a = impl_->acceptor;
  a.open(ep.protocol(), ec);
  // (Asio opens it without close-on-exec: a process dtrain starts some other way than
  // spawnProcess, which closes what it does not pass, must not hold the port)
  if (!ec) ::fcntl(a.native_handle(), F_SETFD, FD_CLOEXEC);
  if (!ec) a.set_option(tcp::acceptor::reuse_address(true), ec);
  if (!ec) a.bind(ep, ec);
  if (!ec) a.listen(asio::socket_base::max_listen_connections, ec);
  if (ec)
    throw IoError(fmt::format("store server: cannot listen on {}:{}: {}", impl_->opts.bind, impl_->opts.port, ec.message()));
  impl_->port = a.local_endpoint().port();
  impl_->accept();
  impl_->scheduleSweep();
}

TcpStoreServer::~TcpStoreServer() { stop(); }

int TcpStoreServer::port() const { return impl_->port; }

size_t TcpStoreServer::connectionCount() const { return impl_->connections.load(); }

size_t TcpStoreServer::heldBytes() const { return impl_->heldBytes.load(); }

size_t TcpStoreServer::waiterEntryCount() const { return impl_->waiterEntries.load(); }

void TcpStoreServer::start() {
  DTRAIN_CHECK(!impl_->thread.joinable());
  // The serving thread takes no signal (it inherits the mask set here): a process that keeps
  // its stop signals blocked on its own thread, as dtrain run does at its end, would
  // otherwise have them delivered here.
  const AllSignalsBlocked blocked;
  impl_->thread = std::thread([this] { impl_->io.run(); });
}

void TcpStoreServer::run() { impl_->io.run(); }

void TcpStoreServer::stop() {
  asio::post(impl_->io, [this] {
    impl_->stopping = true;
    boost::system::error_code ec;
    impl_->acceptor.close(ec);
    impl_->sweep.cancel();
    impl_->acceptRetry.cancel();
    for (auto& w : impl_->sessions)
      if (auto s = w.lock()) s->close();
    // Handlers already queued (a timer that had fired, an accept that had completed) must
    // not keep run() going: stop it here, they are dropped with the io_context.
    impl_->io.stop();
  });
  if (impl_->thread.joinable()) {
    impl_->thread.join();
  }
  impl_->io.stop();
}

}  // namespace dtrain::store
