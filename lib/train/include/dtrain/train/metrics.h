#pragma once
// Rank 0's training metrics: one JSON object per line in <dir>/metrics.jsonl as training
// goes, and <dir>/metrics.svg (loss and accuracy curves) at the end.
#include <cstdio>
#include <string>
#include <vector>

namespace dtrain::train {

struct MetricsPoint {
  long long step = 0;
  int epoch = 0;
  double loss = 0, accuracy = 0, samples_per_s = 0, lr = 0, elapsed_s = 0;
};

class MetricsLog {
 public:
  explicit MetricsLog(const std::string& dir);  // "" = disabled
  ~MetricsLog();
  MetricsLog(const MetricsLog&) = delete;
  MetricsLog& operator=(const MetricsLog&) = delete;

  void record(const MetricsPoint& p);
  void recordEval(long long step, double loss, double accuracy);
  // Writes the SVG. Safe to call once at the end.
  void finish();

 private:
  std::string dir_;
  std::FILE* f_ = nullptr;
  std::vector<MetricsPoint> points_;
  double evalAccuracy_ = -1;
};

// Standalone SVG of the loss (left axis) and accuracy (right axis, 0..1) per step.
std::string metricsSvg(const std::vector<MetricsPoint>& points, double evalAccuracy);

}  // namespace dtrain::train
