#include <gtest/gtest.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>
#include <pthread.h>
#include <signal.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <functional>
#include <future>
#include <limits>
#include <random>
#include <thread>

#include <fmt/format.h>

#include "dtrain/comm/bench.h"
#include "dtrain/comm/communicator.h"
#include "dtrain/common/errors.h"
#include "dtrain/store/hash_store.h"
#include "comm_test_util.h"

namespace dtrain::comm {
namespace {

using namespace std::chrono_literals;

// These tests pin the TCP data path (shm off); shm_comm_test.cc checks that the shared-memory
// path gives the same bits.
CommOptions tcpOnly() {
  CommOptions o;
  o.shm = false;
  return o;
}

// Runs fn(comm) on n ranks, each in its own thread with its own communicator.
void onRanks(int n, const std::function<void(Communicator&)>& fn, CommOptions o = tcpOnly()) {
  auto errors = testing::runRanks(n, fn, o);
  for (int r = 0; r < n; ++r) EXPECT_EQ(errors[static_cast<size_t>(r)], "") << "rank " << r;
}

template <typename T>
T value(int rank, size_t i) {
  return static_cast<T>(static_cast<int>((rank * 131 + static_cast<int>(i) * 7) % 97) - 40);
}

template <typename T>
void checkAllreduce(int n, size_t count, DataType t, ReduceOp op, size_t smallBytes = 64 * 1024) {
  std::vector<std::vector<T>> results(static_cast<size_t>(n));
  CommOptions o = tcpOnly();
  o.small_message_bytes = smallBytes;
  onRanks(n, [&](Communicator& c) {
    std::vector<T> v(count);
    for (size_t i = 0; i < count; ++i) v[i] = value<T>(c.rank(), i);
    c.allreduce(v.data(), count, t, op);
    results[static_cast<size_t>(c.rank())] = v;
  }, o);
  for (size_t i = 0; i < count; ++i) {
    T acc = value<T>(0, i);
    for (int r = 1; r < n; ++r) {
      T x = value<T>(r, i);
      acc = op == ReduceOp::kMin ? std::min(acc, x) : op == ReduceOp::kMax ? std::max(acc, x) : static_cast<T>(acc + x);
    }
    if (op == ReduceOp::kAvg) acc = static_cast<T>(acc / n);
    ASSERT_EQ(results[0][i], acc) << "n=" << n << " count=" << count << " i=" << i << " op=" << name(op);
  }
  for (int r = 1; r < n; ++r)
    ASSERT_EQ(std::memcmp(results[0].data(), results[static_cast<size_t>(r)].data(), count * sizeof(T)), 0)
        << "rank " << r << " differs";
}

TEST(TcpComm, AllreduceRingAndRecursiveDoublingAllOps) {
  for (int n : {1, 2, 3, 4, 5}) {
    for (size_t count : {size_t{1}, size_t{7}, size_t{1000}, size_t{100003}}) {
      for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMin, ReduceOp::kMax}) {
        checkAllreduce<int32_t>(n, count, DataType::kInt32, op);
      }
      checkAllreduce<int64_t>(n, count, DataType::kInt64, ReduceOp::kSum);
      checkAllreduce<double>(n, count, DataType::kFloat64, ReduceOp::kMax);
      checkAllreduce<float>(n, count, DataType::kFloat32, ReduceOp::kSum, 0);  // ring even for small
    }
  }
}

TEST(TcpComm, FloatResultsAreBitIdenticalOnEveryRank) {
  const int n = 4;
  const size_t count = 300001;
  std::vector<std::vector<float>> out(n);
  onRanks(n, [&](Communicator& c) {
    std::mt19937 gen(static_cast<unsigned>(c.rank() + 1));
    std::normal_distribution<float> d;
    std::vector<float> v(count);
    for (auto& x : v) x = d(gen) * 1e3f;
    c.allreduce(v.data(), count, DataType::kFloat32, ReduceOp::kAvg);
    out[static_cast<size_t>(c.rank())] = v;
  });
  for (int r = 1; r < n; ++r) EXPECT_EQ(std::memcmp(out[0].data(), out[static_cast<size_t>(r)].data(), count * 4), 0);
}

TEST(TcpComm, SixteenBitFloats) {
  for (DataType t : {DataType::kFloat16, DataType::kBFloat16}) {
    auto to = t == DataType::kFloat16 ? floatToHalf : floatToBf16;
    auto from = t == DataType::kFloat16 ? halfToFloat : bf16ToFloat;
    onRanks(3, [&](Communicator& c) {
      std::vector<uint16_t> v(5000, to(static_cast<float>(c.rank() + 1) * 0.5f));
      c.allreduce(v.data(), v.size(), t, ReduceOp::kSum);
      for (auto x : v) ASSERT_EQ(from(x), 3.0f);
    });
  }
  EXPECT_EQ(halfToFloat(floatToHalf(1.0f / 3)), 0.333251953125f);
  EXPECT_EQ(halfToFloat(floatToHalf(65504.0f)), 65504.0f);
  EXPECT_TRUE(std::isinf(halfToFloat(floatToHalf(70000.0f))));
  EXPECT_EQ(halfToFloat(floatToHalf(5.960464477539063e-08f)), 5.960464477539063e-08f);  // smallest subnormal
  EXPECT_EQ(bf16ToFloat(floatToBf16(1.00390625f)), 1.0f);  // ties to even
}

