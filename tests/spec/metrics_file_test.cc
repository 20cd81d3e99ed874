#include "dtrain/spec/metrics_file.h"

#include <cmath>
#include <utility>
#include <vector>
#include <sstream>

#include <gtest/gtest.h>

namespace dtrain::spec {
namespace {

MetricsCurve readText(const std::string& text, const MetricsRun& run) {
  std::istringstream in(text);
  return readMetricsRun(in, run);
}

MetricsCurve readText(const std::string& text, const std::string& runId) { return readText(text, MetricsRun{runId}); }

MetricsPoint at(long long step, double loss) {
  MetricsPoint p;
  p.step = step;
  p.loss = loss;
  p.accuracy = 0.5;
  return p;
}

TEST(MetricsFile, OneRunsCurveAcrossItsRestarts) {
  const MetricsRun a0{"run-a", 0, 4, 0}, a1{"run-a", 1, 2, 20}, other{"run-b", 0, 4, 0};
  std::string text = metricsStartLine(other, "t") + metricsTrainLine(other, at(10, 9.0));
  text += metricsStartLine(a0, "t");
  for (long long s = 10; s <= 30; s += 10) text += metricsTrainLine(a0, at(s, 1.0));
  text += "{\"type\": \"train\", \"run_id\": \"run-a\", \"att";  // torn by a kill
  text += "\n" + metricsStartLine(a1, "t");                    // resumed from step 20
  for (long long s = 30; s <= 40; s += 10) text += metricsTrainLine(a1, at(s, 2.0));
  text += metricsEvalLine(a1, 40, 0.3, 0.9);
  const MetricsCurve c = readText(text, "run-a");
  ASSERT_EQ(c.points.size(), 4u);
  const long long steps[] = {10, 20, 30, 40};
  const double losses[] = {1.0, 1.0, 2.0, 2.0};  // attempt 0's step 30 was redone by attempt 1
  for (size_t i = 0; i < 4; ++i) {
    EXPECT_EQ(c.points[i].step, steps[i]);
    EXPECT_EQ(c.points[i].loss, losses[i]);
  }
  EXPECT_DOUBLE_EQ(c.eval_accuracy, 0.9);
  EXPECT_EQ(readText(text, "run-b").points.size(), 1u);
  EXPECT_EQ(readText(text, "run-b").eval_accuracy, -1);
}

// A run that resumed from the checkpoints of earlier runs of its log_dir (a job stopped and
// run again, maybe at another world size) draws the whole training: the earlier runs' rows
// up to the step it resumed from, then its own; runs of other checkpoint directories or
// configs, and runs without a checkpoint directory, are not part of it.
TEST(MetricsFile, ATrainingsCurveSpansTheRunsThatResumedFromItsCheckpoints) {
  auto run = [](const char* id, int attempt, long long start, const char* dir, const char* hash) {
    return MetricsRun{id, attempt, 2, start, dir, hash};
  };
  const MetricsRun a = run("run-a", 0, 0, "/ck", "h1"), b = run("run-b", 0, 0, "/other", "h1"),
                   c0 = run("run-c", 0, 40, "/ck", "h1"), c1 = run("run-c", 1, 60, "/ck", "h1"),
                   d = run("run-d", 0, 0, "/ck", "h2"), e = run("run-e", 0, 0, "", "h1");
  std::string text = metricsStartLine(a, "t");
  for (long long s = 10; s <= 50; s += 10) text += metricsTrainLine(a, at(s, 1.0));  // stopped after 50, checkpoint at 40
  text += metricsEvalLine(a, 50, 0.5, 0.5);
  text += metricsStartLine(b, "t") + metricsTrainLine(b, at(10, 9.0)) + metricsStartLine(e, "t") +
          metricsTrainLine(e, at(10, 8.0));
  text += metricsStartLine(c0, "t");  // resumed from step 40 (step 50 replayed)
  for (long long s = 45; s <= 70; s += 5) text += metricsTrainLine(c0, at(s, 2.0));
  text += metricsStartLine(c1, "t");  // restarted from step 60
  for (long long s = 65; s <= 80; s += 5) text += metricsTrainLine(c1, at(s, 3.0));
  text += metricsTrainLine(c1, at(80, 4.0));  // the same step again: the later row wins
  text += metricsStartLine(d, "t") + metricsTrainLine(d, at(10, 7.0));  // another config on /ck
  const MetricsCurve curve = readText(text, c1);
  std::vector<std::pair<long long, double>> got;
  for (const auto& p : curve.points) got.emplace_back(p.step, p.loss);
  EXPECT_EQ(got, (std::vector<std::pair<long long, double>>{
                     {10, 1}, {20, 1}, {30, 1}, {40, 1}, {45, 2}, {50, 2}, {55, 2}, {60, 2}, {65, 3}, {70, 3}, {75, 3}, {80, 4}}));
  EXPECT_EQ(curve.eval_accuracy, -1) << "run-a's evaluation is not the end of this training";
  // A training begun afresh in the same directory (its checkpoints removed) starts over.
  const MetricsRun f = run("run-f", 0, 0, "/ck", "h1");
  const MetricsCurve fresh = readText(text + metricsStartLine(f, "t") + metricsTrainLine(f, at(10, 5.0)), f);
  ASSERT_EQ(fresh.points.size(), 1u);
  EXPECT_EQ(fresh.points[0].loss, 5.0);
  // Without a checkpoint directory a run is its own training.
  ASSERT_EQ(readText(text, e).points.size(), 1u);
  EXPECT_EQ(readText(text, e).points[0].loss, 8.0);
  ASSERT_EQ(readText(text, d).points.size(), 1u);
  // The start row names the training.
  EXPECT_NE(metricsStartLine(a, "t").find("\"checkpoint_dir\": \"/ck\", \"config_hash\": \"h1\""), std::string::npos)
      << metricsStartLine(a, "t");
  EXPECT_NE(metricsStartLine(e, "t").find("\"checkpoint_dir\": null"), std::string::npos) << metricsStartLine(e, "t");
}

TEST(MetricsFile, NonFiniteIsNullAndReadsBackAsNan) {
  const MetricsRun r{"x\"y", 0, 1, 0};  // an id that needs escaping stays one JSON string
  const std::string line = metricsTrainLine(r, at(1, INFINITY));
  EXPECT_NE(line.find("\"loss\": null"), std::string::npos) << line;
  EXPECT_NE(line.find("\"run_id\": \"x\\\"y\""), std::string::npos) << line;
  const MetricsCurve c = readText(line, "x\"y");
  ASSERT_EQ(c.points.size(), 1u);
  EXPECT_TRUE(std::isnan(c.points[0].loss));
}

}  // namespace
}  // namespace dtrain::spec
