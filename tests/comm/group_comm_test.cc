// Communicator::sendRecv and Communicator::group on the tcp backend (shm on and off).
#include <gtest/gtest.h>

#include <cstring>
#include <functional>
#include <thread>

#include <fmt/format.h>

#include "dtrain/comm/communicator.h"
#include "dtrain/common/errors.h"
#include "comm_test_util.h"

namespace dtrain::comm {
namespace {

CommOptions options(bool shm) {
  CommOptions o;
  o.shm = shm;
  o.timeout = std::chrono::seconds(30);
  return o;
}

std::vector<std::string> onRanks(int n, const std::function<void(Communicator&)>& fn, CommOptions o) {
  return testing::runRanks(n, fn, o);
}

void expectNoErrors(const std::vector<std::string>& errors) {
  for (size_t r = 0; r < errors.size(); ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
}

uint8_t pattern(int from, size_t i) { return static_cast<uint8_t>(from * 37 + i * 11 + (i >> 9)); }

// Every rank sends 24 MiB to its right neighbour while receiving 24 MiB from its left one, in
// one operation. Send-then-recv on every rank would block with full socket buffers; so
// would the naive order with a single peer (n = 2: both directions on one socket).
// Over TCP and over the per-pair shared-memory channels (1 MiB each, far less than 24 MiB).
TEST(CommSendRecv, RingExchangeOfLargeBuffersDoesNotDeadlock) {
  const size_t bytes = 24u << 20;
  for (bool shm : {false, true}) {
    for (int n : {2, 3}) {
      expectNoErrors(onRanks(n, [&](Communicator& c) {
        EXPECT_STREQ(c.p2pTransport(), shm ? "shm" : "tcp");
        const int right = (c.rank() + 1) % n, left = (c.rank() + n - 1) % n;
        std::vector<uint8_t> out(bytes), in(bytes, 0);
        for (size_t i = 0; i < bytes; ++i) out[i] = pattern(c.rank(), i);
        c.sendRecv(out.data(), bytes, right, in.data(), bytes, left);
        for (size_t i = 0; i < bytes; ++i)
          if (in[i] != pattern(left, i)) FAIL() << "rank " << c.rank() << " byte " << i << " wrong";
      }, options(shm)));
    }
  }
}

// The two halves match plain send and recv on the other side, with different sizes each
// way, including zero bytes.
void checkPlainSendAndRecv(bool shm) {
  expectNoErrors(onRanks(3, [&](Communicator& c) {
    EXPECT_STREQ(c.p2pTransport(), shm ? "shm" : "tcp");
    // 0 -> 1 -> 2 chain: rank 1 forwards with sendRecv while 0 sends and 2 receives.
    std::vector<int32_t> a(1000), b(7);
    if (c.rank() == 0) {
      for (size_t i = 0; i < a.size(); ++i) a[i] = static_cast<int32_t>(i * 3);
      c.send(a.data(), a.size() * 4, 1);
      c.recv(b.data(), b.size() * 4, 1);
      for (size_t i = 0; i < b.size(); ++i) EXPECT_EQ(b[i], static_cast<int32_t>(100 + i));
    } else if (c.rank() == 1) {
      // Receives 0's 4000 bytes while sending 0 bytes to 2; then sends 7 ints back to 0
      // while receiving 2's 4000 bytes.
      c.sendRecv(nullptr, 0, 2, a.data(), a.size() * 4, 0);
      std::vector<int32_t> back(a.size());
      for (size_t i = 0; i < b.size(); ++i) b[i] = static_cast<int32_t>(100 + i);
      c.sendRecv(b.data(), b.size() * 4, 0, back.data(), back.size() * 4, 2);
      for (size_t i = 0; i < back.size(); ++i) EXPECT_EQ(back[i], static_cast<int32_t>(i * 3 + 1));
    } else {
      c.recv(nullptr, 0, 1);
      for (size_t i = 0; i < a.size(); ++i) a[i] = static_cast<int32_t>(i * 3 + 1);
      c.send(a.data(), a.size() * 4, 1);
    }
  }, options(shm)));
}
TEST(CommSendRecv, MatchesPlainSendAndRecvAndUnequalSizes) {
  checkPlainSendAndRecv(false);
  checkPlainSendAndRecv(true);
}

void checkSizeMismatch(bool shm) {
  auto errors = onRanks(2, [&](Communicator& c) {
    EXPECT_STREQ(c.p2pTransport(), shm ? "shm" : "tcp");
    std::vector<char> buf(64);
    if (c.rank() == 0) {
      EXPECT_THROW(c.sendRecvAsync(buf.data(), 8, 0, buf.data(), 8, 1), SpecError);  // to itself
      EXPECT_THROW(c.sendRecvAsync(buf.data(), 8, 1, buf.data(), 8, 2), SpecError);  // no rank 2
      c.sendRecv(buf.data(), 16, 1, buf.data(), 16, 1);
    } else {
      c.sendRecv(buf.data(), 16, 0, buf.data(), 32, 0);
    }
  }, options(shm));
  // Rank 0 got what it expected (header and payload travel together, so it may finish
  // before rank 1 gives up); if not, it names rank 1's failure.
  if (!errors[0].empty())
    EXPECT_NE(errors[0].find("[first failure in this job: sendrecv from rank 0"), std::string::npos) << errors[0];
  EXPECT_NE(errors[1].find("sendrecv from rank 0: expected 32 bytes, the peer sent 16"), std::string::npos) << errors[1];
}
TEST(CommSendRecv, SizeMismatchFailsNamingThePeerAndBadPeersAreSpecErrors) {
  checkSizeMismatch(false);
  checkSizeMismatch(true);
}

// 6 ranks as 2 replicas x 3 stages (rank = d * 3 + p): a group per stage ({p, p + 3}) and one
// per replica ({3d .. 3d + 2}), as the pipeline trainer builds them. Sums within each group
// show the membership and rank order; a parent collective in between shows both stay usable.
void checkGroups(bool shm) {
  const int P = 3, D = 2;
  expectNoErrors(onRanks(P * D, [&](Communicator& c) {
    const int p = c.rank() % P, d = c.rank() / P;
    std::vector<int> stageRanks, pipeRanks;
    for (int r = 0; r < D; ++r) stageRanks.push_back(r * P + p);
    for (int s = 0; s < P; ++s) pipeRanks.push_back(d * P + s);
    auto stage = c.group(stageRanks, "stage" + std::to_string(p));
    auto pipe = c.group(pipeRanks, "pipe" + std::to_string(d));
    EXPECT_EQ(stage->size(), D);
    EXPECT_EQ(stage->rank(), d);
    EXPECT_EQ(pipe->size(), P);
    EXPECT_EQ(pipe->rank(), p);
    EXPECT_STREQ(stage->backend(), "tcp");
    // Large enough for the ring (and the shm path) as well as a small one.
    for (size_t count : {size_t{3}, size_t{300000}}) {
      std::vector<int64_t> v(count, c.rank() + 1);
      stage->allreduce(v.data(), count, DataType::kInt64, ReduceOp::kSum);
      int64_t expect = 0;
      for (int r : stageRanks) expect += r + 1;
      EXPECT_EQ(v[0], expect);
      EXPECT_EQ(v[count - 1], expect);
      std::vector<int64_t> w(count, c.rank() + 1);
      c.allreduce(w.data(), count, DataType::kInt64, ReduceOp::kSum);
      EXPECT_EQ(w[count - 1], P * D * (P * D + 1) / 2);
      std::fill(w.begin(), w.end(), c.rank() + 1);
      pipe->allreduce(w.data(), count, DataType::kInt64, ReduceOp::kMax);
      EXPECT_EQ(w[0], d * P + P);
    }
    // Point to point by group rank: stage s sends to stage s + 1 of its replica.
    int32_t token = 1000 + c.rank(), got = -1;
    if (p + 1 < P) pipe->send(&token, 4, p + 1);
    if (p > 0) {
      pipe->recv(&got, 4, p - 1);
      EXPECT_EQ(got, 1000 + c.rank() - 1);
    }
    // A group's async operation runs on its own executor: it is not ordered behind the
    // parent's, so a parent barrier can be waited for while the stage all-reduce is pending.
    std::vector<float> g(1 << 18, 1.0f);
    auto w = stage->allreduceAsync(g.data(), g.size(), DataType::kFloat32, ReduceOp::kAvg);
    c.barrier();
    w->wait();
    EXPECT_EQ(g[12345], 1.0f);
  }, options(shm)));
}

TEST(CommGroup, StageAndPipelineGroupsOverTcp) { checkGroups(false); }
TEST(CommGroup, StageAndPipelineGroupsOverShm) { checkGroups(true); }

TEST(CommGroup, RankOrderInTheListIsTheGroupRank) {
  expectNoErrors(onRanks(3, [&](Communicator& c) {
    if (c.rank() == 1) return;
    auto g = c.group({2, 0}, "reversed");
    EXPECT_EQ(g->rank(), c.rank() == 2 ? 0 : 1);
    int32_t v = c.rank();
    g->broadcast(&v, 1, DataType::kInt32, 0);
    EXPECT_EQ(v, 2);
  }, options(false)));
}

// A group's failures name the job's ranks, not the group's: in a 2 x 2 layout, group
// {1, 3}'s rank 1 is the job's rank 3, and a user looks for rank 3 (before: "allreduce on
// rank 0: lost rank 1", naming a healthy rank and hiding the stopped one). Rank 3 stalls
// (its group's all-reduce is never issued within the timeout), then leaves.
void checkGroupFailureNamesJobRanks(bool shm) {
  CommOptions o = options(shm);
  o.timeout = std::chrono::milliseconds(1500);  // (the set-ups too: room for a loaded machine)
  auto errors = onRanks(4, [&](Communicator& c) {
    auto g = c.group(c.rank() % 2 ? std::vector<int>{1, 3} : std::vector<int>{0, 2}, c.rank() % 2 ? "odd" : "even");
    std::vector<float> v(300000, 1.0f);
    if (c.rank() == 3) {
      std::this_thread::sleep_for(std::chrono::milliseconds(4500));
      return;
    }
    g->allreduce(v.data(), v.size(), DataType::kFloat32, ReduceOp::kSum);
  }, o);
  EXPECT_EQ(errors[0], "");
  EXPECT_EQ(errors[2], "");
  EXPECT_EQ(errors[3], "");
  EXPECT_EQ(errors[1].rfind("allreduce on rank 1 (rank 0 of communicator \"default/odd\"): lost rank 3: not done within "
                            "the 1.5 s per-operation timeout (", 0), 0u) << errors[1];
  EXPECT_NE(errors[1].find(shm ? "waiting for rank 3 to " : " from rank 3)"), std::string::npos) << errors[1];
  // A lost peer (its sockets closed): the same names.
  errors = onRanks(4, [&](Communicator& c) {
    auto g = c.group(c.rank() < 2 ? std::vector<int>{0, 1} : std::vector<int>{2, 3}, c.rank() < 2 ? "lo" : "hi");
    if (c.rank() == 2) return;  // its communicators close: rank 3's peer is gone
    std::vector<float> v(1000, 1.0f);
    g->allreduce(v.data(), v.size(), DataType::kFloat32, ReduceOp::kSum);
  }, options(shm));
  EXPECT_EQ(errors[3].rfind("allreduce on rank 3 (rank 1 of communicator \"default/hi\"): lost rank 2: ", 0), 0u) << errors[3];
  // The world communicator's messages are as before: "on rank N".
  errors = onRanks(2, [&](Communicator& c) {
    if (c.rank() == 1) return;
    int32_t x = 0;
    c.recv(&x, 4, 1);
  }, o);
  EXPECT_EQ(errors[0].rfind("recv on rank 0: lost rank 1: ", 0), 0u) << errors[0];
}

TEST(CommGroup, FailuresNameTheJobsRanksOverTcp) { checkGroupFailureNamesJobRanks(false); }
TEST(CommGroup, FailuresNameTheJobsRanksOverShm) { checkGroupFailureNamesJobRanks(true); }

TEST(CommGroup, MalformedListsAreSpecErrors) {
  expectNoErrors(onRanks(2, [&](Communicator& c) {
    auto expectSpec = [&](const std::vector<int>& ranks, const std::string& name, const std::string& part) {
      try {
        c.group(ranks, name);
        ADD_FAILURE() << "no error for " << name;
      } catch (const SpecError& e) {
        EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
      }
    };
    expectSpec({0, 1, 1}, "dup", "rank 1 is listed twice");
    expectSpec({0, 2}, "range", "rank 2 is not a rank of the parent communicator (size 2)");
    expectSpec({1 - c.rank()}, "other", fmt::format("rank {} is not in it", c.rank()));
    expectSpec({}, "empty", "the rank list is empty");
    expectSpec({0, 1}, "", "the name is empty");
  }, options(false)));
}

TEST(CommGroup, GroupRankValidation) {
  EXPECT_EQ(groupRank({3, 1, 2}, 2, 4, "g"), 2);
  EXPECT_THROW(groupRank({-1}, 0, 4, "g"), SpecError);
}

}  // namespace
}  // namespace dtrain::comm

namespace dtrain::comm {
namespace {

// Every rank offers a backend through one store; returns each rank's result ("!" + the
// error when it threw).
std::vector<std::string> agree(const std::vector<std::pair<std::string, bool>>& offers) {
  auto store = std::make_shared<store::HashStore>();
  store->setTimeout(std::chrono::seconds(10));
  std::vector<std::string> out(offers.size());
  std::vector<std::thread> ts;
  for (size_t r = 0; r < offers.size(); ++r)
    ts.emplace_back([&, r] {
      CommOptions o;
      o.backend = offers[r].first;
      o.tcp_fallback = offers[r].second;
      try {
        out[r] = agreeOnBackend(*store, static_cast<int>(r), static_cast<int>(offers.size()), o);
      } catch (const SpecError& e) {
        out[r] = std::string("!") + e.what();
      }
    });
  for (auto& t : ts) t.join();
  return out;
}

// A rank that never comes to the set-up (not started, or failed before it) is named on every
// rank that waited for it, not the store key they waited on.
TEST(BackendAgreement, ARankThatNeverComesIsNamed) {
  auto store = std::make_shared<store::HashStore>();
  store->setTimeout(std::chrono::milliseconds(300));
  std::vector<std::string> out(2);
  std::vector<std::thread> ts;
  for (int r = 0; r < 2; ++r)  // (rank 2 of 3 never comes)
    ts.emplace_back([&, r] {
      try {
        agreeOnBackend(*store, r, 3, CommOptions{});
      } catch (const PeerLostError& e) {
        out[static_cast<size_t>(r)] = e.what();
      }
    });
  for (auto& t : ts) t.join();
  for (int r = 0; r < 2; ++r)
    EXPECT_EQ(out[static_cast<size_t>(r)].rfind(fmt::format("communicator \"default\" set-up on rank {}: lost rank 2: "
                                                             "rank 2 did not join (not started, or failed before it): ",
                                                             r),
                                                 0),
              0u)
        << out[static_cast<size_t>(r)];
}

TEST(BackendAgreement, SameOffersKeepTheirBackend) {
  EXPECT_EQ(agree({{"nccl", false}, {"nccl", false}, {"nccl", true}}), (std::vector<std::string>(3, "nccl")));
  EXPECT_EQ(agree({{"tcp", false}, {"tcp", true}}), (std::vector<std::string>(2, "tcp")));
  EXPECT_EQ(agree({{"nccl", false}}), (std::vector<std::string>{"nccl"}));
}

// trainer.device "auto" on a cluster where some hosts have no GPU: all fall back to TCP.
TEST(BackendAgreement, NcclRanksThatAcceptTcpFallBackWhenSomeCannot) {
  EXPECT_EQ(agree({{"nccl", true}, {"tcp", true}, {"nccl", true}, {"tcp", false}}), (std::vector<std::string>(4, "tcp")));
}

// Otherwise they would wait for each other until the timeout: a clear error on every rank.
TEST(BackendAgreement, MixedOffersWithoutFallbackFailEveryRankAtOnce) {
  const auto out = agree({{"nccl", false}, {"nccl", false}, {"tcp", false}, {"nccl", true}, {"tcp", false}});
  for (size_t r = 0; r < out.size(); ++r) {
    EXPECT_EQ(out[r].rfind("!communicator \"default\": the ranks ask for different backends (ranks 0-1, 3 \"nccl\"; "
                           "ranks 2, 4 \"tcp\")", 0), 0u)
        << "rank " << r << ": " << out[r];
  }
}

}  // namespace
}  // namespace dtrain::comm
