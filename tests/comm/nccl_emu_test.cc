// The NCCL backend (lib/comm/src/nccl/nccl_communicator.cc, the real source) against an
// emulated CUDA runtime and NCCL (nccl_emulation/): its own logic, in every build and without
// a GPU. Ranks are threads. What it checks: results through device buffers, groups on their
// parent's GPU, the error contract (timeouts that abort, async errors, failed enqueues, lost
// peers at creation, messages with job ranks, the store's failure key), that no NCCL call
// touches an aborted communicator, and that a communicator with work outstanding is aborted,
// not destroyed (which hangs). What it cannot: NCCL and CUDA themselves, real asynchrony on a
// device. Those are tests/comm/nccl_comm_test.cc and scripts/gpu_check.sh on a GPU.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <functional>
#include <thread>

#include "dtrain/comm/bench.h"
#include "dtrain/comm/communicator.h"
#include "dtrain/common/errors.h"
#include "dtrain/store/hash_store.h"
#include "emu_nccl.h"

namespace dtrain::comm {
extern "C" Communicator* dtrain_create_nccl_communicator(const std::shared_ptr<store::Store>* store, int rank, int size,
                                                         const CommOptions* opts);
namespace {

using Clock = std::chrono::steady_clock;

// `text` contains `part`.
#define EXPECT_HAS(text, part) EXPECT_NE(std::string(text).find(part), std::string::npos) << (text)

std::unique_ptr<Communicator> make(std::shared_ptr<store::Store> store, int rank, int size, CommOptions o = {}) {
  o.backend = "nccl";
  return std::unique_ptr<Communicator>(dtrain_create_nccl_communicator(&store, rank, size, &o));
}

class NcclEmu : public ::testing::Test {
 protected:
  void SetUp() override {
    emu_nccl::reset();
    ::unsetenv("LOCAL_RANK");
  }
  void TearDown() override {
    EXPECT_EQ(emu_nccl::counters().useAfterAbort, 0) << "an NCCL call on an aborted communicator";
  }

  // Runs fn(rank) on n threads; returns each rank's error ("" when none).
  static std::vector<std::string> ranks(int n, const std::function<void(int)>& fn) {
    std::vector<std::string> errors(static_cast<size_t>(n));
    std::vector<std::thread> ts;
    for (int r = 0; r < n; ++r)
      ts.emplace_back([&, r] {
        try {
          fn(r);
        } catch (const std::exception& e) {
          errors[static_cast<size_t>(r)] = e.what();
        }
      });
    for (auto& t : ts) t.join();
    return errors;
  }

  // Every rank's communicator of an n-rank world, made at once.
  std::vector<std::unique_ptr<Communicator>> makeAll(int n, const CommOptions& o = {}) {
    std::vector<std::unique_ptr<Communicator>> cs(static_cast<size_t>(n));
    ranks(n, [&](int r) { cs[static_cast<size_t>(r)] = make(store_, r, n, o); });
    return cs;
  }
  // Releases every rank's communicator at once, as the ranks of a job do (one after the other,
  // the first would wait for the others to release theirs, up to min(timeout, 30 s)).
  static void release(std::vector<std::unique_ptr<Communicator>>& cs) {
    ranks(static_cast<int>(cs.size()), [&](int r) { cs[static_cast<size_t>(r)].reset(); });
  }

