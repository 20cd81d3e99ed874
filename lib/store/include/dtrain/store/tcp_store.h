#pragma once
// TcpStore: the Store over TCP. The server is Boost.Asio on one thread (a blocked wait
// costs no thread); the client is a blocking socket with a deadline on every call.
#include <memory>
#include <mutex>
#include <optional>
#include <string>

#include "dtrain/common/errors.h"
#include "dtrain/store/auth.h"
#include "dtrain/store/store.h"
#include "dtrain/store/wire.h"

namespace dtrain::store {

// The two sides do not share the job's token: the server refused ours, the server could not
// prove it knows it (not the job's store: another process listening at that address), or
// they speak different protocol versions. Retrying will not help.
class AuthError : public IoError {
 public:
  using IoError::IoError;
};

// The store is up but cannot take this connection now (QUOTA in the handshake: it holds its
// limit of connections, or dropped this one among too many still authenticating). Not a
// token problem; the client retries until connect_timeout before throwing it.
class StoreBusyError : public StoreError {
 public:
  using StoreError::StoreError;
};

struct TcpStoreServerOptions {
  std::string bind = "127.0.0.1";  // "0.0.0.0" / "::" only when remote nodes must reach it
  int port = 0;                    // 0 = pick a free one; port() tells which
  std::string token;               // shared secret for the HMAC handshake; must be non-empty
  wire::Limits limits;
  size_t max_total_keys = 1u << 20;
  size_t max_total_bytes = 1ull << 30;
  // Authenticated connections; one more is refused with QUOTA at its AUTH.
  size_t max_connections = 4096;
  // Connections still authenticating, counted apart: past this, a new one drops the oldest
  // (with QUOTA). Honest clients authenticate within a round trip, so only a flood of
  // connections that never authenticate is dropped, and it cannot take authenticated slots.
  size_t max_unauthenticated = 256;
  // Bytes of unfinished frames, unread replies and waits' keys held across all authenticated
  // connections: many clients each sending most of a maximal frame, asking for large values
  // and not reading them, or waiting on many large keys, cannot exhaust memory (a reply or a
  // wait past it is answered QUOTA). Unauthenticated connections do
  // not count (each holds at most a 128-byte frame, wire::kMaxHandshakeFrame), so they
  // cannot spend this budget for the job's own clients.
  size_t max_buffered_bytes = 256u << 20;
  Duration handshake_timeout{std::chrono::seconds(10)};  // connect -> authenticated
  Duration frame_timeout{std::chrono::seconds(10)};      // first byte of a frame -> last byte
  Duration idle_timeout{Duration::zero()};               // zero = idle connections may stay
};

// Owns the listening socket, every session and the server thread. Not copyable.
// Thread-safety: start/stop/port from one owner thread.
class TcpStoreServer {
 public:
  explicit TcpStoreServer(TcpStoreServerOptions opts);
  ~TcpStoreServer();
  TcpStoreServer(const TcpStoreServer&) = delete;
  TcpStoreServer& operator=(const TcpStoreServer&) = delete;

  int port() const;
  // Serves on a background thread until stop() or destruction.
  void start();
  // Serves on the calling thread until stop() from another thread or a signal handler's
  // requestStop().
  void run();
  void stop();
  size_t connectionCount() const;
  // Memory the authenticated sessions' buffers hold (their capacity: requests being read,
  // replies being written), and entries in the table of waits on keys: both bounded by what is in flight,
  // not by what connections once did. For diagnostics and tests; any thread.
  size_t heldBytes() const;
  size_t waiterEntryCount() const;

  struct Impl;  // opaque; public only so that the .cc's sessions can name it

