#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <thread>

#include <fmt/format.h>

#include "dtrain/common/errors.h"
#include "dtrain/common/strings.h"
#include "dtrain/store/tcp_store.h"

namespace dtrain::store {

using Clock = std::chrono::steady_clock;
using wire::ErrorCode;
using wire::Op;

std::string randomBytes(size_t n) {
  std::string out(n, '\0');
  size_t got = 0;
  while (got < n) {
    ssize_t r = ::getrandom(out.data() + got, n - got, 0);
    if (r < 0) {
      if (errno == EINTR) continue;
      throwErrno("getrandom");
    }
    got += static_cast<size_t>(r);
  }
  return out;
}

namespace {

constexpr auto kAttemptLimit = std::chrono::seconds(5);  // one connect attempt
// The handshake gets at least this long after the TCP connection is made, however close to
// the connect deadline that was: a store that came up at the last moment can still answer.
constexpr auto kHandshakeFloor = std::chrono::milliseconds(500);
constexpr size_t kMaxHandshakeReply = 1 + 2 + 4 + 64 * 1024;  // ERROR: code, message (decodeReply's limit)

// Waits for fd to be ready until deadline; false on timeout.
bool waitFd(int fd, short events, Clock::time_point deadline) {
  while (true) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    if (left <= 0) return false;
    pollfd p{fd, events, 0};
    int r = ::poll(&p, 1, static_cast<int>(std::min<long long>(left, 1 << 30)));
    if (r > 0) return true;
    if (r < 0 && errno != EINTR) throwErrno("poll");
  }
}

// A read or write deadline passed: the server did not answer (or read) in time. The
// connection is already dropped; call() and handshake() say what it means for their caller.
class NoReplyInTime : public IoError {
 public:
  using IoError::IoError;
};

double seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

// The peer answered the handshake with something that is not the store's protocol (an HTTP
// server's "HTTP/1.1 400", an SSH banner): another service at that address, which retrying
// cannot fix, so an AuthError (`dtrain store` exit 5), as a listener without the token is.
AuthError notAStore(const std::string& ep, const std::string& what) {
  return AuthError(
      fmt::format("store {} did not answer as a dtrain store (is this a dtrain store? {}); check the "
                  "address and port (rendezvous.addr, --endpoint, DTRAIN_STORE_ADDR/PORT)",
                  ep, what));
}

}  // namespace

TcpStore::TcpStore(TcpStoreOptions opts) : opts_(std::move(opts)) {
  timeout_ = opts_.timeout;
  connect();
}

TcpStore::~TcpStore() {
  if (fd_ >= 0) ::close(fd_);
}

std::string TcpStore::localAddress() const {
  sockaddr_storage ss{};
  socklen_t len = sizeof(ss);
  if (fd_ < 0 || ::getsockname(fd_, reinterpret_cast<sockaddr*>(&ss), &len) != 0) return "127.0.0.1";
  char host[NI_MAXHOST];
  if (::getnameinfo(reinterpret_cast<sockaddr*>(&ss), len, host, sizeof(host), nullptr, 0, NI_NUMERICHOST) != 0)
    return "127.0.0.1";
  return host;
}

IoError TcpStore::notConnected() const {
  if (dropped_.empty()) return IoError(fmt::format("store {}: not connected", endpoint()));
  return IoError(fmt::format("store {}: not connected: the connection was dropped earlier ({})", endpoint(), dropped_));
}

// As --endpoint takes it back: an IPv6 address in brackets.
std::string TcpStore::endpoint() const {
  if (opts_.host.find(':') != std::string::npos) return fmt::format("[{}]:{}", opts_.host, opts_.port);
  return fmt::format("{}:{}", opts_.host, opts_.port);
}

