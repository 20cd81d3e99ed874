#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <future>
#include <random>
#include <thread>

#include "dtrain/comm/communicator.h"
#include "dtrain/common/errors.h"
#include "dtrain/store/hash_store.h"

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
  auto store = std::make_shared<store::HashStore>();
  std::vector<std::thread> ts;
  std::vector<std::string> errors(static_cast<size_t>(n));
  for (int r = 0; r < n; ++r)
    ts.emplace_back([&, r] {
      try {
        auto c = createTcpCommunicator(store, r, n, o);
        fn(*c);
      } catch (const std::exception& e) {
        errors[static_cast<size_t>(r)] = e.what();
      }
    });
  for (auto& t : ts) t.join();
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
  EXPECT_NE(error.find("lost rank 1: no progress within the 0.5 s timeout"), std::string::npos) << error;
  EXPECT_GE(took, 450ms);
  EXPECT_LT(took, 1500ms);
}

TEST(TcpComm, ParsesNames) {
  EXPECT_EQ(parseDataType("bf16"), DataType::kBFloat16);
  EXPECT_EQ(parseReduceOp("avg"), ReduceOp::kAvg);
  EXPECT_THROW(parseDataType("complex"), SpecError);
  EXPECT_THROW(parseReduceOp("prod"), SpecError);
}

}  // namespace
}  // namespace dtrain::comm
