#include "dtrain/spec/metrics_file.h"

#include <cmath>
#include <sstream>

#include <gtest/gtest.h>

namespace dtrain::spec {
namespace {

MetricsCurve readText(const std::string& text, const std::string& runId) {
  std::istringstream in(text);
  return readMetricsRun(in, runId);
}

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