// The 16-bit conversions are branch-free (so that the reductions vectorise); they must give
// what the straightforward IEEE conversions give: every half and bf16 value to float, and
// floats of every exponent, sign and rounding case (ties, carries into the exponent,
// subnormal halves, overflow, NaNs) back, with reduceInto's loops agreeing element by element.
namespace ref {
float halfToFloat(uint16_t h) {
  uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu, bits;
  if (exp == 0 && mant == 0) {
    bits = sign;
  } else if (exp == 0) {
    exp = 127 - 15 + 1;
    while (!(mant & 0x400u)) {
      mant <<= 1;
      --exp;
    }
    bits = sign | (exp << 23) | ((mant & 0x3ffu) << 13);
  } else if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
uint16_t floatToHalf(float f) {
  if (std::isnan(f)) return static_cast<uint16_t>((std::signbit(f) ? 0x8000u : 0u) | 0x7e00u);
  // exact IEEE rounding to nearest even, by long arithmetic on the value's magnitude
  const uint16_t sign = std::signbit(f) ? 0x8000u : 0u;
  double a = std::fabs(static_cast<double>(f));
  if (a >= 65520.0) return static_cast<uint16_t>(sign | 0x7c00u);
  int e = a == 0 ? -24 : std::max(-14, static_cast<int>(std::floor(std::log2(a))));
  if (a != 0 && std::ldexp(1.0, e) > a) --e;  // (log2 rounding)
  if (a != 0 && std::ldexp(1.0, e + 1) <= a) ++e;
  e = std::max(e, -14);
  const double q = std::nearbyint(std::ldexp(a, 10 - e));  // mantissa with its hidden bit, rounded (ties to even)
  uint32_t m = static_cast<uint32_t>(q);
  int be = e + 15;
  if (m >= 2048) {  // rounded up into the next binade
    m >>= 1;
    ++be;
  }
  if (m < 1024) return static_cast<uint16_t>(sign | m);  // subnormal (be stays 1 = exponent field 0)
  if (be >= 31) return static_cast<uint16_t>(sign | 0x7c00u);
  return static_cast<uint16_t>(sign | (be << 10) | (m & 0x3ffu));
}
}  // namespace ref

TEST(CommTypes, SixteenBitConversionsMatchTheReference) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const float r = ref::halfToFloat(static_cast<uint16_t>(h)), got = halfToFloat(static_cast<uint16_t>(h));
    ASSERT_EQ(std::memcmp(&r, &got, 4), 0) << std::hex << h;
    uint32_t b = h << 16;
    float bf;
    std::memcpy(&bf, &b, 4);
    const float gotBf = bf16ToFloat(static_cast<uint16_t>(h));
    ASSERT_EQ(std::memcmp(&bf, &gotBf, 4), 0) << std::hex << h;
  }
  std::mt19937 rng(7);
  auto check = [&](uint32_t bits) {
    float f;
    std::memcpy(&f, &bits, 4);
    ASSERT_EQ(floatToHalf(f), ref::floatToHalf(f)) << std::hex << bits;
    // bf16: nearest even on the low 16 bits; a NaN stays a NaN, quiet
    const uint16_t b = floatToBf16(f);
    if (std::isnan(f)) {
      ASSERT_TRUE(std::isnan(bf16ToFloat(b))) << std::hex << bits;
      ASSERT_TRUE(b & 0x40u) << std::hex << bits;
    } else {
      // halfway between the bf16 below and the one above (past the largest: 2^128, as if finite)
      const uint32_t e = (bits >> 23) & 0xffu;
      const double lo = bf16ToFloat(static_cast<uint16_t>(bits >> 16));
      const double mid = std::fabs(lo) + std::ldexp(1.0, static_cast<int>(e ? e : 1) - 127 - 7) / 2, x = f;
      const uint16_t want = (bits & 0xffffu) == 0 ? static_cast<uint16_t>(bits >> 16)
                            : std::fabs(x) < std::fabs(mid) ? static_cast<uint16_t>(bits >> 16)
                            : std::fabs(x) > std::fabs(mid) ? static_cast<uint16_t>((bits >> 16) + 1)
                            : static_cast<uint16_t>((bits >> 16) + ((bits >> 16) & 1u));
      ASSERT_EQ(b, want) << std::hex << bits;
    }
  };
  // every exponent and sign, with the mantissa's low bits at their rounding cases and at random
  for (uint32_t se = 0; se < 512; ++se)
    for (uint32_t low : {0u, 1u, 0xfffu, 0x1000u, 0x1001u, 0x2000u, 0x3000u, 0x7fffu, 0x8000u, 0x8001u, 0x18000u, 0x7fffffu})
      for (int k = 0; k < 20; ++k) check((se << 23) | ((k ? rng() & 0x7f0000u : 0u) | low) & 0x7fffffu | (se << 23));
  for (int k = 0; k < 2000000; ++k) check(static_cast<uint32_t>(rng()));
  // The reductions: element by element as the conversions say.
  for (DataType t : {DataType::kFloat16, DataType::kBFloat16})
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kMin, ReduceOp::kMax}) {
      const size_t n = 10007;
      std::vector<uint16_t> a(n), b(n);
      for (size_t i = 0; i < n; ++i) {
        a[i] = static_cast<uint16_t>(rng());
        b[i] = static_cast<uint16_t>(rng());
      }
      auto to = t == DataType::kFloat16 ? floatToHalf : floatToBf16;
      auto from = t == DataType::kFloat16 ? halfToFloat : bf16ToFloat;
      std::vector<uint16_t> d = a;
      reduceInto(d.data(), b.data(), n, t, op);
      for (size_t i = 0; i < n; ++i) {
        const float x = from(a[i]), y = from(b[i]);
        const float r = op == ReduceOp::kSum ? x + y
                        : std::isnan(x) || std::isnan(y) ? std::nanf("")
                        : op == ReduceOp::kMin ? (y < x ? y : x) : (x < y ? y : x);
        if (std::isnan(r)) {
          ASSERT_TRUE(std::isnan(from(d[i]))) << i;
          // (float16: floatToHalf's NaN, whichever path ran: x86's F16C keeps payload bits)
          if (t == DataType::kFloat16) ASSERT_EQ(d[i] & 0x7fffu, 0x7e00u) << std::hex << d[i];
        } else {
          ASSERT_EQ(d[i], to(r)) << i << " " << name(t);
        }
      }
    }
}

// A NaN on any rank makes min and max NaN at its index, whichever rank holds it, wherever in
// the buffer, whatever the algorithm (4 floats: recursive doubling; 65536: the ring) or
// transport (before, std::min/std::max kept or dropped it by operand order: a NaN on rank 1
// of 2 gave 1). Every other index is the plain minimum or maximum.
TEST(TcpComm, MinMaxPropagateANaNFromAnyRank) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (bool shm : {false, true}) {
    CommOptions o;
    o.shm = shm;
    for (int n : {2, 3}) {
      for (size_t count : {size_t{4}, size_t{65536}}) {
        for (int holder = 0; holder < n; ++holder) {
          for (ReduceOp op : {ReduceOp::kMin, ReduceOp::kMax}) {
            const size_t at[] = {0, count - 1};
            onRanks(
                n,
                [&](Communicator& c) {
                  std::vector<float> f(count, static_cast<float>(c.rank() + 1));
                  std::vector<double> d(count, c.rank() + 1.0);
                  std::vector<uint16_t> h(count, floatToHalf(static_cast<float>(c.rank() + 1)));
                  std::vector<uint16_t> b(count, floatToBf16(static_cast<float>(c.rank() + 1)));
                  if (c.rank() == holder)
                    for (size_t i : at) {
                      f[i] = nan;
                      d[i] = nan;
                      h[i] = floatToHalf(nan);
                      b[i] = floatToBf16(nan);
                    }
                  c.allreduce(f.data(), count, DataType::kFloat32, op);
                  c.allreduce(d.data(), count, DataType::kFloat64, op);
                  c.allreduce(h.data(), count, DataType::kFloat16, op);
                  c.allreduce(b.data(), count, DataType::kBFloat16, op);
                  const float plain = op == ReduceOp::kMin ? 1.0f : static_cast<float>(n);
                  for (size_t i = 0; i < count; ++i) {
                    const bool isNan = i == at[0] || i == at[1];
                    const std::string where = "rank " + std::to_string(c.rank()) + " index " + std::to_string(i);
                    if (isNan) {
                      ASSERT_TRUE(std::isnan(f[i]) && std::isnan(d[i]) && std::isnan(halfToFloat(h[i])) &&
                                  std::isnan(bf16ToFloat(b[i])))
                          << where << ": the NaN was dropped";
                    } else {
                      ASSERT_EQ(f[i], plain) << where;
                      ASSERT_EQ(d[i], plain) << where;
                      ASSERT_EQ(halfToFloat(h[i]), plain) << where;
                      ASSERT_EQ(bf16ToFloat(b[i]), plain) << where;
                    }
                  }
                },
                o);
          }
        }
      }
    }
  }
}

