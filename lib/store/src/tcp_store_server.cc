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

#include <fmt/format.h>

#include "dtrain/common/errors.h"
#include "dtrain/store/tcp_store.h"

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
  asio::io_context io;
  tcp::acceptor acceptor;
  asio::steady_timer sweep;
  asio::steady_timer acceptRetry;  // after a failed accept (EMFILE, ...): no busy retry loop
  bool stopping = false;           // io thread only
  State state;
  std::list<std::weak_ptr<Session>> sessions;
  std::atomic<size_t> connections{0};
  size_t buffered = 0;  // bytes of unfinished frames held by all sessions
  std::thread thread;
  int port = 0;
};

namespace {

class Session : public std::enable_shared_from_this<Session> {
 public:
  Session(TcpStoreServer::Impl& srv, tcp::socket sock)
      : srv_(srv), sock_(std::move(sock)), waitTimer_(srv.io), connected_(Clock::now()), lastActivity_(connected_) {}

  void start() {
    nonce_ = randomBytes(wire::kNonceSize);
    wire::Reply c;
    c.op = Op::kChallenge;
    c.num = wire::kVersion;
    c.value = nonce_;
    send(wire::encodeReply(c));
  }

  // Called by the sweep: drops connections that break the deadlines.
  void sweep(Clock::time_point now) {
    const auto& o = srv_.opts;
    if (!authed_ && now - connected_ > o.handshake_timeout) return close();
    if (frameStarted_ && now - frameStart_ > o.frame_timeout) return close();
    if (o.idle_timeout > Duration::zero() && !waiting_ && now - lastActivity_ > o.idle_timeout) return close();
    if (waiting_ && peerGone()) return close();
  }

  // A key this session waits on was written.
  void keyWritten() {
    if (!waiting_) return;
    for (const auto& k : waitKeys_)
      if (!srv_.state.map.count(k)) return;
    finishWait();
  }

  void close() {
    if (closed_) return;
    closed_ = true;
    // Every caller holds its own reference, so dropping the wait's is safe here.
    auto keep = std::move(waitHold_);
    waiting_ = false;
    boost::system::error_code ec;
    waitTimer_.cancel();
    sock_.shutdown(tcp::socket::shutdown_both, ec);
    sock_.close(ec);
  }

 private:
  void readMore() {
    if (closed_) return;
    auto self = shared_from_this();
    sock_.async_read_some(asio::buffer(chunk_), [this, self](boost::system::error_code ec, size_t n) {
      if (ec) return close();
      lastActivity_ = Clock::now();
      if (in_.empty() && n > 0 && !frameStarted_) {
        frameStarted_ = true;
        frameStart_ = lastActivity_;
      }
      in_.append(chunk_.data(), n);
      account();
      if (srv_.buffered > srv_.opts.max_buffered_bytes)
        return fatal(ErrorCode::kQuota, fmt::format("server holds more than {} bytes of unfinished frames; retry later",
                                                    srv_.opts.max_buffered_bytes));
      processBuffer();
    });
  }

  // Handles at most one complete frame, then either replies (and continues after the write)
  // or keeps reading. Memory per session stays below one frame plus one read chunk.
  void processBuffer() {
    if (closed_) return;
    if (in_.size() < wire::kHeaderSize) {
      frameStarted_ = !in_.empty();
      return readMore();
    }
    uint32_t len;
    try {
      len = wire::decodeHeader(in_, srv_.opts.limits);
    } catch (const wire::WireError& e) {
      return fatal(e.code(), e.what());
    }
    if (in_.size() < wire::kHeaderSize + len) return readMore();
    std::string body = in_.substr(wire::kHeaderSize, len);
    in_.erase(0, wire::kHeaderSize + len);
    account();
    frameStarted_ = !in_.empty();
    if (frameStarted_) frameStart_ = Clock::now();
    wire::Request req;
    try {
      req = wire::decodeRequest(body, srv_.opts.limits);
    } catch (const wire::WireError& e) {
      // The frame boundary is intact, so the connection can go on after a typed error,
      // except before authentication, where nothing but AUTH is accepted.
      if (!authed_) return fatal(e.code(), e.what());
      return send(wire::encodeReply(wire::errorReply(e.code(), e.what())));
    }
    handle(req);
  }

  void fatal(ErrorCode code, const std::string& msg) {
    closeAfterWrite_ = true;
    send(wire::encodeReply(wire::errorReply(code, msg)));
  }

