#include "dtrain/store/tcp_store.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <chrono>
#include <limits>
#include <thread>

#include "dtrain/common/errors.h"
#include "dtrain/store/wire.h"

namespace dtrain::store {
namespace {

using namespace std::chrono_literals;
using wire::ErrorCode;
using wire::Op;

const std::string kToken = "test-token-0123456789";

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

// A raw socket for talking the protocol by hand.
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
  void send(std::string_view b) { ASSERT_EQ(::send(fd_, b.data(), b.size(), MSG_NOSIGNAL), static_cast<ssize_t>(b.size())); }
  // Reads one reply frame, or nullopt on close / timeout.
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
    return wire::decodeReply(std::string_view(buf).substr(4), wire::Limits{});
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
  // Reads the challenge and authenticates.
  void auth(const std::string& token = kToken) {
    auto c = read();
    ASSERT_TRUE(c);
    ASSERT_EQ(c->op, Op::kChallenge);
    send(wire::encodeRequest({Op::kAuth, {}, {handshakeMac(token, c->value)}, wire::kVersion}));
  }

 private:
  int fd_;
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
  ASSERT_EQ(r.read()->op, Op::kOk);
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
    ASSERT_EQ(r.read()->op, Op::kOk);
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
    ASSERT_EQ(r.read()->op, Op::kOk);
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
      ASSERT_EQ(r.read()->op, Op::kOk);
      std::string frames = wire::encodeRequest({Op::kGet, {"never"}, {}, -1});
      if (pipelined) frames += wire::encodeRequest({Op::kPing, {}, {}, 0});
      r.send(frames);
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
  try {
    client("wrong");
    FAIL();
  } catch (const IoError& e) {
    EXPECT_NE(std::string(e.what()).find("authentication failed: wrong token"), std::string::npos) << e.what();
  }
  TcpStoreOptions o;
  o.port = 1;  // nothing listens there
  o.token = kToken;
  o.connect_timeout = 300ms;
  try {
    TcpStore s(o);
    FAIL();
  } catch (const IoError& e) {
    EXPECT_NE(std::string(e.what()).find("store 127.0.0.1:1: cannot connect"), std::string::npos) << e.what();
  }
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
    EXPECT_NE(std::string(e.what()).find("no reply in time"), std::string::npos) << e.what();
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
}

TEST_F(TcpStoreTest, TypedErrorsAndServerStaysUp) {
  Raw r(server_->port());
  r.auth();
  ASSERT_EQ(r.read()->op, Op::kOk);
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
  big.read();
  big.send(std::string("\xff\xff\xff\xff", 4));
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
    ASSERT_EQ(r.read()->op, Op::kOk);
    r.send(std::string_view(frame).substr(0, cut));
    std::this_thread::sleep_for(1ms);
    r.send(std::string_view(frame).substr(cut));
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
  ASSERT_EQ(slow.read()->op, Op::kOk);
  slow.send(std::string("\x00\x00", 2));  // half a header, then nothing
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
    ASSERT_EQ(hogs.back()->read()->op, Op::kOk);
    hogs.back()->send(partial);
    std::this_thread::sleep_for(50ms);
  }
  for (auto& h : hogs) {
    auto r = h->read(500ms);
    if (r && r->op == Op::kError && r->code == ErrorCode::kQuota) ++refused;
  }
  EXPECT_GE(refused, 2);
  client()->ping();  // small clients still served
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

}  // namespace
}  // namespace dtrain::store