TEST(TcpComm, BroadcastAllgatherReduceScatterBarrier) {
  const int n = 4;
  onRanks(n, [&](Communicator& c) {
    for (int root = 0; root < n; ++root) {
      for (size_t count : {size_t{3}, size_t{1 << 18}}) {
        std::vector<int32_t> v(count, c.rank() == root ? root + 100 : -1);
        c.broadcast(v.data(), count, DataType::kInt32, root);
        for (auto x : v) ASSERT_EQ(x, root + 100);
      }
    }
    std::vector<int64_t> mine(1000, c.rank()), all(1000 * n);
    c.allgather(mine.data(), all.data(), 1000, DataType::kInt64);
    for (int r = 0; r < n; ++r)
      for (int i = 0; i < 1000; ++i) ASSERT_EQ(all[static_cast<size_t>(r * 1000 + i)], r);
    std::vector<float> send(static_cast<size_t>(500 * n)), recv(500);
    for (size_t i = 0; i < send.size(); ++i) send[i] = static_cast<float>(i + c.rank());
    c.reduceScatter(send.data(), recv.data(), 500, DataType::kFloat32, ReduceOp::kSum);
    for (size_t i = 0; i < 500; ++i)
      ASSERT_EQ(recv[i], static_cast<float>(n * (c.rank() * 500 + i) + (0 + 1 + 2 + 3)));
    c.barrier();
  });
}

TEST(TcpComm, SendRecvAndAsyncOrder) {
  const int n = 3;
  onRanks(n, [&](Communicator& c) {
    std::vector<char> out(100000, static_cast<char>('a' + c.rank())), in(100000);
    int right = (c.rank() + 1) % n, left = (c.rank() + n - 1) % n;
    // Even ranks send first, odd ranks receive first: no cycle of blocked senders.
    if (c.rank() % 2 == 0) {
      c.send(out.data(), out.size(), right);
      c.recv(in.data(), in.size(), left);
    } else {
      c.recv(in.data(), in.size(), left);
      c.send(out.data(), out.size(), right);
    }
    ASSERT_EQ(in[99999], static_cast<char>('a' + left));
    std::vector<std::vector<int32_t>> bufs(3, std::vector<int32_t>(10000, 1));
    std::vector<WorkPtr> works;
    for (auto& b : bufs) works.push_back(c.allreduceAsync(b.data(), b.size(), DataType::kInt32, ReduceOp::kSum));
    for (auto& w : works) w->wait();
    for (auto& b : bufs) ASSERT_EQ(b[0], n);
    ASSERT_TRUE(works[0]->test());
  });
}

// One message per size, both ways, payload checked: the header travels with the payload in
// one sendmsg, and a payload larger than one send call goes out in pieces.
TEST(TcpComm, SendRecvFramingAllSizes) {
  onRanks(2, [&](Communicator& c) {
    int peer = 1 - c.rank();
    for (size_t bytes : {size_t{0}, size_t{1}, size_t{7}, size_t{8}, size_t{9}, size_t{4095}, size_t{65539}, size_t{(3u << 20) + 5}}) {
      std::vector<char> out(bytes), in(bytes, 0);
      for (size_t i = 0; i < bytes; ++i) out[i] = static_cast<char>(i * 7 + c.rank() * 31);
      if (c.rank() == 0) {
        c.send(out.data(), bytes, peer);
        c.recv(in.data(), bytes, peer);
      } else {
        c.recv(in.data(), bytes, peer);
        c.send(out.data(), bytes, peer);
      }
      for (size_t i = 0; i < bytes; ++i) ASSERT_EQ(in[i], static_cast<char>(i * 7 + peer * 31)) << bytes << " bytes, i=" << i;
    }
  });
}

// Strangers that connect to a rank's port during set-up and say nothing (a port scanner, a
// stale peer) do not hold up the ranks behind them: the hellos are read side by side. One at
// a time, 5 s each, 10 of them timed set-up out while rank 0 waited in the queue.
TEST(TcpComm, SilentStrangersDoNotHoldUpSetUp) {
  auto store = std::make_shared<store::HashStore>();
  CommOptions o = tcpOnly();
  o.timeout = 20s;
  std::vector<int> strangers;
  std::thread r1([&] {
    auto c = createTcpCommunicator(store, 1, 2, o);
    float v = 2;
    c->allreduce(&v, 1, DataType::kFloat32, ReduceOp::kSum);
    EXPECT_EQ(v, 3.0f);
  });
  store->wait({"comm/default/addr/1"}, 10s);
  const auto at = store->get("comm/default/addr/1");
  const int port = std::stoi(at.substr(at.find('\t') + 1));
  for (int i = 0; i < 10; ++i) {
    const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(static_cast<uint16_t>(port));
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ASSERT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
    strangers.push_back(fd);
  }
  std::this_thread::sleep_for(100ms);  // (rank 1 has taken them in)
  const auto t0 = std::chrono::steady_clock::now();
  auto c = createTcpCommunicator(store, 0, 2, o);
  float v = 1;
  c->allreduce(&v, 1, DataType::kFloat32, ReduceOp::kSum);
  EXPECT_EQ(v, 3.0f);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 3s);
  r1.join();
  for (int fd : strangers) ::close(fd);
}

TEST(TcpComm, RecvOfTheWrongSizeFailsNamingBothSizes) {
  auto store = std::make_shared<store::HashStore>();
  CommOptions o = tcpOnly();
  o.timeout = 5s;
  std::thread r1([&] {
    auto c = createTcpCommunicator(store, 1, 2, o);
    std::vector<char> v(100, 'x');
    c->send(v.data(), v.size(), 0);
    try {
      c->barrier();  // fails once rank 0 gives up; keeps the socket open until then
    } catch (const PeerLostError&) {
    }
  });
  auto c = createTcpCommunicator(store, 0, 2, o);
  std::vector<char> v(200);
  std::string error;
  try {
    c->recv(v.data(), v.size(), 1);
  } catch (const PeerLostError& e) {
    error = e.what();
  }
  r1.join();
  EXPECT_NE(error.find("recv from rank 1: expected 200 bytes, the peer sent 100"), std::string::npos) << error;
}