  std::shared_ptr<store::HashStore> store_ = std::make_shared<store::HashStore>();
};

template <typename T>
std::vector<T> run(Communicator& c, const std::vector<T>& in, const std::function<void(void*)>& op, size_t outCount) {
  auto b = c.allocate(std::max(in.size(), outCount) * sizeof(T));
  b->upload(in.data(), in.size() * sizeof(T));
  op(b->data());
  std::vector<T> out(outCount);
  b->download(out.data(), out.size() * sizeof(T));
  return out;
}

TEST_F(NcclEmu, CollectivesThroughDeviceBuffers) {
  const int n = 4;
  auto errors = ranks(n, [&](int r) {
    auto c = make(store_, r, n);
    std::vector<float> f(1000, static_cast<float>(r + 1));
    auto sum = run<float>(
        *c, f, [&](void* d) { c->allreduce(d, 1000, DataType::kFloat32, ReduceOp::kSum); }, 1000);
    for (float v : sum) ASSERT_EQ(v, 10.0f);
    auto mx = run<int64_t>(
        *c, {r, -r}, [&](void* d) { c->allreduce(d, 2, DataType::kInt64, ReduceOp::kMax); }, 2);
    ASSERT_EQ(mx, (std::vector<int64_t>{3, 0}));
    auto avg = run<double>(
        *c, {double(r)}, [&](void* d) { c->allreduce(d, 1, DataType::kFloat64, ReduceOp::kAvg); }, 1);
    ASSERT_EQ(avg[0], 1.5);
    auto bc = run<int32_t>(
        *c, {r * 7}, [&](void* d) { c->broadcast(d, 1, DataType::kInt32, 2); }, 1);
    ASSERT_EQ(bc[0], 14);
    // allgather: send block then room for n blocks, in one buffer (send at the end)
    auto sendb = c->allocate(sizeof(int32_t));
    const int32_t mine = 100 + r;
    sendb->upload(&mine, sizeof(mine));
    auto ag = run<int32_t>(
        *c, {}, [&](void* d) { c->allgather(sendb->data(), d, 1, DataType::kInt32); }, n);
    ASSERT_EQ(ag, (std::vector<int32_t>{100, 101, 102, 103}));
    auto rsIn = c->allocate(n * sizeof(int32_t));
    const std::vector<int32_t> blocks{r, 10 * r, 100 * r, 1000 * r};
    rsIn->upload(blocks.data(), blocks.size() * sizeof(int32_t));
    auto rs = run<int32_t>(
        *c, {}, [&](void* d) { c->reduceScatter(rsIn->data(), d, 1, DataType::kInt32, ReduceOp::kSum); }, 1);
    ASSERT_EQ(rs[0], std::vector<int32_t>({6, 60, 600, 6000})[static_cast<size_t>(r)]);
    c->barrier();
    // A ring exchange with sendRecv (grouped send and recv).
    auto sb = c->allocate(sizeof(int32_t)), rb = c->allocate(sizeof(int32_t));
    sb->upload(&mine, sizeof(mine));
    c->sendRecv(sb->data(), 4, (r + 1) % n, rb->data(), 4, (r + n - 1) % n);
    int32_t got = 0;
    rb->download(&got, 4);
    ASSERT_EQ(got, 100 + (r + n - 1) % n);
  });
  for (const auto& e : errors) EXPECT_EQ(e, "");
  // Clean ends are destroyed, not aborted.
  EXPECT_EQ(emu_nccl::counters().destroys, n);
  EXPECT_EQ(emu_nccl::counters().aborts, 0);
}

// dtrain bench's buffers are the backend's: NCCL refuses host memory (the bench used to pass
// std::vector buffers and host scalars).
TEST_F(NcclEmu, BenchRunsOnDeviceBuffers) {
  for (Collective col :
       {Collective::kAllreduce, Collective::kBroadcast, Collective::kAllgather, Collective::kSendRecv}) {
    emu_nccl::reset();
    store_ = std::make_shared<store::HashStore>();
    std::vector<std::vector<BenchRow>> rows(2);
    auto errors = ranks(2, [&](int r) {
      auto c = make(store_, r, 2);
      BenchOptions o;
      o.collective = col;
      o.min_bytes = 64;
      o.max_bytes = 4096;
      o.factor = 8;
      o.iters = 2;
      o.warmup = 1;
      rows[static_cast<size_t>(r)] = runBench(*c, o, nullptr);
    });
    ASSERT_EQ(errors, (std::vector<std::string>{"", ""})) << name(col);
    ASSERT_EQ(rows[0].size(), 3u) << name(col);
    for (const auto& row : rows[0]) EXPECT_EQ(row.wrong, 0) << name(col) << " " << row.bytes;
  }
}

// NCCL does not check pointers (unless NCCL_CHECK_POINTERS=1): a host pointer's kernel would
// fault and take the CUDA context with it. The backend refuses it before enqueueing, and the
// communicator stays usable.
TEST_F(NcclEmu, HostOrOtherDeviceMemoryIsRefusedBeforeEnqueueing) {
  auto errors = ranks(2, [&](int r) {
    auto c = make(store_, r, 2);
    if (r == 0) {
      float host = 1;
      try {
        c->allreduce(&host, 1, DataType::kFloat32, ReduceOp::kSum);
        ADD_FAILURE() << "a host pointer was accepted";
      } catch (const SpecError& e) {
        EXPECT_HAS(e.what(), "allreduce on rank 0: the buffer at 0x");
        EXPECT_HAS(e.what(),
                   " is host memory; the nccl backend needs device memory of cuda:0 (its communicator's GPU)");
      }
      void* other = nullptr;  // rank 1's GPU
      ::cudaSetDevice(1);
      ::cudaMalloc(&other, 8);
      ::cudaSetDevice(0);
      try {
        c->send(other, 8, 1);
        ADD_FAILURE() << "another GPU's buffer was accepted";
      } catch (const SpecError& e) {
        EXPECT_HAS(e.what(), "is memory of cuda:1; the nccl backend needs device memory of cuda:0");
      }
      ::cudaFree(other);
    }
    c->barrier();  // still usable on both ranks
  });
  EXPECT_EQ(errors, (std::vector<std::string>{"", ""}));
  EXPECT_FALSE(store_->check({"comm/default/failure"}));
  EXPECT_EQ(emu_nccl::counters().aborts, 0);
}

TEST_F(NcclEmu, BufferCopiesAreBounded) {
  auto cs = makeAll(2);
  auto b = cs[0]->allocate(8);
  char host[16] = {};
  EXPECT_THROW(b->upload(host, 16), SpecError);
  EXPECT_THROW(b->download(host, 9), SpecError);
  b->upload(host, 8);
  b.reset();
  release(cs);
}

TEST_F(NcclEmu, NcclCommBlockingIsRefused) {
  ::setenv("NCCL_COMM_BLOCKING", "1", 1);
  try {
    make(store_, 0, 1);
    ADD_FAILURE();
  } catch (const SpecError& e) {
    EXPECT_HAS(e.what(), "NCCL_COMM_BLOCKING=1 makes NCCL block without a deadline");
  }
  ::unsetenv("NCCL_COMM_BLOCKING");
}

TEST_F(NcclEmu, PeerThatNeverJoinsFailsCreationWithinTheTimeout) {
  CommOptions o;
  o.timeout = std::chrono::milliseconds(300);
  const auto start = Clock::now();
  try {
    make(store_, 0, 3, o);  // ranks 1 and 2 never come
    FAIL();
  } catch (const PeerLostError& e) {
    EXPECT_HAS(e.what(), "ncclCommInitRank on rank 0: not every rank among 0-2 joined within 0.3 s");
  }
  EXPECT_LT(Clock::now() - start, std::chrono::seconds(3));
  EXPECT_EQ(emu_nccl::counters().aborts, 1);
}

TEST_F(NcclEmu, LostPeerFailsTheOperationNamingItAndThePeersSeeTheFirstFailure) {
  CommOptions o;
  o.timeout = std::chrono::milliseconds(300);
  auto cs = makeAll(2, o);
  auto buf = cs[0]->allocate(4);
  const auto start = Clock::now();
  try {
    cs[0]->allreduce(buf->data(), 1, DataType::kFloat32, ReduceOp::kSum);  // rank 1 never issues it
    FAIL();
  } catch (const PeerLostError& e) {
    EXPECT_HAS(e.what(),
               "allreduce on rank 0: did not finish within 0.3 s; a peer among ranks 0-1 is lost or "
               "stopped; the NCCL communicator was aborted");
  }
  const auto took = Clock::now() - start;
  EXPECT_GE(took, std::chrono::milliseconds(300));
  EXPECT_LT(took, std::chrono::seconds(3));
  try {
    cs[0]->barrier();
    FAIL();
  } catch (const PeerLostError& e) {
    EXPECT_HAS(e.what(), "aborted earlier: allreduce on rank 0: did not finish");
  }
  // Rank 1 waits on a broadcast rank 0 will never join: its error carries rank 0's.
  auto b1 = cs[1]->allocate(4);
  try {
    cs[1]->broadcast(b1->data(), 1, DataType::kFloat32, 0);
    FAIL();
  } catch (const PeerLostError& e) {
    EXPECT_HAS(e.what(), "broadcast on rank 1: did not finish within 0.3 s");
    EXPECT_HAS(e.what(), "[first failure in this job: allreduce on rank 0: did not finish");
  }
  buf.reset();
  b1.reset();
  cs.clear();
  const auto n = emu_nccl::counters();
  EXPECT_EQ(n.aborts, 2);
  EXPECT_EQ(n.hungDestroys, 0);
}

// test() polls like wait(): a loop over test() ends at the deadline too (it used to spin for
// ever on a lost peer), and wait() then throws.
TEST_F(NcclEmu, TestReportsATimedOutOperationAsDone) {
  CommOptions o;
  o.timeout = std::chrono::milliseconds(200);
  auto cs = makeAll(2, o);
  auto buf = cs[0]->allocate(4);
  auto w = cs[0]->allreduceAsync(buf->data(), 1, DataType::kFloat32, ReduceOp::kSum);
  const auto start = Clock::now();
  while (!w->test()) {
    ASSERT_LT(Clock::now() - start, std::chrono::seconds(5)) << "test() never reported the lost peer";
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  EXPECT_THROW(w->wait(), PeerLostError);
  EXPECT_THROW(w->wait(), PeerLostError);  // again: the same error, not a success
}

// An error NCCL reports asynchronously aborts the communicator; works waited on by other
// threads fail too instead of polling the freed communicator (the emulation counts any call
// on it; TearDown checks none happened).
TEST_F(NcclEmu, AsyncErrorFailsEveryWaiterWithoutTouchingTheAbortedCommunicator) {
  auto cs = makeAll(2);
  auto b1 = cs[0]->allocate(4), b2 = cs[0]->allocate(4);
  auto w1 = cs[0]->allreduceAsync(b1->data(), 1, DataType::kFloat32, ReduceOp::kSum);
  auto w2 = cs[0]->allreduceAsync(b2->data(), 1, DataType::kFloat32, ReduceOp::kSum);
  std::vector<std::string> errors(2);
  std::vector<std::thread> waiters;
  for (int i = 0; i < 2; ++i)
    waiters.emplace_back([&, i] {
      try {
        (i == 0 ? w1 : w2)->wait();
      } catch (const PeerLostError& e) {
        errors[static_cast<size_t>(i)] = e.what();
      }
    });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  emu_nccl::setAsyncError(0, ncclRemoteError);
  for (auto& t : waiters) t.join();
  // One waiter saw NCCL's report and aborted; the other found the communicator aborted (its
  // event completed when the aborted kernels left: no success over data that is not the result).
  const std::string reported = "NCCL reported: remote process exited or there was a network error";
  const std::string found = "the NCCL communicator was aborted: allreduce on rank 0: " + reported;
  const bool firstReported = errors[0].find("was aborted: ") == std::string::npos;
  EXPECT_HAS(errors[firstReported ? 0 : 1], reported);
  EXPECT_HAS(errors[firstReported ? 1 : 0], found);
  EXPECT_EQ(emu_nccl::counters().aborts, 1);
}

TEST_F(NcclEmu, FailedEnqueueBreaksTheCommunicatorAndLeavesTheFailureForPeers) {
  auto cs = makeAll(2);
  auto b = cs[1]->allocate(8);
  emu_nccl::failNextEnqueue(1, ncclSystemError);
  emu_nccl::setLastError("socketProgress: Connection closed by remote peer\n");
  try {
    cs[1]->send(b->data(), 8, 0);
    FAIL();
  } catch (const PeerLostError& e) {
    // NCCL's own reason joins its error class, on one line.
    EXPECT_HAS(e.what(),
               "send on rank 1: NCCL error: unhandled system error (run with NCCL_DEBUG=INFO for details) [NCCL's last warning: "
               "socketProgress: Connection closed by remote peer]; the NCCL communicator was aborted");
  }
  EXPECT_THROW(cs[1]->send(b->data(), 8, 0), PeerLostError);
  EXPECT_HAS(store_->get("comm/default/failure"), "send on rank 1: NCCL error: unhandled system error");
  EXPECT_EQ(emu_nccl::counters().aborts, 1);
  b.reset();
  release(cs);
}

// A lazy connect that never finishes (a peer gone between creation and the first operation)
// fails the enqueue at the deadline; before, ncclCommInitRank-style blocking hung here with
// the communicator's lock held, so nothing could abort it.
TEST_F(NcclEmu, ConnectThatNeverFinishesFailsAtTheDeadline) {
  CommOptions o;
  o.timeout = std::chrono::milliseconds(300);
  auto cs = makeAll(2, o);
  emu_nccl::hangConnect(0);
  auto b = cs[0]->allocate(4);
  const auto start = Clock::now();
  try {
    cs[0]->barrier();
    FAIL();
  } catch (const PeerLostError& e) {
    EXPECT_HAS(e.what(), "barrier on rank 0: could not reach its peers among ranks 0-1 within 0.3 s");
  }
  EXPECT_LT(Clock::now() - start, std::chrono::seconds(3));
  EXPECT_EQ(emu_nccl::counters().aborts, 1);
}

// Destroying a communicator with operations outstanding waits for them, for ever when the
// peer is gone (or when the destructor runs because an operation failed): it is aborted.
TEST_F(NcclEmu, CommunicatorWithWorkOutstandingIsAbortedNotDestroyed) {
  auto cs = makeAll(2);
  {
    auto b = cs[0]->allocate(4);
    auto w = cs[0]->allreduceAsync(b->data(), 1, DataType::kFloat32, ReduceOp::kSum);
    cs[0].reset();  // the work still holds the state; dropping it releases the communicator
  }
  auto n = emu_nccl::counters();
  EXPECT_EQ(n.hungDestroys, 0);
  EXPECT_EQ(n.aborts, 1);
  cs[1].reset();  // nothing outstanding: a clean destroy
  n = emu_nccl::counters();
  EXPECT_EQ(n.destroys, 1);
  EXPECT_EQ(n.hungDestroys, 0);
}

// A finalize that does not end (NCCL's proxy waiting for a peer) is bounded: the communicator
// is aborted instead of destroyed.
TEST_F(NcclEmu, FinalizeThatNeverEndsIsAborted) {
  CommOptions o;
  o.timeout = std::chrono::milliseconds(300);
  emu_nccl::hangFinalize(0);
  const auto start = Clock::now();
  ranks(2, [&](int r) { make(store_, r, 2, o)->barrier(); });  // made, used, released
  EXPECT_LT(Clock::now() - start, std::chrono::seconds(3));
  const auto n = emu_nccl::counters();
  EXPECT_EQ(n.aborts, 1);
  EXPECT_EQ(n.destroys, 1);
}

// ncclCommDestroy waits for the host's other ranks to close theirs: a rank releasing its
// communicator while a peer keeps its own waits for it only so long, then aborts; the peer,
// releasing later, finds it gone and destroys.
TEST_F(NcclEmu, ReleasingBeforeAPeerAbortsAfterABoundedWait) {
  CommOptions o;
  o.timeout = std::chrono::milliseconds(300);
  auto cs = makeAll(2, o);
  const auto start = Clock::now();
  cs[0].reset();
  const auto took = Clock::now() - start;
  EXPECT_GE(took, std::chrono::milliseconds(300));
  EXPECT_LT(took, std::chrono::seconds(3));
  EXPECT_EQ(emu_nccl::counters().aborts, 1);
  cs[1].reset();
  EXPECT_EQ(emu_nccl::counters().destroys, 1);
}

// Groups run on their parent's GPU (the emulation refuses a buffer of another device, as a
// real GPU would fault), and their errors name job ranks.
TEST_F(NcclEmu, GroupsUseTheParentsDeviceAndNameJobRanks) {
  CommOptions o;
  o.timeout = std::chrono::milliseconds(300);
  auto errors = ranks(4, [&](int r) {
    auto c = make(store_, r, 4, o);  // rank r on GPU r (no LOCAL_RANK)
    const std::vector<int> members = r % 2 == 0 ? std::vector<int>{0, 2} : std::vector<int>{1, 3};
    auto g = c->group(members, r % 2 == 0 ? "even" : "odd");
    auto out = run<float>(
        *g, {float(r)}, [&](void* d) { g->allreduce(d, 1, DataType::kFloat32, ReduceOp::kSum); }, 1);
    ASSERT_EQ(out[0], r % 2 == 0 ? 2.0f : 4.0f);
    if (r == 2) {
      auto b = g->allocate(4);
      try {
        g->allreduce(b->data(), 1, DataType::kFloat32, ReduceOp::kSum);  // rank 0 does not join
        FAIL();
      } catch (const PeerLostError& e) {
        EXPECT_HAS(e.what(),
                   "allreduce on rank 2 (rank 1 of communicator \"default/even\"): did not finish "
                   "within 0.3 s; a peer among ranks 0, 2 is lost or stopped");
      }
    }
  });
  for (const auto& e : errors) EXPECT_EQ(e, "");
}

TEST_F(NcclEmu, OldNcclRefusesAvgAndBfloat16BeforeEnqueueing) {
  emu_nccl::setVersion(20903);  // NCCL 2.9.3
  auto cs = makeAll(2);
  auto b = cs[0]->allocate(8);
  try {
    cs[0]->allreduce(b->data(), 1, DataType::kFloat32, ReduceOp::kAvg);
    FAIL();
  } catch (const SpecError& e) {
    EXPECT_HAS(e.what(), "reduce op avg needs NCCL 2.10 or newer, and this process loaded NCCL 2.9.3");
  }
  EXPECT_THROW(cs[0]->allreduce(b->data(), 1, DataType::kBFloat16, ReduceOp::kSum), SpecError);
  // Refused before enqueueing: the communicator still works.
  ranks(2, [&](int r) { cs[static_cast<size_t>(r)]->barrier(); });
  EXPECT_EQ(emu_nccl::counters().aborts, 0);
  b.reset();
  release(cs);
  EXPECT_EQ(emu_nccl::counters().destroys, 2);
}

TEST_F(NcclEmu, BadPeerIsASpecErrorThatLeavesTheCommunicatorUsable) {
  auto cs = makeAll(2);
  auto b = cs[0]->allocate(4);
  try {
    cs[0]->send(b->data(), 4, 0);
    FAIL();
  } catch (const SpecError& e) {
    EXPECT_HAS(e.what(), "send peer 0 is not another rank of this communicator (size 2)");
  }
  EXPECT_THROW(cs[0]->broadcast(b->data(), 1, DataType::kFloat32, 2), SpecError);
  auto errors = ranks(2, [&](int r) { cs[static_cast<size_t>(r)]->barrier(); });
  EXPECT_EQ(errors, (std::vector<std::string>{"", ""}));
  b.reset();
  release(cs);
}

}  // namespace
}  // namespace dtrain::comm