void TcpStore::connect() {
  // connect_timeout zero means one attempt (per address), not none: it gets the same time to
  // complete as any attempt, and its own outcome (refused, unreachable, ...) is the error.
  const bool once = opts_.connect_timeout <= Duration::zero();
  auto deadline = Clock::now() + (once ? Duration(kAttemptLimit) : opts_.connect_timeout);
  auto backoff = std::chrono::milliseconds(20);
  while (true) {
    openSocket(once, deadline, backoff);
    // Bounded by the connect deadline, not request_timeout: a server that accepts and stays
    // silent (SIGSTOPped, hung) is given up on when the caller said, not 30 s later.
    const auto opened = Clock::now();
    const auto handshakeDeadline =
        std::min(std::max<Clock::time_point>(deadline, opened + kHandshakeFloor), opened + opts_.request_timeout);
    try {
      try {
        handshake(handshakeDeadline);
        dropped_.clear();
      } catch (const NoReplyInTime&) {
        throw IoError(fmt::format(
            "store {}: the server accepted the connection but did not answer the handshake within {:.3g} s: it is "
            "stopped, hung or overloaded, or it is not a dtrain store; check the process listening there",
            endpoint(), seconds(handshakeDeadline - opened)));
      }
      return;
    } catch (const StoreBusyError& e) {
      // A store full for now is retried as one that is not up yet: connections free up.
      ::close(fd_);
      fd_ = -1;
      if (once) throw StoreBusyError(fmt::format("{} (one attempt, no retries)", e.what()));
      // Retried until the deadline, with a last attempt at it, as openSocket does: giving up
      // when the next back-off would pass the deadline ended up to a second early, while
      // the message said the whole connect timeout.
      const auto now = Clock::now();
      if (now >= deadline)
        throw StoreBusyError(fmt::format("{} (gave up after {:.3g} s)", e.what(), opts_.connect_timeout.count() / 1000.0));
      std::this_thread::sleep_for(std::min<Clock::duration>(backoff, deadline - now));
      backoff = std::min(backoff * 2, std::chrono::milliseconds(1000));
    } catch (...) {
      ::close(fd_);
      fd_ = -1;
      throw;
    }
  }
}

void TcpStore::openSocket(bool once, Clock::time_point deadline, std::chrono::milliseconds& backoff) {
  std::string lastError = "no attempt";
  sendMac_.reset();
  recvMac_.reset();
  while (true) {
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* res = nullptr;
    int gai = ::getaddrinfo(opts_.host.c_str(), std::to_string(opts_.port).c_str(), &hints, &res);
    bool permanent = false;
    if (gai != 0) {
      lastError = ::gai_strerror(gai);
      // A bad service or address family cannot get better. A name that does not exist may
      // yet (a pod's or a new host's DNS entry appears when it is ready): asked again until
      // the connect timeout, as any other failure to reach the store.
      permanent = gai == EAI_SERVICE || gai == EAI_FAMILY;
      if (gai == EAI_NONAME || permanent) lastError = fmt::format("cannot resolve host '{}': {}", opts_.host, lastError);
#ifdef EAI_NODATA
      if (gai == EAI_NODATA) lastError = fmt::format("cannot resolve host '{}': {}", opts_.host, lastError);
#endif
    } else {
      for (addrinfo* ai = res; ai; ai = ai->ai_next) {
        int fd = ::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, ai->ai_protocol);
        if (fd < 0) continue;
        int rc = ::connect(fd, ai->ai_addr, ai->ai_addrlen);
        if (rc != 0 && errno == EINPROGRESS) {
          // (at least 100 ms: the last attempt, made at the deadline, must still hear a refusal)
          auto attemptDeadline =
              std::min(std::max<Clock::time_point>(deadline, Clock::now() + std::chrono::milliseconds(100)),
                       Clock::now() + kAttemptLimit);
          if (waitFd(fd, POLLOUT, attemptDeadline)) {
            int err = 0;
            socklen_t len = sizeof(err);
            ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
            rc = err == 0 ? 0 : -1;
            errno = err;
          } else {
            errno = ETIMEDOUT;
          }
        }
        if (rc == 0) {
          int one = 1;
          ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
          fd_ = fd;
          break;
        }
        lastError = std::strerror(errno);
        ::close(fd);
      }
      ::freeaddrinfo(res);
    }
    if (fd_ >= 0) return;
    if (permanent) throw IoError(fmt::format("store {}: cannot connect: {}", endpoint(), lastError));
    if (once) throw IoError(fmt::format("store {}: cannot connect: {} (one attempt, no retries)", endpoint(), lastError));
    // (a last attempt at the deadline: giving up when the next back-off would pass it ended
    // up to a second early, while the message said the whole time)
    const auto now = Clock::now();
    if (now >= deadline)
      throw IoError(fmt::format("store {}: cannot connect: {} (gave up after {:.3g} s)", endpoint(), lastError,
                                opts_.connect_timeout.count() / 1000.0));
    std::this_thread::sleep_for(std::min<Clock::duration>(backoff, deadline - now));
    backoff = std::min(backoff * 2, std::chrono::milliseconds(1000));
  }
}

