// The rules a multi-node job's events follow (docs/elastic.md, "Events", "Who is blamed").
// tests/e2e/elastic_events.sh drives them through the real binary.
#include <gtest/gtest.h>

#include "dtrain/launch/job.h"
#include "dtrain/launch/multi_node.h"

namespace dtrain::launch {
namespace {

using namespace std::chrono_literals;

// Restart n waits base x 2^(n-1), at most the cap, for any n: restart 1025 of a job without
// back-off waited the 60 s cap (0 x 2^1024 is NaN, which std::min took for the cap).
TEST(RestartBackoff, DoublesToTheCapAndStaysZeroWithoutABase) {
  EXPECT_EQ(restartBackoffS(1.0, 0, 60.0), 1.0);
  EXPECT_EQ(restartBackoffS(1.0, 3, 60.0), 8.0);
  EXPECT_EQ(restartBackoffS(1.0, 6, 60.0), 60.0);
  EXPECT_EQ(restartBackoffS(0.5, 2000, 60.0), 60.0);
  EXPECT_EQ(restartBackoffS(0.25, 1, 300.0), 0.5);
  for (int n : {0, 1, 1023, 1024, 1025, 100000}) EXPECT_EQ(restartBackoffS(0.0, n, 60.0), 0.0) << n;
  EXPECT_EQ(restartBackoffS(2.0, -1, 60.0), 2.0);  // (a first attempt's "restart 0")
}

// Round 0 forming, round 3 running, a restart announced (its event says round 4), round 4
// forming: what an event says at each point, e.g. a lost host's retry that fails.
TEST(MultinodeEvents, RoundIsTheOneThatRunsOrFormsThenTheOneAnnounced) {
  EXPECT_EQ(detail::eventRound(0, false), 0);  // startup: round 0, never -1
  EXPECT_EQ(detail::eventRound(3, false), 3);  // round 3 runs
  EXPECT_EQ(detail::eventRound(3, true), 4);   // "restart (round 4)" announced: no event says 3 after it
  EXPECT_EQ(detail::eventRound(4, false), 4);  // round 4 opened, forming
}

TEST(MultinodeEvents, HeldFailureJudgedWhenEveryNodeReportedOrTheHoldIsOver) {
  const auto t0 = std::chrono::steady_clock::time_point{} + 100s;
  EXPECT_FALSE(detail::heldFailureDue(t0, t0, false));
  EXPECT_FALSE(detail::heldFailureDue(t0, t0 + detail::kCollateralHold - 1ms, false));  // a node not heard from yet
  EXPECT_TRUE(detail::heldFailureDue(t0, t0 + 5ms, true));  // every node said its workers ended: no loss is coming
  EXPECT_TRUE(detail::heldFailureDue(t0, t0 + detail::kCollateralHold, false));  // bounded
  // Small: the default restart back-off (1 s), which counts from the failure, covers it.
  EXPECT_LE(detail::kCollateralHold, 1s);
}

}  // namespace
}  // namespace dtrain::launch