// A blocking op issued while an async op is still running must wait for it, not run inline
// ahead of it: rank 1 answers rank 0's queued recv only after 300 ms, so a send that
// overtook it would return long before the recv completes.
TEST(TcpComm, BlockingOpWaitsBehindAQueuedAsyncOp) {
  onRanks(2, [&](Communicator& c) {
    int32_t x = 0, y = 7;
    if (c.rank() == 0) {
      auto w = c.recvAsync(&x, sizeof(x), 1);
      c.send(&y, sizeof(y), 1);
      EXPECT_TRUE(w->test()) << "the blocking send overtook the queued recv";
      EXPECT_EQ(x, 5);
    } else {
      std::this_thread::sleep_for(300ms);
      x = 5;
      c.send(&x, sizeof(x), 0);
      c.recv(&y, sizeof(y), 0);
      EXPECT_EQ(y, 7);
    }
  });
}

// An async op says when it ran (the trainer's trace): not before it is done; then from its
// start, after the op queued ahead of it ended, to its end. Rank 1 sends its two answers
// 500 ms apart, so rank 0's second recv waits ~500 ms queued and then runs ~500 ms (the
// bounds below leave 200 ms for the ranks' threads starting apart on a loaded machine).
TEST(TcpComm, AsyncOpsSayWhenTheyRanNotWhenTheyWereQueued) {
  onRanks(2, [&](Communicator& c) {
    int32_t x = 0, y = 0;
    if (c.rank() == 0) {
      const auto launched = std::chrono::steady_clock::now();
      auto w1 = c.recvAsync(&x, sizeof(x), 1);
      auto w2 = c.recvAsync(&y, sizeof(y), 1);
      EXPECT_FALSE(w1->ranAt()) << "a span before the op is done";
      w2->wait();
      w1->wait();
      const auto a = w1->ranAt(), b = w2->ranAt();
      ASSERT_TRUE(a && b);
      EXPECT_LE(launched, a->start);
      EXPECT_LE(a->start, a->end);
      EXPECT_LE(a->end, b->start);
      EXPECT_LE(b->start, b->end);
      EXPECT_GE(b->start - launched, 300ms) << "the second op's span counts its time in the queue";
      EXPECT_GE(b->end - b->start, 300ms);
      EXPECT_EQ(x, 1);
      EXPECT_EQ(y, 2);
    } else {
      for (int32_t v : {1, 2}) {
        std::this_thread::sleep_for(500ms);
        c.send(&v, sizeof(v), 0);
      }
    }
  });
}

// While a blocking op runs inline on one thread, an async op issued by another thread must
// not start: rank 0's inline recv completes only after rank 1's 400 ms sleep, and the async
// send issued meanwhile may complete only after it.
TEST(TcpComm, AsyncOpFromAnotherThreadWaitsForAnInlineOp) {
  using Clock = std::chrono::steady_clock;
  onRanks(2, [&](Communicator& c) {
    int32_t x = 0, y = 9;
    if (c.rank() == 0) {
      Clock::time_point recvDone, sendDone;
      std::thread other([&] {
        std::this_thread::sleep_for(100ms);  // the recv below is running by now
        c.sendAsync(&y, sizeof(y), 1)->wait();
        sendDone = Clock::now();
      });
      c.recv(&x, sizeof(x), 1);
      recvDone = Clock::now();
      other.join();
      EXPECT_EQ(x, 3);
      // Were the send run beside the recv, it would end ~300 ms before it (at ~100 ms: 4 bytes
      // fit the socket buffer; the recv ends at ~400 ms). The slack allows for this thread
      // being descheduled between the recv's return and reading the clock (seen under ctest -j2).
      EXPECT_GE(sendDone + 100ms, recvDone) << "the async send ran while the inline recv was running";
    } else {
      std::this_thread::sleep_for(400ms);
      x = 3;
      c.send(&x, sizeof(x), 0);
      c.recv(&y, sizeof(y), 0);
      EXPECT_EQ(y, 9);
    }
  });
}

// Several threads issuing blocking recvs on one communicator while the peer mixes blocking
// and async sends: every op still runs alone (no recv sees another's bytes: the framing
// check would fail) and in issue order (each thread's values increase, since the peer sends
// 0, 1, 2, ... in order).
TEST(TcpComm, ConcurrentCallersKeepOneAtATimeInIssueOrder) {
  const int kThreads = 4, kMsgs = 400;
  onRanks(2, [&](Communicator& c) {
    if (c.rank() == 0) {
      std::vector<int64_t> vals(kMsgs);
      std::vector<WorkPtr> works;
      for (int i = 0; i < kMsgs; ++i) {
        vals[static_cast<size_t>(i)] = i;
        if (i % 3 == 0)
          works.push_back(c.sendAsync(&vals[static_cast<size_t>(i)], sizeof(int64_t), 1));
        else
          c.send(&vals[static_cast<size_t>(i)], sizeof(int64_t), 1);
      }
      for (auto& w : works) w->wait();
    } else {
      std::vector<std::vector<int64_t>> got(kThreads);
      std::vector<std::thread> ts;
      for (int t = 0; t < kThreads; ++t)
        ts.emplace_back([&, t] {
          for (int i = 0; i < kMsgs / kThreads; ++i) {
            int64_t v = -1;
            if (i % 2)
              c.recvAsync(&v, sizeof(v), 0)->wait();
            else
              c.recv(&v, sizeof(v), 0);
            got[static_cast<size_t>(t)].push_back(v);
          }
        });
      for (auto& t : ts) t.join();
      std::vector<int64_t> all;
      for (auto& g : got) {
        for (size_t i = 1; i < g.size(); ++i) EXPECT_LT(g[i - 1], g[i]) << "a thread's receives ran out of order";
        all.insert(all.end(), g.begin(), g.end());
      }
      std::sort(all.begin(), all.end());
      ASSERT_EQ(all.size(), static_cast<size_t>(kMsgs));
      for (int i = 0; i < kMsgs; ++i) ASSERT_EQ(all[static_cast<size_t>(i)], i);
    }
  });
}