namespace {

// An ERROR in place of the handshake's next frame, as the error a caller can act on. These
// frames carry no MAC (there is no session key yet): a relay could forge one, but all it
// gains is a failed connection, which it can have by closing it. Its text, from a peer not
// yet known to be the store, is escaped (a NUL would cut the message short, a newline or
// a terminal control would reach the user's terminal).
[[noreturn]] void throwHandshakeError(const std::string& ep, const wire::Reply& r) {
  switch (r.code) {
    case ErrorCode::kAuthFailed:
      throw AuthError(fmt::format("store {}: authentication failed: wrong token; check DTRAIN_STORE_TOKEN or --token-file", ep));
    case ErrorCode::kVersion:
      throw AuthError(fmt::format("store {}: {}; use the same dtrain release for the store and its clients", ep,
                                  oneLine(r.message)));
    case ErrorCode::kQuota:
      throw StoreBusyError(
          fmt::format("store {}: the store cannot take this connection now: {}", ep, oneLine(r.message)));
    default:
      throw IoError(
          fmt::format("store {}: handshake refused: {} ({})", ep, oneLine(r.message), wire::errorCodeName(r.code)));
  }
}

}  // namespace

void TcpStore::handshake(Clock::time_point deadline) {
  // Challenge from the server; our nonce and proof of the token over both nonces back; the
  // server's proof over both, which a listener without the token cannot give.
  wire::Reply challenge = readReply(deadline);
  if (challenge.op == Op::kError) throwHandshakeError(endpoint(), challenge);
  if (challenge.op != Op::kChallenge)
    throw notAStore(endpoint(), fmt::format("it started with a frame of opcode {}, not the store's challenge",
                                            static_cast<int>(challenge.op)));
  if (challenge.num != wire::kVersion)
    throw AuthError(fmt::format("store {}: the server speaks store protocol version {}, this dtrain speaks version {}; "
                                "use the same dtrain release for the store and its clients",
                                endpoint(), challenge.num, wire::kVersion));
  if (challenge.value.size() != wire::kNonceSize)
    throw notAStore(endpoint(), fmt::format("its challenge holds a {}-byte nonce, not {}", challenge.value.size(),
                                            wire::kNonceSize));
  const std::string& serverNonce = challenge.value;
  const std::string clientNonce = randomBytes(wire::kNonceSize);
  wire::Request auth{Op::kAuth, {}, {clientNonce, auth::clientProof(opts_.token, serverNonce, clientNonce)}, wire::kVersion};
  sendRequest(auth, deadline);
  wire::Reply r = readReply(deadline);
  if (r.op == Op::kError) throwHandshakeError(endpoint(), r);
  if (r.op != Op::kProof || !auth::macEqual(r.value, auth::serverProof(opts_.token, serverNonce, clientNonce)))
    throw AuthError(fmt::format(
        "store {}: the server did not prove that it knows the job token, so it is not this job's store (another "
        "process listening at that address, or a stale store of another job); check the address and port "
        "(rendezvous.addr, --endpoint, DTRAIN_STORE_ADDR/PORT) and the token",
        endpoint()));
  std::string key = auth::sessionKey(opts_.token, serverNonce, clientNonce);
  sendMac_.emplace(key, auth::Direction::kClientToServer);
  recvMac_.emplace(std::move(key), auth::Direction::kServerToClient);
}

