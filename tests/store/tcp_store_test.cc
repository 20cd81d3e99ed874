#include "dtrain/store/tcp_store.h"

#include <arpa/inet.h>
#include <malloc.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <deque>
#include <functional>
#include <limits>
#include <mutex>
#include <thread>

#include "dtrain/common/errors.h"
#include "dtrain/store/auth.h"
#include "dtrain/store/wire.h"

namespace dtrain::store {
namespace {

using namespace std::chrono_literals;
using wire::ErrorCode;
using wire::Op;

const std::string kToken = "test-token-0123456789";

bool mentions(const std::exception& e, const char* what) {
  return std::string(e.what()).find(what) != std::string::npos;
}

class TcpStoreTest : public ::testing::Test {
 protected:
  void SetUp() override { startServer({}); }
  void startServer(TcpStoreServerOptions o) {
    server_.reset();
    o.token = kToken;
    server_ = std::make_unique<TcpStoreServer>(o);
    server_->start();
  }
  std::unique_ptr<TcpStore> client(const std::string& token = kToken) {
    TcpStoreOptions o;
    o.port = server_->port();
    o.token = token;
    o.connect_timeout = 2s;
    return std::make_unique<TcpStore>(o);
  }
  std::unique_ptr<TcpStoreServer> server_;
};

// A raw socket for talking the protocol by hand. After auth() it seals what it sends and
// checks what it reads, as a client must (docs/store-protocol.md).
class Raw {
 public:
  explicit Raw(int port) {
    fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(static_cast<uint16_t>(port));
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    EXPECT_EQ(::connect(fd_, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
  }
  ~Raw() { ::close(fd_); }
  void sendRaw(std::string_view b) {
    ASSERT_EQ(::send(fd_, b.data(), b.size(), MSG_NOSIGNAL), static_cast<ssize_t>(b.size()));
  }
  // One whole frame (header + body), with its MAC once authenticated.
  std::string seal(std::string frame) { return sendMac_ ? sendMac_->seal(std::move(frame)) : frame; }
  void send(std::string frame) { sendRaw(seal(std::move(frame))); }
  // Reads one reply frame, or nullopt on close / timeout. Once authenticated, a frame whose
  // MAC does not verify fails the test.
  std::optional<wire::Reply> read(std::chrono::milliseconds timeout = 3000ms) {
    std::string buf;
    size_t want = 4;
    bool header = false;
    while (buf.size() < want) {
      pollfd p{fd_, POLLIN, 0};
      if (::poll(&p, 1, static_cast<int>(timeout.count())) <= 0) return std::nullopt;
      char tmp[4096];
      ssize_t n = ::recv(fd_, tmp, std::min(sizeof(tmp), want - buf.size()), 0);
      if (n <= 0) return std::nullopt;
      buf.append(tmp, static_cast<size_t>(n));
      if (!header && buf.size() == 4) {
        header = true;
        want += wire::decodeHeader(buf, wire::Limits{});
      }
    }
    std::string_view body = std::string_view(buf).substr(4);
    if (recvMac_) {
      auto opened = recvMac_->open(std::string_view(buf).substr(0, 4), body);
      EXPECT_TRUE(opened) << "reply failed its MAC";
      if (!opened) return std::nullopt;
      body = *opened;
    }
    return wire::decodeReply(body, wire::Limits{});
  }
  bool closedByPeer(std::chrono::milliseconds timeout) {
    pollfd p{fd_, POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(timeout.count())) <= 0) return false;
    char c;
    while (true) {
      ssize_t n = ::recv(fd_, &c, 1, 0);
      if (n <= 0) return true;
      if (::poll(&p, 1, static_cast<int>(timeout.count())) <= 0) return false;
    }
  }
  // Reads the challenge, sends AUTH (version 2) and checks the server's PROOF.
  void auth(const std::string& token = kToken) {
    auto c = read();
    ASSERT_TRUE(c);
    ASSERT_EQ(c->op, Op::kChallenge);
    ASSERT_EQ(c->num, wire::kVersion);
    std::string clientNonce = randomBytes(wire::kNonceSize);
    send(wire::encodeRequest({Op::kAuth, {}, {clientNonce, auth::clientProof(token, c->value, clientNonce)}, wire::kVersion}));
    auto p = read();
    ASSERT_TRUE(p);
    ASSERT_EQ(p->op, Op::kProof) << p->message;
    ASSERT_TRUE(auth::macEqual(p->value, auth::serverProof(token, c->value, clientNonce)));
    std::string key = auth::sessionKey(token, c->value, clientNonce);
    sendMac_.emplace(key, auth::Direction::kClientToServer);
    recvMac_.emplace(key, auth::Direction::kServerToClient);
  }
  int fd() const { return fd_; }

 private:
  int fd_;
  std::optional<auth::FrameMac> sendMac_, recvMac_;
};

TEST_F(TcpStoreTest, AllOperations) {
  auto s = client();
  std::string key("bin\0key", 7), val("\xff\x00v", 3);
  s->set(key, val);
  EXPECT_EQ(s->get(key), val);
  EXPECT_EQ(s->add("n", 3), 3);
  EXPECT_EQ(s->add("n", -1), 2);
  EXPECT_EQ(s->compareSet("cas", "x", "y"), "x");
  EXPECT_EQ(s->compareSet("cas", "", "y"), "y");
  EXPECT_EQ(s->compareSet("cas", "y", "z"), "z");
  EXPECT_TRUE(s->check({key, "n"}));
  EXPECT_FALSE(s->check({"absent"}));
  s->append("log", "a");
  s->append("log", "b");
  EXPECT_EQ(s->get("log"), "ab");
  s->multiSet({"m1", "m2"}, {"1", "2"});
  EXPECT_EQ(s->multiGet({"m2", "m1"}), (std::vector<Bytes>{"2", "1"}));
  EXPECT_EQ(s->numKeys(), 6);
  EXPECT_TRUE(s->deleteKey("log"));
  EXPECT_FALSE(s->deleteKey("log"));
  s->set("text", "abc");
  EXPECT_THROW(s->add("text", 1), StoreError);
  s->ping();  // the connection survives a typed error
}

// The server shares HashStore's add rule: overflow and non-integers are typed errors that
// leave the value as it was, and the message says what is wrong once.
TEST_F(TcpStoreTest, AddRefusesOverflowAndNonIntegers) {
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max(), kMin = std::numeric_limits<int64_t>::min();
  auto s = client();
  EXPECT_EQ(s->add("ov", kMax), kMax);
  try {
    s->add("ov", 1);
    FAIL() << "overflow not refused";
  } catch (const OutOfRangeError& e) {
    std::string m = e.what();
    EXPECT_NE(m.find("add on key 'ov': 9223372036854775807 + 1 would overflow int64"), std::string::npos) << m;
  }
  EXPECT_EQ(s->get("ov"), std::to_string(kMax));
  EXPECT_EQ(s->add("neg", kMin), kMin);
  EXPECT_THROW(s->add("neg", -1), OutOfRangeError);
  EXPECT_EQ(s->get("neg"), std::to_string(kMin));
  s->set("text", "abc");
  try {
    s->add("text", 1);
    FAIL() << "non-integer not refused";
  } catch (const NotIntegerError& e) {
    std::string m = e.what();
    EXPECT_NE(m.find("key 'text'"), std::string::npos) << m;
    EXPECT_EQ(m.find("not an integer"), m.rfind("not an integer")) << "said twice: " << m;
  }
  EXPECT_EQ(s->get("text"), "abc");
  // On the wire: OUT_OF_RANGE (10), connection kept.
  Raw r(server_->port());
  r.auth();
  r.send(wire::encodeRequest({Op::kAdd, {"ov"}, {}, kMax}));
  auto rep = r.read();
  ASSERT_TRUE(rep);
  EXPECT_EQ(rep->op, Op::kError);
  EXPECT_EQ(rep->code, ErrorCode::kOutOfRange);
  r.send(wire::encodeRequest({Op::kPing, {}, {}, 0}));
  EXPECT_EQ(r.read()->op, Op::kOk);
}

// A timeout_ms too large for the server's clock (network bytes) waits as long as the clock
// can, not a wrapped-around amount that could be already past.
TEST_F(TcpStoreTest, HugeWaitTimeoutIsNotWrapped) {
  for (int64_t t : {std::numeric_limits<int64_t>::max(), int64_t{1} << 53}) {
    Raw r(server_->port());
    r.auth();
    std::string key = "later" + std::to_string(t);
    r.send(wire::encodeRequest({Op::kGet, {key}, {}, t}));
    EXPECT_FALSE(r.read(300ms)) << "timeout " << t << " ms replied at once";
    client()->set(key, "v");
    auto rep = r.read();
    ASSERT_TRUE(rep);
    EXPECT_EQ(rep->op, Op::kValue);
  }
}

// timeout_ms = -1 waits forever (docs/store-protocol.md) for GET, WAIT and MULTI_GET: the
// connection stays open until a SET from another connection wakes it. The session once
// had nothing holding it while waiting without a timer and closed at once.
TEST_F(TcpStoreTest, WaitForeverIsWokenBySetFromAnotherConnection) {
  const std::vector<wire::Request> waits = {
      {Op::kGet, {"g"}, {}, -1}, {Op::kWait, {"w1", "w2"}, {}, -1}, {Op::kMultiGet, {"m1", "m2"}, {}, -1}};
  for (const auto& q : waits) {
    Raw r(server_->port());
    r.auth();
    r.send(wire::encodeRequest(q));
    EXPECT_FALSE(r.closedByPeer(400ms)) << "opcode " << static_cast<int>(q.op) << " closed instead of waiting";
    auto setter = client();
    for (size_t i = 0; i < q.keys.size(); ++i) setter->set(q.keys[i], "v" + std::to_string(i));
    auto rep = r.read();
    ASSERT_TRUE(rep) << "opcode " << static_cast<int>(q.op);
    EXPECT_NE(rep->op, Op::kError) << rep->value;
    // The connection goes on after the wait.
    r.send(wire::encodeRequest({Op::kPing, {}, {}, 0}));
    ASSERT_EQ(r.read()->op, Op::kOk);
  }
}

// A client that hangs up while waiting forever does not leave its session behind: the
// server notices within a sweep or two and frees it, also when it had pipelined a request.
TEST_F(TcpStoreTest, WaiterThatDisconnectsIsFreed) {
  auto base = server_->connectionCount();
  for (bool pipelined : {false, true}) {
    {
      Raw r(server_->port());
      r.auth();
      std::string frames = r.seal(wire::encodeRequest({Op::kGet, {"never"}, {}, -1}));
      if (pipelined) frames += r.seal(wire::encodeRequest({Op::kPing, {}, {}, 0}));
      r.sendRaw(frames);
      EXPECT_FALSE(r.closedByPeer(300ms));
      EXPECT_EQ(server_->connectionCount(), base + 1);
    }
    auto deadline = std::chrono::steady_clock::now() + 3s;
    while (server_->connectionCount() > base && std::chrono::steady_clock::now() < deadline)
      std::this_thread::sleep_for(20ms);
    EXPECT_EQ(server_->connectionCount(), base) << "waiting session leaked (pipelined: " << pipelined << ")";
  }
  client()->set("never", "now");  // its waiter entry is gone: nothing to wake
  client()->ping();
}

TEST_F(TcpStoreTest, CounterExactAcross16Clients) {
  std::vector<std::thread> ts;
  for (int t = 0; t < 16; ++t)
    ts.emplace_back([&] {
      auto c = client();
      for (int i = 0; i < 1000; ++i) c->add("ctr", 1);
    });
  for (auto& t : ts) t.join();
  EXPECT_EQ(client()->get("ctr"), "16000");
}

TEST_F(TcpStoreTest, WaitWokenAndTimeoutPrecise) {
  auto waiter = client();
  std::thread setter([&] {
    std::this_thread::sleep_for(100ms);
    client()->set("ready", "1");
  });
  auto start = std::chrono::steady_clock::now();
  waiter->wait({"ready"}, 5s);
  EXPECT_LT(std::chrono::steady_clock::now() - start, 2s);
  setter.join();

  start = std::chrono::steady_clock::now();
  try {
    waiter->wait({"ready", "never"}, 500ms);
    FAIL();
  } catch (const TimeoutError& e) {
    EXPECT_NE(std::string(e.what()).find("store 127.0.0.1:"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("timed out after 0.5 s waiting for key 'never'"), std::string::npos) << e.what();
  }
  auto took = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - start).count();
  EXPECT_GE(took, 500);
  EXPECT_LE(took, 550);
  waiter->setTimeout(200ms);
  EXPECT_THROW(waiter->get("never"), TimeoutError);
  waiter->ping();
}

TEST_F(TcpStoreTest, WrongTokenAndUnreachableAreDistinct) {
  auto start = std::chrono::steady_clock::now();
  try {
    client("wrong");
    FAIL();
  } catch (const AuthError& e) {
    EXPECT_NE(std::string(e.what()).find("authentication failed: wrong token"), std::string::npos) << e.what();
  }
  // A wrong AUTH is answered late: guessing costs a connection and that wait.
  EXPECT_GE(std::chrono::steady_clock::now() - start, 90ms);
  TcpStoreOptions o;
  o.port = 1;  // nothing listens there
  o.token = kToken;
  o.connect_timeout = 1500ms;
  const auto tried = std::chrono::steady_clock::now();
  try {
    TcpStore s(o);
    FAIL();
  } catch (const IoError& e) {
    EXPECT_NE(std::string(e.what()).find("store 127.0.0.1:1: cannot connect: Connection refused (gave up after 1.5 s)"),
              std::string::npos)
        << e.what();
  }
  // It tries for the time it says (it gave up when the next back-off, 800 ms here, would pass
  // the deadline: after ~0.7 s), with a last attempt at the deadline.
  const auto took = std::chrono::steady_clock::now() - tried;
  EXPECT_GE(took, 1450ms);
  EXPECT_LT(took, 2500ms);
}

// A server that accepts but never answers (stopped, or a host cut off behind a proxy) holds a
// client up to request_timeout, not the 30 s default: the agent's heartbeat relies on it.
TEST_F(TcpStoreTest, RequestTimeoutBoundsASilentServer) {
  int lfd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::bind(lfd, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
  ASSERT_EQ(::listen(lfd, 4), 0);  // the kernel completes connections; nobody accepts them
  socklen_t len = sizeof(a);
  ASSERT_EQ(::getsockname(lfd, reinterpret_cast<sockaddr*>(&a), &len), 0);
  TcpStoreOptions o;
  o.port = ntohs(a.sin_port);
  o.token = kToken;
  o.connect_timeout = 5s;
  o.request_timeout = 300ms;
  auto start = std::chrono::steady_clock::now();
  try {
    TcpStore s(o);
    FAIL();
  } catch (const IoError& e) {
    EXPECT_NE(std::string(e.what()).find("did not answer the handshake within 0.3 s"), std::string::npos) << e.what();
  }
  auto took = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - start).count();
  EXPECT_GE(took, 250);  // (poll's millisecond rounding)
  EXPECT_LT(took, 1500);
  ::close(lfd);
  // A healthy store answers within a short request timeout as before.
  auto c = client();
  c->setRequestTimeout(200ms);
  c->set("k", "v");
  EXPECT_EQ(c->get("k"), "v");
}

TEST_F(TcpStoreTest, CommandsBeforeHandshakeAreRefused) {
  Raw r(server_->port());
  ASSERT_TRUE(r.read());  // challenge
  r.send(wire::encodeRequest({Op::kSet, {"k"}, {"v"}, 0}));
  auto rep = r.read();
  ASSERT_TRUE(rep);
  EXPECT_EQ(rep->op, Op::kError);
  EXPECT_EQ(rep->code, ErrorCode::kNotAuthenticated);
  EXPECT_TRUE(r.closedByPeer(2000ms));
  EXPECT_FALSE(client()->check({"k"}));
  // An opcode no version has, before the handshake: the same answer (not which opcodes exist).
  Raw u(server_->port());
  ASSERT_TRUE(u.read());
  u.sendRaw(std::string("\x00\x00\x00\x01\x7f", 5));
  rep = u.read();
  ASSERT_TRUE(rep);
  EXPECT_EQ(rep->code, ErrorCode::kNotAuthenticated);
  EXPECT_TRUE(u.closedByPeer(2000ms));
}

TEST_F(TcpStoreTest, TypedErrorsAndServerStaysUp) {
  Raw r(server_->port());
  r.auth();
  // Unknown opcode: typed error, connection usable afterwards.
  r.send(std::string("\x00\x00\x00\x01\x63", 5));
  auto rep = r.read();
  ASSERT_TRUE(rep);
  EXPECT_EQ(rep->code, ErrorCode::kUnknownOpcode);
  // Value length 2^32-1 inside a small frame.
  r.send(std::string("\x00\x00\x00\x0a\x01\x00\x00\x00\x01k\xff\xff\xff\xff", 14));
  rep = r.read();
  ASSERT_TRUE(rep);
  EXPECT_EQ(rep->code, ErrorCode::kTooLarge);
  r.send(wire::encodeRequest({Op::kPing, {}, {}, 0}));
  EXPECT_EQ(r.read()->op, Op::kOk);
  // A frame length of 2^32-1 (and limit+1) is fatal: typed error, then close.
  Raw big(server_->port());
  big.auth();
  big.sendRaw(std::string("\xff\xff\xff\xff", 4));
  rep = big.read();
  ASSERT_TRUE(rep);
  EXPECT_EQ(rep->code, ErrorCode::kTooLarge);
  EXPECT_TRUE(big.closedByPeer(2000ms));
  client()->ping();
}

TEST_F(TcpStoreTest, FrameSplitAtEveryByteBoundary) {
  std::string frame = wire::encodeRequest({Op::kMultiSet, {"alpha", "beta"}, {"one", "two"}, 0});
  for (size_t cut = 1; cut < frame.size(); ++cut) {
    Raw r(server_->port());
    r.auth();
    std::string sealed = r.seal(frame);
    r.sendRaw(std::string_view(sealed).substr(0, cut));
    std::this_thread::sleep_for(1ms);
    r.sendRaw(std::string_view(sealed).substr(cut));
    auto rep = r.read();
    ASSERT_TRUE(rep) << cut;
    EXPECT_EQ(rep->op, Op::kOk) << cut;
  }
  EXPECT_EQ(client()->get("beta"), "two");
}

TEST_F(TcpStoreTest, SlowLorisIsDropped) {
  TcpStoreServerOptions o;
  o.frame_timeout = 500ms;
  o.handshake_timeout = 500ms;
  startServer(o);
  Raw silent(server_->port());  // never authenticates
  Raw slow(server_->port());
  slow.auth();
  slow.sendRaw(std::string("\x00\x00", 2));  // half a header, then nothing
  EXPECT_TRUE(silent.closedByPeer(3000ms));
  EXPECT_TRUE(slow.closedByPeer(3000ms));
  client()->ping();
}

TEST_F(TcpStoreTest, QuotaErrors) {
  TcpStoreServerOptions o;
  o.max_total_keys = 3;
  o.max_total_bytes = 1000;
  startServer(o);
  auto s = client();
  s->set("a", "1");
  s->set("b", "2");
  s->set("c", "3");
  try {
    s->set("d", "4");
    FAIL();
  } catch (const StoreError& e) {
    EXPECT_NE(std::string(e.what()).find("quota exceeded"), std::string::npos) << e.what();
  }
  s->set("a", "overwrite is fine");
  EXPECT_THROW(s->set("b", std::string(2000, 'x')), StoreError);
  EXPECT_EQ(s->get("b"), "2");
}

// A MULTI_SET is admitted as a whole: checked key by key against the store as it was, two
// values that fit one at a time went over the limit together.
TEST_F(TcpStoreTest, MultiSetQuotaCountsTheWholeBatch) {
  TcpStoreServerOptions o;
  o.max_total_bytes = 10000;
  o.max_total_keys = 4;
  startServer(o);
  auto s = client();
  s->set("a", std::string(4000, 'a'));
  EXPECT_THROW(s->multiSet({"b", "c"}, {std::string(3000, 'b'), std::string(3000, 'c')}), StoreError);
  EXPECT_FALSE(s->check({"b"}));
  EXPECT_FALSE(s->check({"c"}));
  // Overwriting counts the value replaced; a key twice counts its last value.
  s->multiSet({"a", "b", "b"}, {std::string(10, 'a'), std::string(9000, 'b'), std::string(5000, 'b')});
  EXPECT_EQ(s->get("b").size(), 5000u);
  EXPECT_THROW(s->multiSet({"c", "d", "e"}, {"1", "2", "3"}), StoreError);  // 5 keys of 4
  s->multiSet({"c", "d"}, {"1", "2"});
  EXPECT_EQ(s->numKeys(), 4);
}

// Waits that end (timed out, woken, their connection gone) leave no entry in the server's
// table of waits: a client waiting on fresh keys with a short timeout, over and over, grew it
// without bound (16 MB per wait on 4096 long keys).
TEST_F(TcpStoreTest, EndedWaitsLeaveNothingBehind) {
  auto s = client();
  std::vector<std::string> keys;
  for (int i = 0; i < 512; ++i) keys.push_back("missing/" + std::to_string(i));
  for (int round = 0; round < 5; ++round) EXPECT_THROW(s->wait(keys, 1ms), TimeoutError);
  EXPECT_EQ(server_->waiterEntryCount(), 0u);
  // Woken after part of the keys came: the rest's entries go too.
  std::thread later([&] {
    auto w = client();
    std::this_thread::sleep_for(100ms);
    w->set("x", "1");
    std::this_thread::sleep_for(100ms);
    w->set("y", "1");
  });
  s->wait({"x", "y", "x"}, 5s);
  later.join();
  EXPECT_EQ(server_->waiterEntryCount(), 0u);
  // A key written, then deleted, before the wait's other key came: the wait still wakes when
  // it is written again.
  std::thread again([&] {
    auto w = client();
    std::this_thread::sleep_for(100ms);
    w->set("p", "1");
    w->deleteKey("p");
    w->set("q", "1");
    std::this_thread::sleep_for(100ms);
    w->set("p", "2");
  });
  const auto t0 = std::chrono::steady_clock::now();
  s->wait({"p", "q"}, 5s);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 3s);
  again.join();
  EXPECT_EQ(server_->waiterEntryCount(), 0u);
  // A waiting connection that closes.
  {
    Raw gone(server_->port());
    gone.auth();
    gone.send(wire::encodeRequest({Op::kGet, {"never"}, {}, 10000}));
    for (int i = 0; i < 100 && server_->waiterEntryCount() == 0; ++i) std::this_thread::sleep_for(10ms);
    EXPECT_EQ(server_->waiterEntryCount(), 1u);
  }
  for (int i = 0; i < 200 && server_->waiterEntryCount() != 0; ++i) std::this_thread::sleep_for(10ms);
  EXPECT_EQ(server_->waiterEntryCount(), 0u);
}

// A wait holds its keys (and a copy of each missing one in the table of waiters) while it
// lasts: counted in max_buffered_bytes, so connections waiting for ever on 4096 keys of 4 KiB
// each (33 MB apiece) cannot exhaust memory. Past the budget a wait is answered QUOTA and the
// connection goes on; an ended wait gives its bytes back.
TEST_F(TcpStoreTest, WaitsOnLargeKeysCountInTheBudget) {
  TcpStoreServerOptions o;
  o.max_buffered_bytes = 4u << 20;
  startServer(o);
  const size_t idle = server_->heldBytes();
  auto keys = [](char tag, int n) {
    std::vector<std::string> k;
    for (int i = 0; i < n; ++i) k.push_back(std::string(1, tag) + std::to_string(i) + std::string(4000, 'k'));
    return k;
  };
  // 300 keys of 4 KiB: about 2.4 MB held while waiting, for ever.
  auto a = std::make_unique<Raw>(server_->port());
  a->auth();
  a->send(wire::encodeRequest({Op::kWait, keys('a', 300), {}, -1}));
  for (int i = 0; i < 200 && server_->waiterEntryCount() < 300; ++i) std::this_thread::sleep_for(10ms);
  ASSERT_EQ(server_->waiterEntryCount(), 300u);
  EXPECT_GE(server_->heldBytes(), idle + 2 * 300 * 4000);
  // Another such wait would go over 4 MiB: refused, the connection kept.
  auto b = client();
  try {
    b->wait(keys('b', 300), 10s);
    FAIL() << "a wait over the budget was taken";
  } catch (const TimeoutError& e) {
    FAIL() << e.what();
  } catch (const StoreError& e) {
    EXPECT_TRUE(mentions(e, "a wait on these 300 keys would hold")) << e.what();
    EXPECT_TRUE(mentions(e, "wait on fewer keys at a time")) << e.what();
  }
  b->ping();
  EXPECT_THROW(b->wait({"small"}, 1ms), TimeoutError);  // small waits always pass
  // The first wait ends (its connection closes): its bytes go, and the other wait is taken.
  a.reset();
  for (int i = 0; i < 200 && server_->waiterEntryCount() != 0; ++i) std::this_thread::sleep_for(10ms);
  EXPECT_EQ(server_->waiterEntryCount(), 0u);
  EXPECT_THROW(b->wait(keys('b', 300), 50ms), TimeoutError);
  for (int i = 0; i < 200 && server_->heldBytes() > idle + 256 * 1024; ++i) std::this_thread::sleep_for(10ms);
  EXPECT_LE(server_->heldBytes(), idle + 256 * 1024);
}

// Connections that once sent or fetched a large value do not keep its room: 8 idle
// connections after 4 MiB each held 32 MiB (64 with the replies), outside any budget.
TEST_F(TcpStoreTest, IdleConnectionsKeepNoLargeBuffers) {
  std::vector<std::unique_ptr<TcpStore>> cs;
  for (int i = 0; i < 8; ++i) {
    cs.push_back(client());
    cs.back()->set("big" + std::to_string(i), std::string(4u << 20, 'v'));
    EXPECT_EQ(cs.back()->get("big" + std::to_string(i)).size(), 4u << 20);
  }
  for (int i = 0; i < 100 && server_->heldBytes() > (1u << 20); ++i) std::this_thread::sleep_for(10ms);
  EXPECT_LT(server_->heldBytes(), 1u << 20);
}

// The protocol allows pipelining: a request sent behind a GET that waits is read after the
// GET's reply, however long the wait, not taken for a frame stalled mid-way (frame_timeout).
TEST_F(TcpStoreTest, ARequestPipelinedBehindAWaitIsServedAfterIt) {
  TcpStoreServerOptions o;
  o.frame_timeout = 200ms;
  startServer(o);
  Raw r(server_->port());
  r.auth();
  const std::string get = r.seal(wire::encodeRequest({Op::kGet, {"later"}, {}, 5000}));
  const std::string ping = r.seal(wire::encodeRequest({Op::kPing, {}, {}, 0}));  // (sealed in order)
  r.sendRaw(get + ping);
  std::this_thread::sleep_for(800ms);  // (4 frame timeouts, and sweeps)
  client()->set("later", "v");
  auto v = r.read();
  ASSERT_TRUE(v);
  EXPECT_EQ(v->op, Op::kValue) << v->message;
  EXPECT_EQ(v->value, "v");
  auto p = r.read();
  ASSERT_TRUE(p);
  EXPECT_EQ(p->op, Op::kOk) << p->message;
}

TEST_F(TcpStoreTest, UnfinishedFramesHaveAGlobalBudget) {
  TcpStoreServerOptions o;
  o.max_buffered_bytes = 4u << 20;
  startServer(o);
  // Each client announces a 16 MiB frame and sends 1 MiB of it: the fifth goes over budget.
  std::vector<std::unique_ptr<Raw>> hogs;
  std::string partial = std::string("\x01\x00\x00\x00", 4) + std::string(1u << 20, 'x');
  int refused = 0;
  for (int i = 0; i < 6; ++i) {
    hogs.push_back(std::make_unique<Raw>(server_->port()));
    hogs.back()->auth();
    hogs.back()->sendRaw(partial);
    std::this_thread::sleep_for(50ms);
  }
  for (auto& h : hogs) {
    auto r = h->read(500ms);
    if (r && r->op == Op::kError && r->code == ErrorCode::kQuota) ++refused;
  }
  EXPECT_GE(refused, 2);
  client()->ping();  // small clients still served
}

// A large reply over the budget is answered QUOTA, sealed with the sequence number the
// client expects next (it was sealed twice, and dtrain's client read the error as
// tampering); the connection stays usable.
TEST_F(TcpStoreTest, RepliesOverTheBudgetAreQuotaWithTheirOwnSequence) {
  TcpStoreServerOptions o;
  o.max_buffered_bytes = 4u << 20;
  startServer(o);
  client()->set("big", std::string(3u << 20, 'b'));
  // A reader that asks and never reads: its replies fill its socket, then the budget.
  Raw hog(server_->port());
  hog.auth();
  for (int i = 0; i < 8; ++i) hog.send(wire::encodeRequest({Op::kGet, {"big"}, {}, 1000}));
  std::this_thread::sleep_for(300ms);
  Raw victim(server_->port());
  victim.auth();
  victim.send(wire::encodeRequest({Op::kGet, {"big"}, {}, 1000}));
  auto r = victim.read();  // (a MAC that does not verify fails the test here)
  ASSERT_TRUE(r);
  EXPECT_EQ(r->op, Op::kError);
  EXPECT_EQ(r->code, ErrorCode::kQuota) << r->message;
  victim.send(wire::encodeRequest({Op::kPing, {}, {}, 0}));
  auto p = victim.read();
  ASSERT_TRUE(p);
  EXPECT_EQ(p->op, Op::kOk) << p->message;
}

TEST_F(TcpStoreTest, HoldsAThousandConnections) {
  rlimit rl{};
  ::getrlimit(RLIMIT_NOFILE, &rl);
  if (rl.rlim_cur < 2200 && rl.rlim_max >= 2200) {
    rl.rlim_cur = 2200;
    ::setrlimit(RLIMIT_NOFILE, &rl);
  }
  ::getrlimit(RLIMIT_NOFILE, &rl);
  if (rl.rlim_cur < 2200) GTEST_SKIP() << "RLIMIT_NOFILE hard limit too low";
  std::vector<std::unique_ptr<TcpStore>> clients;
  for (int i = 0; i < 1000; ++i) clients.push_back(client());
  EXPECT_EQ(server_->connectionCount(), 1000u);
  for (int i = 0; i < 1000; i += 37) clients[i]->add("many", 1);
  EXPECT_EQ(clients[999]->get("many"), "28");
}

// ---- Impostors, relays and floods (tests of the security audit's findings) ----

// Blocking whole-frame I/O on a socket (header + body), for fake servers and relays.
std::optional<std::string> readFrameFd(int fd) {
  std::string buf;
  size_t want = 4;
  while (buf.size() < want) {
    char tmp[65536];
    ssize_t n = ::recv(fd, tmp, std::min(sizeof(tmp), want - buf.size()), 0);
    if (n <= 0) return std::nullopt;
    buf.append(tmp, static_cast<size_t>(n));
    if (want == 4 && buf.size() == 4)
      want += (uint32_t(uint8_t(buf[0])) << 24) | (uint32_t(uint8_t(buf[1])) << 16) | (uint32_t(uint8_t(buf[2])) << 8) |
              uint32_t(uint8_t(buf[3]));
  }
  return buf;
}

bool writeFd(int fd, std::string_view b) {
  while (!b.empty()) {
    ssize_t n = ::send(fd, b.data(), b.size(), MSG_NOSIGNAL);
    if (n <= 0) return false;
    b.remove_prefix(static_cast<size_t>(n));
  }
  return true;
}

int listenLoopback(int& port) {
  int lfd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_EQ(::bind(lfd, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
  EXPECT_EQ(::listen(lfd, 16), 0);
  socklen_t len = sizeof(a);
  EXPECT_EQ(::getsockname(lfd, reinterpret_cast<sockaddr*>(&a), &len), 0);
  port = ntohs(a.sin_port);
  return lfd;
}

int connectLoopback(int port) {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
  return fd;
}

// A listener that is not the job's store: `serve` gets each connection in turn.
class FakeServer {
 public:
  explicit FakeServer(std::function<void(int)> serve) : lfd_(listenLoopback(port_)) {
    thread_ = std::thread([this, serve = std::move(serve)] {
      while (true) {
        int c = ::accept(lfd_, nullptr, nullptr);
        if (c < 0) return;  // shut down
        serve(c);
        ::close(c);
      }
    });
  }
  ~FakeServer() {
    ::shutdown(lfd_, SHUT_RDWR);  // wakes accept()
    thread_.join();
    ::close(lfd_);
  }
  int port() const { return port_; }

 private:
  int port_ = 0;
  int lfd_;
  std::thread thread_;
};

std::string challengeFrame(uint16_t version) {
  wire::Reply c;
  c.op = Op::kChallenge;
  c.num = version;
  c.value = randomBytes(wire::kNonceSize);
  return wire::encodeReply(c);
}

std::string challengeFrameWithNonce(const std::string& nonce) {
  wire::Reply c;
  c.op = Op::kChallenge;
  c.num = wire::kVersion;
  c.value = nonce;
  return wire::encodeReply(c);
}

// A fake server's half of the handshake: a challenge sent, the client's AUTH read back.
// nullopt when the client went away first.
struct AuthRead {
  std::string nonce;
  wire::Request auth;
};
std::optional<AuthRead> challengeAndReadAuth(int fd) {
  AuthRead r{randomBytes(wire::kNonceSize), {}};
  if (!writeFd(fd, challengeFrameWithNonce(r.nonce))) return std::nullopt;
  auto a = readFrameFd(fd);
  if (!a) return std::nullopt;
  r.auth = wire::decodeRequest(std::string_view(*a).substr(4), wire::Limits{});
  return r;
}

TcpStoreOptions optionsFor(int port, const std::string& token = kToken) {
  TcpStoreOptions o;
  o.port = port;
  o.token = token;
  o.connect_timeout = 2s;
  o.request_timeout = 2s;
  return o;
}

// Connecting to a server on `port` (not a store, or one that refuses the handshake) throws E
// saying `what`.
template <class E>
void expectConnectRefused(int port, const char* what) {
  try {
    TcpStore s(optionsFor(port));
    ADD_FAILURE() << "connected to port " << port;
  } catch (const E& e) {
    EXPECT_TRUE(mentions(e, what)) << e.what();
  }
}

// A listener without the job's token that "accepts" any AUTH (the audit's attack: it then
// served its own job/spec, and the agent ran its command) is refused in the handshake, before
// the client sends any request, whatever it answers in place of the server's proof.
TEST(TcpStoreImpostor, ServerWithoutTheTokenIsRefused) {
  const std::vector<std::pair<std::string, std::function<std::string(const std::string& nonce, const wire::Request&)>>>
      answers = {
          {"OK, as version 1 did", [](const std::string&, const wire::Request&) { return wire::encodeReply(wire::Reply{}); }},
          {"a PROOF of random bytes",
           [](const std::string&, const wire::Request&) {
             wire::Reply p;
             p.op = Op::kProof;
             p.value = randomBytes(32);
             return wire::encodeReply(p);
           }},
          {"a PROOF under another token (the impostor's own)",
           [](const std::string& nonce, const wire::Request& a) {
             wire::Reply p;
             p.op = Op::kProof;
             p.value = auth::serverProof("the-attackers-own-token", nonce, a.values.at(0));
             return wire::encodeReply(p);
           }},
          {"the client's own proof sent back",
           [](const std::string&, const wire::Request& a) {
             wire::Reply p;
             p.op = Op::kProof;
             p.value = a.values.at(1);
             return wire::encodeReply(p);
           }},
      };
  for (const auto& [what, answer] : answers) {
    std::atomic<int> requestsSeen{0};
    FakeServer fake([&, answer = answer](int fd) {
      auto h = challengeAndReadAuth(fd);
      if (!h || !writeFd(fd, answer(h->nonce, h->auth))) return;
      // Then it would serve its own job/spec to whatever is asked.
      while (auto f = readFrameFd(fd)) {
        ++requestsSeen;
        wire::Reply v;
        v.op = Op::kValue;
        v.value = "{\"command\": [\"touch\", \"/tmp/pwned\"]}";
        if (!writeFd(fd, wire::encodeReply(v))) return;
      }
    });
    try {
      TcpStore s(optionsFor(fake.port()));
      s.get("job/spec");
      ADD_FAILURE() << what << ": accepted";
    } catch (const AuthError& e) {
      EXPECT_NE(std::string(e.what()).find("the server did not prove that it knows the job token"), std::string::npos)
          << what << ": " << e.what();
    }
    EXPECT_EQ(requestsSeen.load(), 0) << what << ": the client sent a request to an impostor";
  }
}

// Version 1 peers are refused with a VERSION error that names both versions: a store of
// version 1 by the client (before it sends its proof), a version 1 client by the store.
TEST(TcpStoreImpostor, VersionOnePeersAreRefusedByVersion) {
  std::atomic<int> framesSeen{0};
  FakeServer v1([&](int fd) {
    if (!writeFd(fd, challengeFrame(1))) return;
    while (readFrameFd(fd)) ++framesSeen;
  });
  try {
    TcpStore s(optionsFor(v1.port()));
    ADD_FAILURE() << "a version 1 store was accepted";
  } catch (const AuthError& e) {
    EXPECT_NE(std::string(e.what()).find("the server speaks store protocol version 1, this dtrain speaks version 2"),
              std::string::npos)
        << e.what();
  }
  EXPECT_EQ(framesSeen.load(), 0);

  TcpStoreServerOptions so;
  so.token = kToken;
  TcpStoreServer server(so);
  server.start();
  Raw r(server.port());
  auto c = r.read();
  ASSERT_TRUE(c);
  ASSERT_EQ(c->num, 2);
  // Version 1's AUTH: u16 1, bytes HMAC(token, nonce).
  std::string body = std::string("\x40\x00\x01\x00\x00\x00\x20", 7) + std::string(32, 'm');
  r.sendRaw(std::string("\x00\x00\x00", 3) + static_cast<char>(body.size()) + body);
  auto rep = r.read();
  ASSERT_TRUE(rep);
  EXPECT_EQ(rep->code, ErrorCode::kVersion);
  EXPECT_NE(rep->message.find("the client speaks store protocol version 1, this store speaks version 2"), std::string::npos)
      << rep->message;
  EXPECT_TRUE(r.closedByPeer(2000ms));
}

// Forwards whole frames between a client and the real store, passing each through `tamper`
// (direction, its index in that direction, the frame), which returns what to forward
// instead. Server-to-client index 0 is the CHALLENGE, 1 the PROOF, 2 the first reply;
// client-to-server index 0 is the AUTH, 1 the first request.
class Relay {
 public:
  using Tamper = std::function<std::vector<std::string>(auth::Direction, int, std::string)>;
  Relay(int upstream, Tamper tamper) : upstream_(upstream), tamper_(std::move(tamper)), lfd_(listenLoopback(port_)) {
    acceptor_ = std::thread([this] {
      while (true) {
        int c = ::accept(lfd_, nullptr, nullptr);
        if (c < 0) return;
        int u = connectLoopback(upstream_);
        std::lock_guard<std::mutex> l(mu_);
        fds_.insert(fds_.end(), {c, u});
        pumps_.emplace_back([this, c, u] { pump(c, u, auth::Direction::kClientToServer); });
        pumps_.emplace_back([this, c, u] { pump(u, c, auth::Direction::kServerToClient); });
      }
    });
  }
  ~Relay() {
    ::shutdown(lfd_, SHUT_RDWR);
    acceptor_.join();
    {
      std::lock_guard<std::mutex> l(mu_);
      for (int fd : fds_) ::shutdown(fd, SHUT_RDWR);
    }
    for (auto& t : pumps_) t.join();
    for (int fd : fds_) ::close(fd);
    ::close(lfd_);
  }
  int port() const { return port_; }

 private:
  void pump(int from, int to, auth::Direction dir) {
    for (int i = 0;; ++i) {
      auto f = readFrameFd(from);
      if (!f) break;
      bool ok = true;
      for (const auto& out : tamper_(dir, i, std::move(*f))) ok = ok && writeFd(to, out);
      if (!ok) break;
    }
    ::shutdown(from, SHUT_RDWR);  // one side gone: so is the other
    ::shutdown(to, SHUT_RDWR);
  }

  int upstream_;
  Tamper tamper_;
  int port_ = 0;
  int lfd_;
  std::thread acceptor_;
  std::mutex mu_;
  std::vector<int> fds_;
  std::vector<std::thread> pumps_;
};

Relay::Tamper passThrough() {
  return [](auth::Direction, int, std::string f) { return std::vector<std::string>{std::move(f)}; };
}

TEST_F(TcpStoreTest, RelayThatAltersNothingIsTransparent) {
  Relay relay(server_->port(), passThrough());
  TcpStore s(optionsFor(relay.port()));
  s.set("k", "v");
  EXPECT_EQ(s.get("k"), "v");
  EXPECT_EQ(s.add("n", 2), 2);
  EXPECT_EQ(s.multiGet({"k", "n"}), (std::vector<Bytes>{"v", "2"}));
}

// Another service at the store's address (an HTTP server answering "HTTP/1.1 400") is named
// as not a dtrain store, showing what it sent: an AuthError (`dtrain store` exit 5, as for
// any listener that is not the job's store), not "frame of 1213486160 bytes exceeds limit".
TEST(TcpStoreImpostor, AServiceThatIsNotAStoreIsNamedAsSuch) {
  FakeServer http([](int fd) { writeFd(fd, "HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n"); });
  try {
    TcpStore s(optionsFor(http.port()));
    ADD_FAILURE() << "an HTTP server was taken for the store";
  } catch (const AuthError& e) {
    EXPECT_TRUE(
        mentions(e, fmt::format("store 127.0.0.1:{} did not answer as a dtrain store (is this a dtrain store? it "
                                "sent \"HTTP/1.1 400 Bad Request\\x0d\\nConten...\" where the store's handshake "
                                "was expected",
                                http.port())
                        .c_str()))
        << e.what();
  }
  // A frame of the right shape that is not the challenge, and a challenge without a nonce.
  for (const std::string& first : {wire::encodeReply(wire::Reply{}), challengeFrameWithNonce("")}) {
    FakeServer other([&](int fd) {
      writeFd(fd, first);
      while (readFrameFd(fd)) {
      }
    });
    expectConnectRefused<AuthError>(other.port(), "did not answer as a dtrain store (is this a dtrain store?");
  }
}

// What a server says in the handshake is shown whole and escaped: a NUL in its ERROR's text
// cut the message there (std::runtime_error keeps a C string), and a newline or a terminal
// control would reach the user's terminal.
TEST(TcpStoreImpostor, TextFromTheServerIsEscaped) {
  FakeServer weird([](int fd) {
    if (!writeFd(fd, challengeFrame(wire::kVersion)) || !readFrameFd(fd)) return;
    writeFd(fd, wire::encodeReply(
                    wire::errorReply(ErrorCode::kMalformed, std::string("line1\nred\x1b[31m") + '\0' + "nul")));
  });
  expectConnectRefused<IoError>(weird.port(), "handshake refused: line1\\nred\\x1b[31m\\x00nul (malformed frame)");
}

// A relay that flips one byte of a reply (here in a value) is caught by the client: the
// call fails, the connection is dropped, and the altered value is never returned.
TEST_F(TcpStoreTest, ReplyAlteredOnTheWayIsDetected) {
  client()->set("job/spec", "the real spec");
  // The opcode, the value's length, the value, the tag. (A flipped header byte is caught the
  // same way once the frame is complete; one that makes it longer waits out the timeout.)
  for (size_t at : {size_t{4}, size_t{8}, size_t{9}, std::string::npos}) {
    Relay relay(server_->port(), [at](auth::Direction d, int i, std::string f) {
      if (d == auth::Direction::kServerToClient && i == 2) f[at == std::string::npos ? f.size() - 1 : at] ^= 0x01;
      return std::vector<std::string>{std::move(f)};
    });
    TcpStore s(optionsFor(relay.port()));
    try {
      Bytes v = s.get("job/spec");
      ADD_FAILURE() << "byte " << at << ": got '" << v << "'";
    } catch (const IoError& e) {
      EXPECT_TRUE(mentions(e, "a reply failed its integrity check")) << "byte " << at << ": " << e.what();
    }
    EXPECT_THROW(s.ping(), IoError) << "the connection was kept after an altered reply";
  }
}

// A relay that answers with an earlier reply of the same connection (identical bytes, an
// earlier place in the stream) or with nothing but its own bytes is caught too.
TEST_F(TcpStoreTest, ReplayedOrInjectedReplyIsDetected) {
  client()->set("k", "v");
  for (bool inject : {false, true}) {
    std::string first;
    Relay relay(server_->port(), [&](auth::Direction d, int i, std::string f) {
      if (d == auth::Direction::kServerToClient && i == 2) first = f;
      if (d == auth::Direction::kServerToClient && i == 3) {
        if (!inject) return std::vector<std::string>{first};  // the first reply again
        wire::Reply fake;
        fake.op = Op::kValue;
        fake.value = "forged";
        std::string forged = wire::encodeReply(fake) + randomBytes(auth::kMacSize);
        forged[3] = static_cast<char>(forged.size() - 4);
        return std::vector<std::string>{forged};
      }
      return std::vector<std::string>{std::move(f)};
    });
    TcpStore s(optionsFor(relay.port()));
    EXPECT_EQ(s.get("k"), "v");
    try {
      s.get("k");
      ADD_FAILURE() << (inject ? "injected" : "replayed") << " reply accepted";
    } catch (const IoError& e) {
      EXPECT_TRUE(mentions(e, "a reply failed its integrity check")) << e.what();
    }
  }
}

// A request altered, replayed or injected on the way is not applied: the store answers
// INTEGRITY (under its MAC) and closes, and the client says so.
TEST_F(TcpStoreTest, RequestAlteredReplayedOrInjectedIsNotApplied) {
  auto direct = client();
  {  // altered: one bit of the value
    Relay relay(server_->port(), [](auth::Direction d, int i, std::string f) {
      if (d == auth::Direction::kClientToServer && i == 1) f[f.size() - auth::kMacSize - 1] ^= 0x01;
      return std::vector<std::string>{std::move(f)};
    });
    TcpStore s(optionsFor(relay.port()));
    try {
      s.set("altered", "value");
      ADD_FAILURE() << "altered request accepted";
    } catch (const IoError& e) {
      EXPECT_TRUE(mentions(e, "the store found our request altered on the way")) << e.what();
    }
    EXPECT_FALSE(direct->check({"altered"}));
  }
  {  // replayed: an ADD sent twice
    Relay relay(server_->port(), [](auth::Direction d, int i, std::string f) {
      if (d == auth::Direction::kClientToServer && i == 1) return std::vector<std::string>{f, f};
      return std::vector<std::string>{std::move(f)};
    });
    TcpStore s(optionsFor(relay.port()));
    EXPECT_EQ(s.add("ctr", 1), 1);
    EXPECT_THROW(s.ping(), IoError);
    EXPECT_EQ(direct->get("ctr"), "1") << "the replayed ADD was applied";
  }
  {  // injected: a SET of the relay's own before the client's first request
    Relay relay(server_->port(), [](auth::Direction d, int i, std::string f) {
      if (d == auth::Direction::kClientToServer && i == 1) {
        std::string evil = wire::encodeRequest({Op::kSet, {"evil"}, {"1"}, 0}) + randomBytes(auth::kMacSize);
        evil[3] = static_cast<char>(evil.size() - 4);
        return std::vector<std::string>{evil, std::move(f)};
      }
      return std::vector<std::string>{std::move(f)};
    });
    TcpStore s(optionsFor(relay.port()));
    try {
      s.ping();
      ADD_FAILURE() << "injected request went unnoticed";
    } catch (const IoError& e) {
      EXPECT_TRUE(mentions(e, "the store found our request altered on the way")) << e.what();
    }
    EXPECT_FALSE(direct->check({"evil"}));
  }
  direct->ping();
}

// Before AUTH a frame may be no longer than AUTH itself: an unauthenticated connection cannot
// make the store hold more, nor spend the unfinished-frame budget of the job's clients (the
// audit's 16 connections of 16 MiB each failed both workers of a job).
TEST_F(TcpStoreTest, UnauthenticatedFramesAreTinyAndDoNotSpendTheBudget) {
  TcpStoreServerOptions o;
  o.max_buffered_bytes = 2u << 20;
  startServer(o);
  std::vector<std::unique_ptr<Raw>> hogs;
  for (int i = 0; i < 16; ++i) {
    hogs.push_back(std::make_unique<Raw>(server_->port()));
    ASSERT_TRUE(hogs.back()->read());  // challenge
    hogs.back()->sendRaw(std::string("\x01\x10\x00\x00", 4) + std::string(64 << 10, 'x'));
  }
  for (auto& h : hogs) {
    auto r = h->read();
    ASSERT_TRUE(r);
    EXPECT_EQ(r->code, ErrorCode::kTooLarge);
    EXPECT_NE(r->message.find("exceeds the limit of 128"), std::string::npos) << r->message;
    EXPECT_TRUE(h->closedByPeer(2000ms));
  }
  // Connections that hold a partial AUTH do not count against the job's clients either.
  std::vector<std::unique_ptr<Raw>> slow;
  for (int i = 0; i < 16; ++i) {
    slow.push_back(std::make_unique<Raw>(server_->port()));
    slow.back()->sendRaw(std::string("\x00\x00\x00\x4b\x40", 5));
  }
  auto s = client();
  s->set("big", std::string(1u << 20, 'b'));
  EXPECT_EQ(s->get("big").size(), 1u << 20);
}

// Connections that do not authenticate are limited apart: past max_unauthenticated the
// oldest is dropped with QUOTA, and the job's clients still get in.
TEST_F(TcpStoreTest, UnauthenticatedConnectionsAreLimitedOldestFirst) {
  TcpStoreServerOptions o;
  o.max_unauthenticated = 4;
  startServer(o);
  auto honest = client();
  std::vector<std::unique_ptr<Raw>> idle;
  for (int i = 0; i < 6; ++i) {
    idle.push_back(std::make_unique<Raw>(server_->port()));
    ASSERT_TRUE(idle.back()->read());  // challenge (accepted in order)
  }
  for (int i = 0; i < 2; ++i) {
    auto r = idle[i]->read();
    ASSERT_TRUE(r) << i;
    EXPECT_EQ(r->code, ErrorCode::kQuota) << i;
    EXPECT_NE(r->message.find("more than 4 connections are authenticating; this one, the oldest, is dropped"),
              std::string::npos)
        << r->message;
    EXPECT_TRUE(idle[i]->closedByPeer(2000ms));
  }
  EXPECT_FALSE(idle[5]->read(300ms)) << "the newest was dropped";
  // A new client drops the oldest idle one and authenticates; the old client is untouched.
  auto late = client();
  late->set("k", "v");
  EXPECT_EQ(honest->get("k"), "v");
  EXPECT_EQ(idle[2]->read()->code, ErrorCode::kQuota);
}

// A client dropped while it authenticates (too slow, among a flood of connections that never
// authenticate) is told QUOTA and connects again on its own.
TEST_F(TcpStoreTest, ClientDroppedWhileAuthenticatingRetries) {
  TcpStoreServerOptions o;
  o.max_unauthenticated = 4;
  startServer(o);
  std::atomic<int> auths{0};
  std::atomic<bool> held{false};
  Relay relay(server_->port(), [&](auth::Direction d, int i, std::string f) {
    if (d == auth::Direction::kClientToServer && i == 0 && auths++ == 0) {
      held = true;  // the first AUTH is late: four others connect meanwhile
      std::this_thread::sleep_for(500ms);
    }
    return std::vector<std::string>{std::move(f)};
  });
  std::vector<std::unique_ptr<Raw>> flood;
  std::thread flooder([&] {
    while (!held) std::this_thread::sleep_for(1ms);
    for (int i = 0; i < 4; ++i) {
      flood.push_back(std::make_unique<Raw>(server_->port()));
      flood.back()->read();  // challenge: accepted
    }
  });
  TcpStore s(optionsFor(relay.port()));
  flooder.join();
  EXPECT_GE(auths.load(), 2) << "the first connection was not dropped";
  s.set("k", "v");
  EXPECT_EQ(client()->get("k"), "v");
}

// A flood of connections that never authenticate holds little memory in the server: a
// closed session's memory is freed when it closes, not kept by `sessions`' weak reference
// until the next sweep (make_shared put the counts and the session, with its 16 KiB read
// chunk, in one block: at ~100,000 connections a second that was 350-480 MB, which the
// allocator then kept), and a session reads the handshake in 256-byte chunks. Measured as
// the heap in use (all threads' arenas) at its peak during the flood.
TEST_F(TcpStoreTest, AConnectionFloodHoldsLittleMemory) {
  std::atomic<bool> stop{false};
  std::atomic<int> opened{0};
  std::thread flooder([&] {
    std::deque<int> fds;
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(static_cast<uint16_t>(server_->port()));
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    while (!stop) {
      int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
      if (fd < 0) break;
      ::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a));
      fds.push_back(fd);
      ++opened;
      // (more than max_unauthenticated open: the server drops the oldest as well)
      while (fds.size() > 300) {
        ::close(fds.front());
        fds.pop_front();
      }
    }
    for (int fd : fds) ::close(fd);
  });
  const size_t before = ::mallinfo2().uordblks;
  size_t peak = before;
  const auto until = std::chrono::steady_clock::now() + 1500ms;
  while (std::chrono::steady_clock::now() < until) {
    peak = std::max(peak, ::mallinfo2().uordblks);
    std::this_thread::sleep_for(5ms);
  }
  stop = true;
  flooder.join();
  EXPECT_GT(opened.load(), 1000);
  EXPECT_LT(peak - before, size_t{8} << 20) << opened.load() << " connections";
  client()->ping();
}

// Under a flood of connections that never authenticate, each dropping the oldest, the job's
// clients still get in: dropped ones are told so (not reset) and retry.
TEST_F(TcpStoreTest, ClientsGetInDuringAConnectionFlood) {
  TcpStoreServerOptions o;
  o.max_unauthenticated = 8;
  startServer(o);
  std::atomic<bool> stop{false};
  std::atomic<int> opened{0};
  std::thread flooder([&] {
    std::vector<int> fds;
    while (!stop) {
      fds.push_back(connectLoopback(server_->port()));
      ++opened;
      if (fds.size() >= 200) {
        for (int fd : fds) ::close(fd);
        fds.clear();
      }
    }
    for (int fd : fds) ::close(fd);
  });
  // The clients come once the flood is under way (they were all in within 5 ms once, before
  // the flooder's first connection, and the test proved nothing).
  for (int i = 0; i < 5000 && opened.load() < 50; ++i) std::this_thread::sleep_for(1ms);
  if (opened.load() < 50) {
    stop = true;
    flooder.join();
    FAIL() << "the flood did not start: " << opened.load() << " connections in 5 s";
  }
  for (int i = 0; i < 20; ++i) {
    try {
      TcpStore c(optionsFor(server_->port()));
      c.add("in", 1);
    } catch (const std::exception& e) {
      ADD_FAILURE() << "client " << i << ": " << e.what();
    }
  }
  stop = true;
  flooder.join();
  EXPECT_GT(opened.load(), 20);
  EXPECT_EQ(client()->get("in"), "20");
}

// A store at its limit of authenticated connections answers QUOTA, which the client retries
// until its connect timeout and reports as a busy store (exit 1 for `dtrain store`), not as
// a wrong token.
TEST_F(TcpStoreTest, FullStoreAnswersQuotaNotASilentClose) {
  TcpStoreServerOptions o;
  o.max_connections = 2;
  startServer(o);
  auto a = client();
  auto b = client();
  TcpStoreOptions co = optionsFor(server_->port());
  co.connect_timeout = 1500ms;
  const auto tried = std::chrono::steady_clock::now();
  try {
    TcpStore c(co);
    FAIL() << "a third connection was taken";
  } catch (const AuthError& e) {
    FAIL() << "reported as an authentication failure: " << e.what();
  } catch (const StoreBusyError& e) {
    EXPECT_TRUE(mentions(e, "the store cannot take this connection now: the store holds its limit of 2 connections"))
        << e.what();
    EXPECT_TRUE(mentions(e, "gave up after 1.5 s")) << e.what();
  }
  // It retries for the time it says, with a last attempt at the deadline (it gave up when
  // the next back-off, 1 s here, would pass the deadline: after ~1.26 s).
  const auto took = std::chrono::steady_clock::now() - tried;
  EXPECT_GE(took, 1450ms);
  EXPECT_LT(took, 2500ms);
  // A slot freed while the client retries is taken.
  std::thread freeOne([&] {
    std::this_thread::sleep_for(200ms);
    b.reset();
  });
  co.connect_timeout = 5s;
  TcpStore c(co);
  freeOne.join();
  c.ping();
}

// A listener that takes the connection and never answers (a SIGSTOPped store; here one
// nobody accepts from) is given up on at the connect timeout, not request_timeout (30 s)
// later; the error names the endpoint and says the server did not answer.
TEST(TcpStoreDeadlines, SilentServerInTheHandshakeEndsAtTheConnectTimeout) {
  int port = 0;
  int lfd = listenLoopback(port);  // the kernel completes connections; nobody accepts them
  TcpStoreOptions o;
  o.port = port;
  o.token = kToken;
  o.connect_timeout = 700ms;  // request_timeout stays 30 s
  const auto start = std::chrono::steady_clock::now();
  try {
    TcpStore s(o);
    ADD_FAILURE() << "connected to a silent server";
  } catch (const AuthError& e) {
    ADD_FAILURE() << "reported as a token problem: " << e.what();
  } catch (const IoError& e) {
    EXPECT_TRUE(mentions(e, fmt::format("store 127.0.0.1:{}: the server accepted the connection but did not answer "
                                        "the handshake within",
                                        port)
                                .c_str()))
        << e.what();
  }
  const auto took = std::chrono::steady_clock::now() - start;
  EXPECT_GE(took, 650ms);
  EXPECT_LT(took, 2s);
  ::close(lfd);
}

// A store that authenticates, takes a GET and then stops answering (SIGSTOPped after the
// handshake) ends the call about its timeout later (the wait plus wait_grace), as a timeout
// that names the endpoint; the connection is dropped and later calls say why.
TEST(TcpStoreDeadlines, WaitOnAServerThatStopsAnsweringEndsAfterItsTimeout) {
  std::atomic<int> requests{0};
  FakeServer stopped([&](int fd) {
    auto h = challengeAndReadAuth(fd);
    if (!h) return;
    wire::Reply p;
    p.op = Op::kProof;
    p.value = auth::serverProof(kToken, h->nonce, h->auth.values.at(0));
    if (!writeFd(fd, wire::encodeReply(p))) return;
    while (readFrameFd(fd)) ++requests;  // and never a reply
  });
  TcpStoreOptions o = optionsFor(stopped.port());
  o.request_timeout = 30s;
  o.timeout = 300ms;
  o.wait_grace = 1s;  // (5 s by default)
  TcpStore s(o);
  auto start = std::chrono::steady_clock::now();
  try {
    s.get("k");
    ADD_FAILURE() << "a reply from nowhere";
  } catch (const TimeoutError& e) {
    EXPECT_TRUE(mentions(e, fmt::format("store 127.0.0.1:{}: no reply within 1.3 s (the 0.3 s wait and 1 s grace): the "
                                        "server did not answer",
                                        stopped.port())
                                .c_str()))
        << e.what();
  }
  auto took = std::chrono::steady_clock::now() - start;
  EXPECT_GE(took, 1250ms);
  EXPECT_LT(took, 3s);
  EXPECT_EQ(requests.load(), 1);
  try {
    s.ping();
    ADD_FAILURE() << "a dropped connection was used";
  } catch (const IoError& e) {
    EXPECT_TRUE(mentions(e, "not connected: the connection was dropped earlier (no reply in time)")) << e.what();
  }
}

// The grace is there so that the server's own TIMEOUT, sent at its deadline, wins: a wait
// that times out on the server is answered by it (its message, the connection kept), also
// with no grace beyond a few milliseconds and a wait of zero.
TEST_F(TcpStoreTest, TheServersTimeoutArrivesBeforeTheClientGivesUp) {
  TcpStoreOptions o;
  o.port = server_->port();
  o.token = kToken;
  o.wait_grace = 100ms;
  TcpStore c(o);
  for (auto t : {0ms, 1ms, 50ms, 300ms}) {
    try {
      c.wait({"never"}, t);
      ADD_FAILURE() << "no key, yet no timeout";
    } catch (const TimeoutError& e) {
      EXPECT_TRUE(mentions(e, "waiting for key 'never'")) << t.count() << " ms: " << e.what();
      EXPECT_FALSE(mentions(e, "did not answer")) << t.count() << " ms: " << e.what();
    }
    c.ping();  // still connected
  }
}

// A MULTI_GET whose reply would exceed the frame limit is refused with TOO_LARGE before
// anything is copied (the audit's 60 repeats of a 16 MiB key took 3 GB), and the connection
// goes on.
TEST_F(TcpStoreTest, MultiGetOverTheFrameLimitIsRefused) {
  auto s = client();
  s->set("big", std::string(1u << 20, 'b'));
  try {
    s->multiGet(std::vector<std::string>(4096, "big"));
    FAIL() << "a 4 GiB reply was attempted";
  } catch (const RequestRefusedError& e) {
    EXPECT_TRUE(mentions(e, "the values of these 4096 keys make a reply of")) << e.what();
    EXPECT_TRUE(mentions(e, "get them in smaller batches")) << e.what();
  }
  EXPECT_THROW(s->multiGet(std::vector<std::string>(17, "big")), RequestRefusedError);
  EXPECT_EQ(s->multiGet(std::vector<std::string>(16, "big")).size(), 16u);
  s->ping();
}

}  // namespace
}  // namespace dtrain::store