// Failure semantics of the inline path are those of the async one: the error names the lost
// rank, the root cause lands in the store, later ops fail at once; a bad argument is a
// SpecError at the call and leaves the communicator usable.
TEST(TcpComm, InlineBlockingOpFailsLikeAnAsyncOne) {
  auto store = std::make_shared<store::HashStore>();
  CommOptions o = tcpOnly();
  o.timeout = 5s;
  std::thread r1([&] {
    auto c = createTcpCommunicator(store, 1, 2, o);
    c->barrier();
  });
  auto c = createTcpCommunicator(store, 0, 2, o);
  int32_t x = 0;
  EXPECT_THROW(c->send(&x, sizeof(x), 0), SpecError);  // self
  EXPECT_THROW(c->recv(&x, sizeof(x), 2), SpecError);  // no such rank
  c->barrier();  // still usable
  r1.join();
  std::string error;
  try {
    c->recv(&x, sizeof(x), 1);
  } catch (const PeerLostError& e) {
    error = e.what();
  }
  EXPECT_NE(error.find("recv on rank 0: lost rank 1: connection closed"), std::string::npos) << error;
  ASSERT_TRUE(store->check({"comm/default/failure"}));
  EXPECT_NE(store->get("comm/default/failure").find("lost rank 1"), std::string::npos);
  try {
    c->barrier();
    ADD_FAILURE() << "a broken communicator ran a barrier";
  } catch (const PeerLostError& e) {
    EXPECT_NE(std::string(e.what()).find("unusable after an earlier failure"), std::string::npos) << e.what();
  }
  EXPECT_THROW(c->sendAsync(&x, sizeof(x), 1)->wait(), PeerLostError);
}

TEST(TcpComm, LostPeerFailsFastAndNamesIt) {
  auto store = std::make_shared<store::HashStore>();
  CommOptions o = tcpOnly();
  o.timeout = 5s;
  std::string error;
  std::chrono::steady_clock::duration took{};
  std::thread r1([&] {
    auto c = createTcpCommunicator(store, 1, 2, o);
    c->barrier();
    // Leaves without joining the allreduce: its sockets close.
  });
  {
    auto c = createTcpCommunicator(store, 0, 2, o);
    c->barrier();
    r1.join();
    std::vector<float> v(1 << 20, 1.0f);
    auto start = std::chrono::steady_clock::now();
    try {
      c->allreduce(v.data(), v.size(), DataType::kFloat32, ReduceOp::kSum);
    } catch (const PeerLostError& e) {
      error = e.what();
    }
    took = std::chrono::steady_clock::now() - start;
    // The communicator stays failed.
    EXPECT_THROW(c->barrier(), PeerLostError);
  }
  EXPECT_NE(error.find("allreduce on rank 0: lost rank 1"), std::string::npos) << error;
  EXPECT_LT(took, 2s);
}

// A signal handled while a rank waits for its peers to connect (poll() returns EINTR) is not
// a timeout: the set-up goes on until the peers come or the deadline passes.
TEST(TcpComm, SetUpSurvivesSignalsWhileWaitingForPeers) {
  struct sigaction sa{}, old{};
  sa.sa_handler = [](int) {};
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = 0;  // no SA_RESTART: every wait the signal lands in returns EINTR
  const int sig = SIGRTMIN + 3;
  ASSERT_EQ(::sigaction(sig, &sa, &old), 0);
  auto store = std::make_shared<store::HashStore>();
  CommOptions o = tcpOnly();
  o.timeout = 10s;
  std::atomic<bool> done{false};
  std::promise<pthread_t> waiterId;
  std::string error;
  std::thread r1([&] {
    waiterId.set_value(::pthread_self());
    try {
      auto c = createTcpCommunicator(store, 1, 2, o);  // accepts rank 0, which comes late
      c->barrier();
    } catch (const std::exception& e) {
      error = e.what();
    }
    done = true;
  });
  pthread_t waiter = waiterId.get_future().get();
  std::thread signaller([&] {
    while (!done) {
      ::pthread_kill(waiter, sig);
      std::this_thread::sleep_for(5ms);
    }
  });
  std::this_thread::sleep_for(400ms);
  std::string error0;
  if (!done) {
    try {
      o.timeout = 2s;
      auto c = createTcpCommunicator(store, 0, 2, o);
      c->barrier();
    } catch (const std::exception& e) {
      error0 = e.what();
    }
  }
  signaller.join();  // (first: it signals r1's thread until r1 is done, never after its join)
  r1.join();
  ::sigaction(sig, &old, nullptr);
  EXPECT_EQ(error, "");
  EXPECT_EQ(error0, "");
}

TEST(TcpComm, SilentPeerTimesOutWithinTheTimeout) {
  auto store = std::make_shared<store::HashStore>();
  CommOptions o = tcpOnly();
  o.timeout = 500ms;
  std::string error;
  std::promise<void> release;
  auto released = release.get_future().share();
  std::thread r1([&] {
    auto c = createTcpCommunicator(store, 1, 2, o);
    released.wait();  // alive, connected, but never joins the collective (as if SIGSTOPped)
  });
  auto c = createTcpCommunicator(store, 0, 2, o);
  int32_t x = 1;
  auto start = std::chrono::steady_clock::now();
  try {
    c->allreduce(&x, 1, DataType::kInt32, ReduceOp::kSum);
  } catch (const PeerLostError& e) {
    error = e.what();
  }
  auto took = std::chrono::steady_clock::now() - start;
  release.set_value();
  r1.join();
  EXPECT_NE(error.find("lost rank 1: not done within the 0.5 s per-operation timeout"), std::string::npos) << error;
  EXPECT_GE(took, 450ms);
  EXPECT_LT(took, 1500ms);
}

// The operations of a job whose rank 2 of 4 is lost, chosen so that some ranks wait on a
// healthy rank that waits on rank 2 (rank 0 waits on rank 3 in the ring, ...).
std::vector<std::pair<std::string, std::function<void(Communicator&)>>> chainedOps() {
  return {
      {"allreduce",
       [](Communicator& c) {
         std::vector<float> v(1 << 20, 1.0f);
         c.allreduce(v.data(), v.size(), DataType::kFloat32, ReduceOp::kSum);
       }},
      {"allgather",
       [](Communicator& c) {
         std::vector<float> in(1 << 18, 1.0f), out(in.size() * static_cast<size_t>(c.size()));
         c.allgather(in.data(), out.data(), in.size(), DataType::kFloat32);
       }},
      {"barrier", [](Communicator& c) { c.barrier(); }},
      {"p2p chain",  // a pipeline: 0 -> 1 -> 2 -> 3 -> 0, larger than socket buffers and channels
       [](Communicator& c) {
         testing::p2pRing(c, 4u << 20);
       }},
  };
}