IoError TcpStore::dropConnection(const std::string& why) {
  ::close(fd_);
  fd_ = -1;
  sendMac_.reset();
  recvMac_.reset();
  dropped_ = why;
  return IoError(fmt::format("store {}: {}", endpoint(), why));
}

void TcpStore::sendRequest(const wire::Request& req, std::chrono::steady_clock::time_point deadline) {
  if (fd_ < 0) throw notConnected();
  std::string frame = wire::encodeRequest(req);
  if (sendMac_) frame = sendMac_->seal(std::move(frame));
  size_t sent = 0;
  while (sent < frame.size()) {
    ssize_t n = ::send(fd_, frame.data() + sent, frame.size() - sent, MSG_NOSIGNAL);
    if (n > 0) {
      sent += static_cast<size_t>(n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      if (!waitFd(fd_, POLLOUT, deadline))
        throw NoReplyInTime(dropConnection("timed out sending a request: the server does not read it").what());
      continue;
    }
    throw dropConnection(fmt::format("connection lost: {}", std::strerror(errno)));
  }
}

wire::Reply TcpStore::readReply(std::chrono::steady_clock::time_point deadline) {
  if (fd_ < 0) throw notConnected();
  std::string buf;
  size_t want = wire::kHeaderSize;
  bool haveHeader = false;
  // A server never sends a frame over its max_frame (a MULTI_GET reply that would be larger
  // is refused with TOO_LARGE), so nothing larger is read before the connection is dropped.
  // Before the handshake is done the peer is not known to be the store: no more than the
  // largest handshake frame (an ERROR with its longest message).
  wire::Limits lim;
  if (!recvMac_) lim.max_frame = kMaxHandshakeReply;
  while (buf.size() < want) {
    char tmp[65536];
    ssize_t n = ::recv(fd_, tmp, std::min(sizeof(tmp), want - buf.size()), 0);
    if (n > 0) {
      // The store answered: the rest of its reply (up to 16 MiB on a slow link) gets
      // request_timeout, however little of a wait's grace is left. (Not in the handshake,
      // whose frames are small and whose peer is not known to be the store yet.)
      if (buf.empty() && recvMac_) deadline = std::max(deadline, Clock::now() + opts_.request_timeout);
      buf.append(tmp, static_cast<size_t>(n));
      if (!haveHeader && buf.size() == wire::kHeaderSize) {
        haveHeader = true;
        try {
          want += wire::decodeHeader(buf, lim);
        } catch (const wire::WireError& e) {
          throwBadReply(buf, e.what());
        }
      }
      continue;
    }
    if (n == 0) throw dropConnection("connection closed by the store server");
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) {
      if (!waitFd(fd_, POLLIN, deadline)) throw NoReplyInTime(dropConnection("no reply in time").what());
      continue;
    }
    throw dropConnection(fmt::format("connection lost: {}", std::strerror(errno)));
  }
  std::string_view header = std::string_view(buf).substr(0, wire::kHeaderSize);
  std::string_view body = std::string_view(buf).substr(wire::kHeaderSize);
  if (recvMac_) {
    auto opened = recvMac_->open(header, body);
    if (!opened)
      throw dropConnection("a reply failed its integrity check: it was altered, dropped, replayed or injected on the "
                           "way, or did not come from the store; connection dropped");
    body = *opened;
  }
  try {
    return wire::decodeReply(body, lim);
  } catch (const wire::WireError& e) {
    throwBadReply(buf, e.what());
  }
}

