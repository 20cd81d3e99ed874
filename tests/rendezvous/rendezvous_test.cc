#include "dtrain/rendezvous/rendezvous.h"

#include <gtest/gtest.h>

#include <utility>

#include <chrono>
#include <set>
#include <thread>

#include "dtrain/common/errors.h"
#include "dtrain/store/hash_store.h"
#include "dtrain/store/tcp_store.h"

namespace dtrain::rendezvous {
namespace {

using namespace std::chrono_literals;

RendezvousOptions opts(int minN, int maxN) {
  RendezvousOptions o;
  o.run_id = "job";
  o.min_nodes = minN;
  o.max_nodes = maxN;
  o.join_timeout = 10s;
  o.last_call = 200ms;
  return o;
}

// Runs n agents concurrently, each with the store makeStore() gives it.
template <typename MakeStore>
std::vector<RoundResult> joinAll(int n, RendezvousOptions o, MakeStore makeStore, std::function<NodeInfo(int)> info) {
  std::vector<RoundResult> results(static_cast<size_t>(n));
  std::vector<std::thread> ts;
  std::vector<std::string> errors(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i)
    ts.emplace_back([&, i] {
      try {
        Rendezvous r(makeStore(), o, info(i));
        results[static_cast<size_t>(i)] = r.join();
      } catch (const std::exception& e) {
        errors[static_cast<size_t>(i)] = e.what();
      }
    });
  for (auto& t : ts) t.join();
  for (const auto& e : errors) EXPECT_EQ(e, "");
  return results;
}

void expectConsistent(const std::vector<RoundResult>& rs, int nnodes, int worldSize) {
  std::set<int> nodeRanks, offsets;
  for (const auto& r : rs) {
    EXPECT_EQ(r.nnodes, nnodes);
    EXPECT_EQ(r.world_size, worldSize);
    EXPECT_EQ(r.nodes.size(), static_cast<size_t>(nnodes));
    nodeRanks.insert(r.node_rank);
    offsets.insert(r.rank_offset);
    int off = 0;
    for (int i = 0; i < r.node_rank; ++i) off += r.nodes[static_cast<size_t>(i)].nproc;
    EXPECT_EQ(r.rank_offset, off);
    for (size_t i = 0; i < r.nodes.size(); ++i) EXPECT_EQ(r.nodes[i].name, rs[0].nodes[i].name);
  }
  EXPECT_EQ(nodeRanks.size(), static_cast<size_t>(nnodes));
  EXPECT_EQ(offsets.size(), static_cast<size_t>(nnodes));
}

TEST(Rendezvous, SixtyFourAgentsOverHashStore) {
  auto store = std::make_shared<store::HashStore>();
  auto start = std::chrono::steady_clock::now();
  auto rs = joinAll(64, opts(64, 64), [&] { return store; }, [](int i) { return NodeInfo{"n" + std::to_string(i), 1 + i % 3, -1}; });
  EXPECT_LT(std::chrono::steady_clock::now() - start, 1s);
  int world = 0;
  for (int i = 0; i < 64; ++i) world += 1 + i % 3;
  expectConsistent(rs, 64, world);
}

TEST(Rendezvous, SixtyFourAgentsOverTcpStore) {
  store::TcpStoreServerOptions so;
  so.token = "t";
  store::TcpStoreServer server(so);
  server.start();
  auto make = [&] {
    store::TcpStoreOptions o;
    o.port = server.port();
    o.token = "t";
    return std::make_shared<store::TcpStore>(o);
  };
  auto start = std::chrono::steady_clock::now();
  auto rs = joinAll(64, opts(64, 64), make, [](int i) { return NodeInfo{"host" + std::to_string(i), 2, -1}; });
  EXPECT_LT(std::chrono::steady_clock::now() - start, 1s);
  expectConsistent(rs, 64, 128);
}

TEST(Rendezvous, HostfileOrderDecidesNodeRank) {
  auto store = std::make_shared<store::HashStore>();
  auto rs = joinAll(4, opts(4, 4), [&] { return store; }, [](int i) { return NodeInfo{"h" + std::to_string(i), 1, 3 - i}; });
  for (int i = 0; i < 4; ++i) EXPECT_EQ(rs[static_cast<size_t>(i)].node_rank, 3 - i);
  EXPECT_EQ(rs[0].nodes[0].name, "h3");
}

TEST(Rendezvous, ClosesAfterLastCallWithMinNodes) {
  auto store = std::make_shared<store::HashStore>();
  auto start = std::chrono::steady_clock::now();
  auto rs = joinAll(2, opts(2, 4), [&] { return store; }, [](int i) { return NodeInfo{"n" + std::to_string(i), 1, -1}; });
  auto took = std::chrono::steady_clock::now() - start;
  EXPECT_GE(took, 200ms);
  EXPECT_LT(took, 2s);
  expectConsistent(rs, 2, 2);
}

TEST(Rendezvous, LateNodeWaitsForTheNextRound) {
  auto store = std::make_shared<store::HashStore>();
  auto o = opts(2, 2);
  auto rs = joinAll(2, o, [&] { return store; }, [](int i) { return NodeInfo{"n" + std::to_string(i), 1, -1}; });
  ASSERT_EQ(rs[0].round, 0);
  RoundResult late;
  std::thread lateAgent([&] { late = Rendezvous(store, o, {"late", 1, -1}).join(); });
  std::this_thread::sleep_for(100ms);
  // An elastic restart opens round 1; the late node and one old one form it.
  Rendezvous(store, o, {"n0", 1, -1}).openNextRound(0);
  RoundResult again = Rendezvous(store, o, {"n0", 1, -1}).join();
  lateAgent.join();
  EXPECT_EQ(late.round, 1);
  EXPECT_EQ(again.round, 1);
  EXPECT_EQ(late.nnodes, 2);
}

TEST(Rendezvous, TimeoutSaysWhoArrived) {
  auto store = std::make_shared<store::HashStore>();
  auto o = opts(3, 3);
  o.join_timeout = 300ms;
  o.expected = {"a", "b", "c"};
  try {
    Rendezvous(store, o, {"a", 1, 0}).join();
    FAIL();
  } catch (const TimeoutError& e) {
    EXPECT_STREQ(e.what(), "rendezvous round 0 timed out after 0.3 s: 1 of at least 3 node(s) joined (arrived: a); not joined: b, c");
  }
}

// The launcher's view of a round that does not form (an elastic job's launcher decides at the
// timeout): who has joined so far, and the timeout's words for the job's min_nodes.
TEST(Rendezvous, ArrivedAndTimeoutTextForTheLauncher) {
  auto store = std::make_shared<store::HashStore>();
  auto o = opts(3, 3);
  o.join_timeout = 5s;
  o.should_abort = [n = 0]() mutable { return ++n > 1; };  // (joins, then gives up its wait)
  EXPECT_THROW(Rendezvous(store, o, {"b", 1, 1}).join(), RendezvousAborted);
  Rendezvous launcher(store, opts(1, 1), {"launcher"});
  launcher.expect(0, {"a", "b", "c"});
  EXPECT_EQ(launcher.arrived(0), std::vector<std::string>{"b"});
  EXPECT_TRUE(launcher.arrived(1).empty());
  EXPECT_EQ(launcher.timeoutText(0, 2000ms, 2),
            "rendezvous round 0 timed out after 2 s: 1 of at least 2 node(s) joined (arrived: b); not joined: a, c");
}

// A node the launcher did not name for the open round (an agent of the round before, killed
// but not told yet) takes no place in it: it waits for a round of its own.
TEST(Rendezvous, ANodeNotExpectedTakesNoPlaceInTheRound) {
  auto store = std::make_shared<store::HashStore>();
  Rendezvous launcher(store, opts(1, 1), {"launcher"});
  launcher.expect(0, {"a"});
  auto o = opts(1, 1);
  o.join_timeout = 300ms;
  EXPECT_THROW(Rendezvous(store, o, {"stale", 1, 1}).join(), TimeoutError);
  EXPECT_TRUE(launcher.arrived(0).empty());
  RoundResult r = Rendezvous(store, o, {"a", 1, 0}).join();
  EXPECT_EQ(r.round, 0);
  EXPECT_EQ(r.nnodes, 1);
  EXPECT_EQ(r.nodes[0].name, "a");
}

// Told which round to join (the launcher's "restart ... <round>"), a node joins that one, and
// one that closed without it is waited out, not left for a later round of its own accord: an
// agent starting late must not take a place in a round it was not told of.
TEST(Rendezvous, AToldRoundIsJoinedExactly) {
  auto store = std::make_shared<store::HashStore>();
  Rendezvous launcher(store, opts(1, 1), {"launcher"});
  launcher.openNextRound(0);  // (round 1 open: a first join of round 0 stays there)
  auto o = opts(1, 1);
  o.round = 0;
  RoundResult r0 = Rendezvous(store, o, {"a", 1, 0}).join();
  EXPECT_EQ(r0.round, 0);
  o.round = 1;
  RoundResult r1 = Rendezvous(store, o, {"a", 1, 0}).join();
  EXPECT_EQ(r1.round, 1);
  // Round 1 closed: a node told round 1 waits for the word (here: gives up at its timeout).
  o.join_timeout = 300ms;
  try {
    Rendezvous(store, o, {"b", 1, 1}).join();
    FAIL();
  } catch (const TimeoutError& e) {
    EXPECT_NE(std::string(e.what()).find("rendezvous round 1 timed out"), std::string::npos) << e.what();
  }
  // ... and ends its wait on the word.
  o.join_timeout = 5s;
  bool asked = false;
  o.should_abort = [&] { return std::exchange(asked, true); };
  EXPECT_THROW(Rendezvous(store, o, {"b", 1, 1}).join(), RendezvousAborted);
  EXPECT_EQ(launcher.arrived(1), std::vector<std::string>{"a"});
}

TEST(Rendezvous, BadOptions) {
  auto store = std::make_shared<store::HashStore>();
  EXPECT_THROW(Rendezvous(store, opts(3, 2), {"a", 1, -1}), SpecError);
  EXPECT_THROW(Rendezvous(store, opts(1, 1), {"", 1, -1}), SpecError);
}

TEST(Heartbeat, SilentNodeIsDeclaredDead) {
  auto store = std::make_shared<store::HashStore>();
  HeartbeatMonitor mon(store, "job", 200ms);
  HeartbeatMonitor::beat(*store, "job", "alive");
  HeartbeatMonitor::beat(*store, "job", "silent");
  EXPECT_TRUE(mon.dead({"alive", "silent"}).empty());
  for (int i = 0; i < 6; ++i) {
    std::this_thread::sleep_for(60ms);
    HeartbeatMonitor::beat(*store, "job", "alive");
    auto d = mon.dead({"alive", "silent"});
    if (i >= 4) EXPECT_EQ(d, std::vector<std::string>{"silent"});
    if (i < 2) EXPECT_TRUE(d.empty());
  }
}

}  // namespace
}  // namespace dtrain::rendezvous