void expectEveryRankNames(const testing::LostRankRun& run, int victim, const std::string& what,
                          std::chrono::milliseconds within) {
  for (int r = 0; r < static_cast<int>(run.errors.size()); ++r) {
    if (r == victim) continue;
    const std::string& e = run.errors[static_cast<size_t>(r)];
    EXPECT_NE(e.find(fmt::format(" on rank {}: lost rank {}: ", r, victim)), std::string::npos)
        << what << ": rank " << r << ": " << e;
    EXPECT_LT(run.took[static_cast<size_t>(r)], within) << what << ": rank " << r;
  }
  EXPECT_NE(run.firstFailure.find(fmt::format(": lost rank {}: ", victim)), std::string::npos)
      << what << ": the job's first failure: " << run.firstFailure;
}

// A stopped rank (connected, silent) is named by every rank, not only by those that wait on
// it directly: the others wait on healthy ranks that wait on it, and used to name those (4
// ranks, rank 2 stopped, ring all-reduce: rank 0 named rank 3, rank 1 named rank 0, and the
// job's first failure was sometimes one of those). Each rank records whom it waits on when its
// deadline passes and follows the records to the rank that recorded nothing.
TEST(TcpComm, AStoppedRankIsNamedByEveryRankThatWaitsOnIt) {
  CommOptions o = tcpOnly();
  o.timeout = 1s;
  for (const auto& [what, op] : chainedOps()) {
    auto run = testing::lostRankRun(4, 2, /*stop=*/true, o, op);
    expectEveryRankNames(run, 2, what, 2500ms);
  }
  // The message says through whom: rank 0 waited on rank 3 in the ring.
  auto run = testing::lostRankRun(4, 2, true, o, chainedOps()[0].second);
  EXPECT_NE(run.errors[0].find("allreduce on rank 0: lost rank 2: not done within the 1 s per-operation timeout (rank 0 waited "
                               "on rank 3, which waits on rank 2; sent "),
            std::string::npos)
      << run.errors[0];
}

// The same for a rank that leaves (killed: its connections close): a rank whose peer closed
// its connections after it lost rank 2 names rank 2 too, as fast as before.
TEST(TcpComm, ALeavingRankIsNamedByEveryRankThatWaitsOnIt) {
  CommOptions o = tcpOnly();
  o.timeout = 10s;
  for (const auto& [what, op] : chainedOps()) {
    auto run = testing::lostRankRun(4, 2, /*stop=*/false, o, op);
    expectEveryRankNames(run, 2, what, 2s);
  }
}

// Fails the calls that record or follow waits; forwards the others to a HashStore.
class NoWaitRecordsStore final : public testing::ForwardingStore {
 public:
  NoWaitRecordsStore() : ForwardingStore(std::make_shared<store::HashStore>()) {}
  static bool refused(const std::string& key) {
    return key.find("/waits/") != std::string::npos || key.find("/waiting") != std::string::npos;
  }
  static bool refused(const std::vector<std::string>& keys) {
    return std::any_of(keys.begin(), keys.end(), [](const std::string& k) { return refused(k); });
  }
  void set(const std::string& key, const store::Bytes& value) override {
    if (refused(key)) throw store::StoreError("refused");
    inner_->set(key, value);
  }
  store::Bytes get(const std::string& key) override {
    if (refused(key)) throw store::StoreError("refused");
    return inner_->get(key);
  }
  int64_t add(const std::string& key, int64_t delta) override {
    if (refused(key)) throw store::StoreError("refused");
    return inner_->add(key, delta);
  }
  bool check(const std::vector<std::string>& keys) override {
    if (refused(keys)) throw store::StoreError("refused");
    return inner_->check(keys);
  }
  void wait(const std::vector<std::string>& keys, store::Duration t) override {
    if (refused(keys)) throw store::StoreError("refused");
    inner_->wait(keys, t);
  }
  using store::Store::wait;
};

// A store that fails while a rank records and follows waits costs nothing but the better
// name: every rank still fails in time, naming the rank it waited on (as before the records).
TEST(TcpComm, StoreFailuresWhileFollowingWaitsFallBackToTheAwaitedRank) {
  CommOptions o = tcpOnly();
  o.timeout = 1s;
  auto run = testing::lostRankRun(4, 2, true, o, chainedOps()[0].second, std::make_shared<NoWaitRecordsStore>());
  for (int r : {0, 1, 3}) {
    EXPECT_NE(run.errors[static_cast<size_t>(r)].find("lost rank "), std::string::npos)
        << run.errors[static_cast<size_t>(r)];
    EXPECT_LT(run.took[static_cast<size_t>(r)], 2500ms) << "rank " << r;
  }
  EXPECT_NE(run.errors[3].find("allreduce on rank 3: lost rank 2: not done within the 1 s per-operation timeout (sent "),
            std::string::npos)
      << run.errors[3];
}

// Forwards to another communicator through the async ops only (so its blocking calls take
// the base class's default hooks, as the NCCL backend's do) and, when asked, corrupts the
// first byte of every received message.
class ForwardingComm final : public Communicator {
 public:
  struct DoneWork final : Work {
    void wait() override {}
    bool test() override { return true; }
  };
  ForwardingComm(Communicator& inner, bool corrupt) : c_(inner), corrupt_(corrupt) {}
  int rank() const override { return c_.rank(); }
  int size() const override { return c_.size(); }
  const char* backend() const override { return c_.backend(); }
  WorkPtr allreduceAsync(void* d, size_t n, DataType t, ReduceOp op) override { return c_.allreduceAsync(d, n, t, op); }
  WorkPtr broadcastAsync(void* d, size_t n, DataType t, int root) override { return c_.broadcastAsync(d, n, t, root); }
  WorkPtr allgatherAsync(const void* s, void* r, size_t n, DataType t) override { return c_.allgatherAsync(s, r, n, t); }
  WorkPtr reduceScatterAsync(const void* s, void* r, size_t n, DataType t, ReduceOp op) override {
    return c_.reduceScatterAsync(s, r, n, t, op);
  }
  WorkPtr barrierAsync() override { return c_.barrierAsync(); }
  WorkPtr sendAsync(const void* d, size_t bytes, int peer) override { return c_.sendAsync(d, bytes, peer); }
  WorkPtr recvAsync(void* d, size_t bytes, int peer) override {
    c_.recvAsync(d, bytes, peer)->wait();
    if (corrupt_ && bytes) static_cast<char*>(d)[0] ^= 0x40;
    return std::make_shared<DoneWork>();
  }
  WorkPtr sendRecvAsync(const void* sd, size_t sb, int sp, void* rd, size_t rb, int rp) override {
    return c_.sendRecvAsync(sd, sb, sp, rd, rb, rp);
  }
  std::unique_ptr<Communicator> group(const std::vector<int>&, const std::string&) override {
    throw SpecError("ForwardingComm: no groups");
  }

 private:
  Communicator& c_;
  bool corrupt_;
};