void TcpStore::throwBadReply(std::string seen, const std::string& why) {
  if (recvMac_) throw dropConnection(fmt::format("bad reply: {}", why));
  // In the handshake: what the peer sent, as far as it is here, shows what it is.
  constexpr size_t kShown = 32;
  if (seen.size() <= kShown) {
    char more[kShown + 1];
    ssize_t n = ::recv(fd_, more, kShown + 1 - seen.size(), MSG_DONTWAIT);
    if (n > 0) seen.append(more, static_cast<size_t>(n));
  }
  const bool cut = seen.size() > kShown;
  seen.resize(std::min(seen.size(), kShown));
  dropConnection(fmt::format("bad reply: {}", why));
  throw notAStore(endpoint(), fmt::format("it sent \"{}{}\" where the store's handshake was expected: {}",
                                          oneLine(seen), cut ? "..." : "", why));
}

// One request, one reply. A request that does not wait gets request_timeout; one that waits
// on the server (GET, WAIT, MULTI_GET) gets its wait plus wait_grace, so that the server's
// own typed TIMEOUT, sent at its deadline, arrives first, while a server that stopped
// answering holds the caller about as long as it asked to wait, not request_timeout more.
wire::Reply TcpStore::call(const wire::Request& req, Duration serverWait) {
  const bool waits = req.op == Op::kGet || req.op == Op::kWait || req.op == Op::kMultiGet;
  // Past a century the sum below could overflow the clock; such a wait is unbounded anyway.
  const bool unbounded =
      waits && (serverWait < Duration::zero() || serverWait > Duration(std::chrono::hours(24 * 365 * 100)));
  const Duration grace = std::min(opts_.wait_grace, opts_.request_timeout);
  const Duration budget = waits ? serverWait + grace : opts_.request_timeout;
  const auto deadline = unbounded ? Clock::time_point::max() : Clock::now() + budget;
  wire::Reply r;
  try {
    sendRequest(req, deadline);
    r = readReply(deadline);
  } catch (const NoReplyInTime&) {
    if (!waits)
      throw IoError(
          fmt::format("store {}: no reply within {:.3g} s: the server did not answer (stopped, hung or cut "
                      "off?); connection dropped",
                      endpoint(), seconds(budget)));
    // The wait's time is up as far as the caller is concerned: a timeout, as the server's
    // own would have been, but the connection is gone (its late reply would be out of step).
    throw TimeoutError(
        fmt::format("store {}: no reply within {:.3g} s (the {:.3g} s wait and {:.3g} s grace): the "
                    "server did not answer (stopped, hung or cut off?); connection dropped",
                    endpoint(), seconds(budget), seconds(serverWait), seconds(grace)));
  }
  // The store closes the connection after this error: our request reached it altered.
  if (r.op == Op::kError && r.code == ErrorCode::kIntegrity)
    throw dropConnection(fmt::format("the store found our request altered on the way ({}); connection dropped", r.message));
  return r;
}

namespace {

[[noreturn]] void raise(const std::string& ep, const wire::Reply& r) {
  // (escaped: a NUL in the store's text would cut the message short where it is printed)
  std::string msg = fmt::format("store {}: {}", ep, oneLine(r.message));
  switch (r.code) {
    case ErrorCode::kTimeout: throw TimeoutError(msg);
    // The server's message already says what was wrong; the code's name would repeat it.
    case ErrorCode::kNotInteger: throw NotIntegerError(msg);
    case ErrorCode::kOutOfRange: throw OutOfRangeError(msg);
    case ErrorCode::kTooLarge: throw RequestRefusedError(fmt::format("{} ({})", msg, wire::errorCodeName(r.code)));
    default: throw StoreError(fmt::format("{} ({})", msg, wire::errorCodeName(r.code)));
  }
}

wire::Reply expect(const std::string& ep, wire::Reply r, Op op) {
  if (r.op == Op::kError) raise(ep, r);
  if (r.op != op) throw IoError(fmt::format("store {}: unexpected reply opcode {}", ep, static_cast<int>(r.op)));
  return r;
}

int64_t ms(Duration d) { return d < Duration::zero() ? -1 : d.count(); }

}  // namespace