 private:
  std::unique_ptr<Impl> impl_;
};

struct TcpStoreOptions {
  std::string host = "127.0.0.1";
  int port = 29400;
  std::string token;
  Duration connect_timeout{std::chrono::seconds(30)};  // retries with backoff until then; zero: one attempt
  Duration timeout = kDefaultTimeout;                  // default for get/wait/multiGet
  // How long the reply to a request that does not wait (set, add, check, ...) may take
  // before the connection is dropped as lost; it also caps the handshake and wait_grace. A
  // caller with a deadline of its own (the agent's heartbeat: the store gone for 5 s) sets
  // it lower. The handshake must also end by connect_timeout (at least 0.5 s after the
  // TCP connection is made): a server that accepts and stays silent (stopped, hung) is
  // given up on then, not request_timeout later.
  Duration request_timeout{std::chrono::seconds(30)};
  // How long past a server-side wait (get, wait, multiGet with a timeout) the client waits
  // for the server's reply before giving up on the server (a TimeoutError that drops the
  // connection). The server answers TIMEOUT at its deadline; this grace lets that typed
  // answer arrive first instead of racing it, and it bounds a wait on a server that
  // stopped answering to about its timeout, not timeout + request_timeout. Seconds, not
  // less: a reply late by a loaded launcher host or a TCP retransmit must not cost the
  // connection (the client does not reconnect).
  Duration wait_grace{std::chrono::seconds(5)};
};

// Client. One connection, one request at a time (calls are serialized by a mutex, so a
// TcpStore may be shared between threads; a waiting call blocks the others).
class TcpStore final : public Store {
 public:
  explicit TcpStore(TcpStoreOptions opts);
  ~TcpStore() override;
  TcpStore(const TcpStore&) = delete;
  TcpStore& operator=(const TcpStore&) = delete;

  void set(const std::string& key, const Bytes& value) override;
  Bytes get(const std::string& key) override;
  int64_t add(const std::string& key, int64_t delta) override;
  Bytes compareSet(const std::string& key, const Bytes& expected, const Bytes& desired) override;
  bool check(const std::vector<std::string>& keys) override;
  void wait(const std::vector<std::string>& keys, Duration timeout) override;
  using Store::wait;
  bool deleteKey(const std::string& key) override;
  int64_t numKeys() override;
  void append(const std::string& key, const Bytes& value) override;
  std::vector<Bytes> multiGet(const std::vector<std::string>& keys) override;
  void multiSet(const std::vector<std::string>& keys, const std::vector<Bytes>& values) override;
  void ping();
  // request_timeout from now on (a caller whose deadline shrinks as a budget is spent).
  void setRequestTimeout(Duration t);

  std::string endpoint() const;
  // The local IP address of the connection to the store: the address peers on other hosts
  // can reach this host at.
  std::string localAddress() const;

 private:
  wire::Reply call(const wire::Request& req, Duration serverWait);
  void sendRequest(const wire::Request& req, std::chrono::steady_clock::time_point deadline);
  wire::Reply readReply(std::chrono::steady_clock::time_point deadline);
  // Closes the connection and returns the error to throw.
  IoError dropConnection(const std::string& why);
  // "not connected", with why the connection was dropped when it was.
  IoError notConnected() const;
  // A reply that does not decode: drops the connection and throws an IoError; in the
  // handshake an AuthError saying the peer is not a dtrain store, showing what it sent
  // (`seen`, and what more is already here).
  [[noreturn]] void throwBadReply(std::string seen, const std::string& why);
  void connect();
  // Opens the TCP connection (fd_), retrying until `deadline` unless `once`.
  void openSocket(bool once, std::chrono::steady_clock::time_point deadline, std::chrono::milliseconds& backoff);
  // Mutual authentication on fd_, done by `deadline`; then every frame is sealed (sendMac_)
  // and checked (recvMac_). Throws AuthError, StoreBusyError or IoError; the caller closes fd_.
  void handshake(std::chrono::steady_clock::time_point deadline);

  TcpStoreOptions opts_;
  std::mutex mu_;
  int fd_ = -1;
  std::optional<auth::FrameMac> sendMac_, recvMac_;  // set by a completed handshake
  std::string dropped_;                              // why the connection was dropped, for the calls that follow
};

// 32 random bytes from the kernel.
std::string randomBytes(size_t n);

}  // namespace dtrain::store