// The bench's check at many ranks: 80 ranks' bfloat16 sums stay within the integers bfloat16
// holds exactly (from 73 ranks on, correct sums were counted wrong and the bench failed), and
// allgather's rows neither repeat nor pass -e when a size rounds to whole elements per rank.
TEST(TcpComm, BenchChecksHoldAtManyRanksAndSmallSizes) {
  BenchOptions o;
  o.dtype = DataType::kBFloat16;
  o.min_bytes = o.max_bytes = 26 * 2;
  o.iters = 1;
  o.warmup = 0;
  for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax}) {
    o.op = op;
    std::vector<long long> wrong(80, -1);
    onRanks(80, [&](Communicator& c) { wrong[static_cast<size_t>(c.rank())] = runBench(c, o).at(0).wrong; });
    EXPECT_EQ(wrong[0], 0) << name(op);
  }
  BenchOptions g;
  g.collective = Collective::kAllgather;
  g.min_bytes = 4;
  g.max_bytes = 64;
  g.iters = 1;
  g.warmup = 0;
  std::vector<size_t> sizes;
  onRanks(3, [&](Communicator& c) {
    auto rows = runBench(c, g);
    if (c.rank() == 0)
      for (const auto& r : rows) sizes.push_back(r.bytes);
    BenchOptions tiny = g;
    tiny.max_bytes = 8;  // less than one float from each of 3 ranks
    EXPECT_THROW(runBench(c, tiny), SpecError);
  });
  EXPECT_EQ(sizes, (std::vector<size_t>{12, 24, 60}));
}

TEST(TcpComm, BenchSendRecvPingPongVerifiesPayloads) {
  BenchOptions o;
  o.collective = Collective::kSendRecv;
  o.min_bytes = 8;
  o.max_bytes = 64 * 1024;
  o.factor = 8;
  o.iters = 5;
  o.warmup = 1;
  std::vector<std::vector<BenchRow>> rows(2), bad(2);
  onRanks(2, [&](Communicator& c) {
    rows[static_cast<size_t>(c.rank())] = runBench(c, o);
    ForwardingComm corrupting(c, true);
    bad[static_cast<size_t>(c.rank())] = runBench(corrupting, o);
  });
  ASSERT_EQ(rows[0].size(), 5u);  // 8, 64, 512, 4096, 32768
  for (size_t i = 0; i < rows[0].size(); ++i) {
    const auto& r = rows[0][i];
    EXPECT_EQ(r.bytes, size_t{8} << (3 * i));
    EXPECT_EQ(r.count, r.bytes / 4);
    EXPECT_EQ(r.wrong, 0) << r.bytes;
    EXPECT_GT(r.time_us, 0);
    EXPECT_DOUBLE_EQ(r.busbw, r.algbw);
    EXPECT_EQ(r.transport, "tcp");  // never the collectives' shm path
    EXPECT_EQ(rows[1][i].time_us, r.time_us) << "every rank reports rank 0's time";
  }
  // One corrupted byte per direction: a float element on each rank.
  ASSERT_EQ(bad[0].size(), 5u);
  for (const auto& r : bad[0]) EXPECT_EQ(r.wrong, 2) << r.bytes;
  onRanks(3, [&](Communicator& c) { EXPECT_THROW(runBench(c, o), SpecError); });
}

TEST(TcpComm, ParsesNames) {
  EXPECT_EQ(parseDataType("bf16"), DataType::kBFloat16);
  EXPECT_EQ(parseReduceOp("avg"), ReduceOp::kAvg);
  EXPECT_THROW(parseDataType("complex"), SpecError);
  EXPECT_THROW(parseReduceOp("prod"), SpecError);
}

// A rank that never comes to the mesh's set-up is named (before: the store key waited on).
TEST(TcpComm, ARankThatNeverComesToTheSetUpIsNamed) {
  auto store = std::make_shared<store::HashStore>();
  CommOptions o = tcpOnly();
  o.timeout = 300ms;
  try {
    createTcpCommunicator(store, 0, 2, o);
    ADD_FAILURE() << "set up without rank 1";
  } catch (const PeerLostError& e) {
    EXPECT_EQ(std::string(e.what()).rfind("communicator \"default\" set-up on rank 0: lost rank 1: it did not publish "
                                          "its address (not started, or failed before it): ",
                                          0),
              0u)
        << e.what();
  }
}

// CommOptions::check (DTRAIN_COMM_CHECK=1): ranks that call different collectives, or the
// same with another count, type, op or root, fail alike with one message naming each rank's
// call; without it they went on in silence (over shared memory a shorter allreduce left the
// longer one's tail unreduced, and an allreduce of float64 against float32 gave garbage).
TEST(TcpComm, CheckModeRefusesRanksThatDisagreeOnACollective) {
  for (bool shm : {false, true}) {
    CommOptions o;
    o.shm = shm;
    o.check = true;
    o.timeout = 5s;
    // Agreeing ranks: the operations run as ever, several in a row (posts of earlier ones
    // removed as they go).
    onRanks(3, [&](Communicator& c) {
      for (int i = 0; i < 5; ++i) {
        std::vector<float> v(10, 1.0f);
        c.allreduce(v.data(), v.size(), DataType::kFloat32, ReduceOp::kSum);
        ASSERT_EQ(v[9], 3.0f);
        c.barrier();
      }
    }, o);
    auto disagree = [&](const std::function<void(Communicator&)>& fn) { return testing::runRanks(2, fn, o); };
    auto errors = disagree([](Communicator& c) {
      std::vector<float> v(c.rank() == 0 ? 10 : 20, 1.0f);
      c.allreduce(v.data(), v.size(), DataType::kFloat32, ReduceOp::kSum);
    });
    for (int r = 0; r < 2; ++r)
      EXPECT_NE(errors[static_cast<size_t>(r)].find(fmt::format(
                    "allreduce on rank {}: the ranks disagree on operation #0 of communicator \"default\" "
                    "(DTRAIN_COMM_CHECK): rank 0 allreduce of 10 float (sum); rank 1 allreduce of 20 float (sum); "
                    "every rank must issue",
                    r)),
                std::string::npos)
          << "shm " << shm << ": " << errors[static_cast<size_t>(r)];
    errors = disagree([](Communicator& c) {
      double v[4] = {1, 2, 3, 4};
      c.allreduce(v, 4, c.rank() == 0 ? DataType::kFloat64 : DataType::kFloat32,
                  c.rank() == 0 ? ReduceOp::kSum : ReduceOp::kMax);
    });
    EXPECT_NE(errors[1].find("rank 0 allreduce of 4 double (sum); rank 1 allreduce of 4 float (max)"), std::string::npos)
        << errors[1];
    errors = disagree([](Communicator& c) {
      int32_t v = c.rank();
      c.broadcast(&v, 1, DataType::kInt32, c.rank());
    });
    EXPECT_NE(errors[0].find("rank 0 broadcast of 1 int32 from rank 0; rank 1 broadcast of 1 int32 from rank 1"),
              std::string::npos)
        << errors[0];
    errors = disagree([](Communicator& c) {
      std::vector<float> v(4, 1.0f);
      if (c.rank() == 0) c.barrier();
      c.allreduce(v.data(), v.size(), DataType::kFloat32, ReduceOp::kSum);
    });
    EXPECT_NE(errors[1].find("rank 0 barrier of 0 int32; rank 1 allreduce of 4 float (sum)"), std::string::npos)
        << errors[1];
    // A rank that issues no more: the other is told which one, at its deadline.
    o.timeout = 500ms;
    errors = disagree([](Communicator& c) {
      if (c.rank() == 1) return;
      c.barrier();
    });
    EXPECT_NE(errors[0].find("barrier on rank 0: lost rank 1: it did not issue operation #0 (barrier of 0 int32) within "
                             "the 0.5 s timeout"),
              std::string::npos)
        << errors[0];
  }
}

}  // namespace
}  // namespace dtrain::comm