  void send(std::string frame) {
    if (closed_) return;
    out_ = std::move(frame);
    auto self = shared_from_this();
    asio::async_write(sock_, asio::buffer(out_), [this, self](boost::system::error_code ec, size_t) {
      if (ec || closeAfterWrite_) return close();
      lastActivity_ = Clock::now();
      processBuffer();
    });
  }

  void reply(const wire::Reply& r) { send(wire::encodeReply(r)); }
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
    if (!authed_) {
      if (q.op != Op::kAuth) return fatal(ErrorCode::kNotAuthenticated, "authenticate first (AUTH with the job token)");
      if (q.num != wire::kVersion)
        return fatal(ErrorCode::kVersion, fmt::format("protocol version {} is not supported; server speaks {}", q.num, wire::kVersion));
      std::string expect = handshakeMac(srv_.opts.token, nonce_);
      const std::string& got = q.values[0];
      bool match = got.size() == expect.size();
      unsigned char diff = 0;
      for (size_t i = 0; match && i < got.size(); ++i) diff |= static_cast<unsigned char>(got[i] ^ expect[i]);
      if (!match || diff != 0) return fatal(ErrorCode::kAuthFailed, "wrong token");
      authed_ = true;
      return ok();
    }
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
        for (size_t i = 0; i < q.keys.size(); ++i)
          if (!admit(q.keys[i], q.values[i].size())) return;
        for (size_t i = 0; i < q.keys.size(); ++i) put(q.keys[i], std::move(q.values[i]));
        return ok();
      }
      case Op::kPing: return ok();
      case Op::kAuth: return error(ErrorCode::kMalformed, "already authenticated");
      default: return error(ErrorCode::kUnknownOpcode, "unknown opcode");
    }
  }

  void startWait(wire::Request& q) {
    waitOp_ = q.op;
    waitKeys_ = std::move(q.keys);
    waiting_ = true;
    // A waiting session has no read pending (the next frame is read after this reply) and
    // state.waiters holds it weakly; without a timer (timeout_ms = -1) nothing else would
    // keep it alive. It lives until woken, timed out, or its socket closes (the sweep
    // notices a waiter's peer that hung up, see peerGone).
    waitHold_ = shared_from_this();
    for (const auto& k : waitKeys_)
      if (!srv_.state.map.count(k)) {
        srv_.state.waiters.emplace(k, weak_from_this());
      }
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
        waitHold_.reset();  // self is held by this handler
        std::vector<std::string> missing;
        for (const auto& k : waitKeys_)
          if (!srv_.state.map.count(k)) missing.push_back(k);
        error(ErrorCode::kTimeout, describeWaitTimeout(waitFor_, missing));
      });
    }
  }

  void finishWait() {
    auto keep = std::move(waitHold_);  // alive until the reply's write holds its own reference
    waiting_ = false;
    waitTimer_.cancel();
    auto& st = srv_.state;
    wire::Reply r;
    if (waitOp_ == Op::kWait) {
      r.op = Op::kOk;
    } else if (waitOp_ == Op::kGet) {
      r.op = Op::kValue;
      r.value = st.map.at(waitKeys_[0]);
    } else {
      r.op = Op::kValues;
      for (const auto& k : waitKeys_) r.values.push_back(st.map.at(k));
    }
    reply(r);
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
  std::array<char, 16 * 1024> chunk_{};
  size_t accounted_ = 0;  // our share of srv_.buffered

  void account() {
    srv_.buffered = srv_.buffered - accounted_ + in_.size();
    accounted_ = in_.size();
  }
  std::string in_, out_, nonce_;
  bool authed_ = false, closed_ = false, closeAfterWrite_ = false;
  bool frameStarted_ = false, waiting_ = false;
  Clock::time_point connected_, lastActivity_, frameStart_;
  Op waitOp_ = Op::kWait;
  std::vector<std::string> waitKeys_;
  Duration waitFor_{0};

 public:
  ~Session() {
    srv_.buffered -= accounted_;
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
    {
      if (connections.load() >= opts.max_connections) {
        boost::system::error_code ignored;
        sock.close(ignored);
      } else {
        sock.set_option(tcp::no_delay(true), ec);
        ++connections;
        auto s = std::make_shared<Session>(*this, std::move(sock));
        sessions.push_back(s);
        s->start();
      }
    }
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

void TcpStoreServer::start() {
  DTRAIN_CHECK(!impl_->thread.joinable());
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