void TcpStore::set(const std::string& key, const Bytes& value) {
  std::lock_guard<std::mutex> l(mu_);
  expect(endpoint(), call({Op::kSet, {key}, {value}, 0}, Duration::zero()), Op::kOk);
}

Bytes TcpStore::get(const std::string& key) {
  std::lock_guard<std::mutex> l(mu_);
  return expect(endpoint(), call({Op::kGet, {key}, {}, ms(timeout_)}, timeout_), Op::kValue).value;
}

int64_t TcpStore::add(const std::string& key, int64_t delta) {
  std::lock_guard<std::mutex> l(mu_);
  return expect(endpoint(), call({Op::kAdd, {key}, {}, delta}, Duration::zero()), Op::kInt).num;
}

Bytes TcpStore::compareSet(const std::string& key, const Bytes& expected, const Bytes& desired) {
  std::lock_guard<std::mutex> l(mu_);
  return expect(endpoint(), call({Op::kCompareSet, {key}, {expected, desired}, 0}, Duration::zero()), Op::kValue).value;
}

bool TcpStore::check(const std::vector<std::string>& keys) {
  std::lock_guard<std::mutex> l(mu_);
  return expect(endpoint(), call({Op::kCheck, keys, {}, 0}, Duration::zero()), Op::kBool).flag;
}

void TcpStore::wait(const std::vector<std::string>& keys, Duration timeout) {
  std::lock_guard<std::mutex> l(mu_);
  expect(endpoint(), call({Op::kWait, keys, {}, ms(timeout)}, timeout), Op::kOk);
}

bool TcpStore::deleteKey(const std::string& key) {
  std::lock_guard<std::mutex> l(mu_);
  return expect(endpoint(), call({Op::kDelete, {key}, {}, 0}, Duration::zero()), Op::kBool).flag;
}

int64_t TcpStore::numKeys() {
  std::lock_guard<std::mutex> l(mu_);
  return expect(endpoint(), call({Op::kNumKeys, {}, {}, 0}, Duration::zero()), Op::kInt).num;
}

void TcpStore::append(const std::string& key, const Bytes& value) {
  std::lock_guard<std::mutex> l(mu_);
  expect(endpoint(), call({Op::kAppend, {key}, {value}, 0}, Duration::zero()), Op::kOk);
}

std::vector<Bytes> TcpStore::multiGet(const std::vector<std::string>& keys) {
  std::lock_guard<std::mutex> l(mu_);
  return expect(endpoint(), call({Op::kMultiGet, keys, {}, ms(timeout_)}, timeout_), Op::kValues).values;
}

void TcpStore::multiSet(const std::vector<std::string>& keys, const std::vector<Bytes>& values) {
  if (keys.size() != values.size())
    throw StoreError(fmt::format("multiSet: {} keys but {} values", keys.size(), values.size()));
  std::lock_guard<std::mutex> l(mu_);
  expect(endpoint(), call({Op::kMultiSet, keys, values, 0}, Duration::zero()), Op::kOk);
}

void TcpStore::ping() {
  std::lock_guard<std::mutex> l(mu_);
  expect(endpoint(), call({Op::kPing, {}, {}, 0}, Duration::zero()), Op::kOk);
}

void TcpStore::setRequestTimeout(Duration t) {
  std::lock_guard<std::mutex> l(mu_);
  opts_.request_timeout = t;
}

}  // namespace dtrain::store