namespace dtrain::comm {
namespace {

// A rank that fails at a chosen point of the set-up: its store throws when it writes a key
// ending in `failAt`, so the rank's constructor unwinds and closes its sockets and listener,
// as a rank killed there would.
class FailingStore : public testing::ForwardingStore {
 public:
  FailingStore(std::shared_ptr<store::Store> inner, std::string failAt)
      : ForwardingStore(std::move(inner)), failAt_(std::move(failAt)) {}
  void set(const std::string& key, const store::Bytes& value) override {
    if (key.size() >= failAt_.size() && key.compare(key.size() - failAt_.size(), failAt_.size(), failAt_) == 0) {
      held_ = {key, value};
      throw IoError("injected: this rank dies here");
    }
    inner_->set(key, value);
  }
  // Writes the key the rank died writing, as if it had got there first: called once the
  // rank's set-up has unwound (its listener closed), so that no peer can reach it meanwhile.
  void publishHeld() { inner_->set(held_.first, held_.second); }

 private:
  std::string failAt_;
  std::pair<std::string, store::Bytes> held_;
};

// Ranks 0..n-1 set up a communicator; `victim` uses `victimStore`. Returns each rank's error
// and how long the survivors took.
struct SetUpRun {
  std::vector<std::string> errors;
  std::chrono::duration<double> took{};
};
SetUpRun setUpWith(int n, int victim, std::shared_ptr<store::Store> shared, std::shared_ptr<store::Store> victimStore,
                   CommOptions o, std::chrono::milliseconds victimDelay = std::chrono::milliseconds(0),
                   std::function<void()> afterVictimFailed = {}) {
  SetUpRun run;
  run.errors.resize(static_cast<size_t>(n));
  const auto start = std::chrono::steady_clock::now();
  std::vector<std::thread> ts;
  for (int r = 0; r < n; ++r)
    ts.emplace_back([&, r] {
      try {
        if (r == victim) std::this_thread::sleep_for(victimDelay);
        auto c = createTcpCommunicator(r == victim ? victimStore : shared, r, n, o);
        c->barrier();
      } catch (const std::exception& e) {
        run.errors[static_cast<size_t>(r)] = e.what();
        if (r == victim && afterVictimFailed) afterVictimFailed();
      }
    });
  for (auto& t : ts) t.join();
  run.took = std::chrono::steady_clock::now() - start;
  return run;
}

// A rank that dies during the shared-memory set-up (its mesh connected) is named by every
// survivor at once, from its closed socket (before: each waited out the whole timeout for a
// store key and named the key, not the rank).
TEST(TcpCommSetUp, ARankDeadDuringTheSharedMemorySetUpIsNamedAtOnce) {
  auto shared = std::make_shared<store::HashStore>();
  CommOptions o;
  o.timeout = std::chrono::seconds(20);
  auto run = setUpWith(3, 1, shared, std::make_shared<FailingStore>(shared, "shm/mapped/1"), o);
  EXPECT_NE(run.errors[1].find("injected"), std::string::npos) << run.errors[1];
  for (int r : {0, 2})
    EXPECT_EQ(run.errors[static_cast<size_t>(r)].rfind(
                  fmt::format("communicator \"default\" shared-memory set-up on rank {}: lost rank 1: connection closed "
                              "(the process exited or was killed) before it mapped the segment", r), 0), 0u)
        << run.errors[static_cast<size_t>(r)];
  EXPECT_LT(run.took, std::chrono::seconds(5));
}

// A rank that never publishes its address is the one named by the ranks above it, which
// wait for it and for the healthy ranks it holds up (before: "waiting for rank(s) 0, 1").
TEST(TcpCommSetUp, TheRankThatNeverPublishedIsNamed) {
  auto shared = std::make_shared<store::HashStore>();
  CommOptions o;
  o.timeout = std::chrono::seconds(1);
  auto run = setUpWith(3, 1, shared, shared, o, std::chrono::milliseconds(4000));
  EXPECT_EQ(run.errors[0].rfind("communicator \"default\" set-up on rank 0: lost rank 1: it did not publish its address", 0),
            0u) << run.errors[0];
  EXPECT_EQ(run.errors[2].rfind("communicator \"default\" set-up on rank 2: lost rank 1: it did not publish its address "
                                "(not started, stopped, or failed before it); timed out after 1 s waiting for rank(s) 0, 1 "
                                "to connect", 0), 0u) << run.errors[2];
}

// A rank that published its address and then died refuses connections: the rank connecting
// to it fails within the 2 s grace, naming it (before: it retried for the whole timeout).
TEST(TcpCommSetUp, ARankDeadAfterPublishingItsAddressIsNamedWithinTheGrace) {
  auto shared = std::make_shared<store::HashStore>();
  auto victim = std::make_shared<FailingStore>(shared, "addr/1");
  CommOptions o;
  o.timeout = std::chrono::seconds(30);
  // (the address appears once the rank is gone: a dead rank's address, which refuses)
  auto run = setUpWith(2, 1, shared, victim, o, std::chrono::milliseconds(0), [&] { victim->publishHeld(); });
  EXPECT_NE(run.errors[1].find("injected"), std::string::npos) << run.errors[1];
  EXPECT_EQ(run.errors[0].rfind("communicator \"default\" set-up on rank 0: lost rank 1: its address 127.0.0.1:", 0), 0u)
      << run.errors[0];
  EXPECT_NE(run.errors[0].find("refused connections for 2"), std::string::npos) << run.errors[0];
  EXPECT_LT(run.took, std::chrono::seconds(6));
}

}  // namespace
}  // namespace dtrain::comm
