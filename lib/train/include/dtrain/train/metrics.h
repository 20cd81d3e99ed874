#pragma once
// Rank 0's training metrics: one JSON object per line in <dir>/metrics.jsonl as training
// goes (format: dtrain/spec/metrics_file.h), and <dir>/metrics.svg (loss and accuracy
// curves of the whole training: the run across its restarts, and the earlier runs of the log
// directory whose checkpoints it resumed from) at the end.
#include <cstdio>
#include <string>
#include <vector>

#include "dtrain/spec/metrics_file.h"

namespace dtrain::train {

using spec::MetricsPoint;
using spec::MetricsRun;

class MetricsLog {
 public:
  // Appends to <dir>/metrics.jsonl, beginning with this attempt's "start" row; "" = disabled.
  MetricsLog(const std::string& dir, const MetricsRun& run);
  ~MetricsLog();
  MetricsLog(const MetricsLog&) = delete;
  MetricsLog& operator=(const MetricsLog&) = delete;

  void record(const MetricsPoint& p);
  void recordEval(long long step, double loss, double accuracy);
  // Writes the SVG of the whole training (every attempt's and resumed run's rows, redone
  // steps replaced: readMetricsRun). Called at the end; the destructor calls it when nothing
  // did (training stopped by a signal, or failed: a diverged loss, a lost peer), so every run
  // that logged a row leaves its curve.
  void finish();

 private:
  void write(const std::string& line);

  std::string dir_;
  MetricsRun run_;
  std::FILE* f_ = nullptr;
  bool finished_ = false;
};

// Standalone SVG of the loss (left axis) and accuracy (right axis, 0..1) per step.
std::string metricsSvg(const std::vector<MetricsPoint>& points, double evalAccuracy);

}  // namespace dtrain::train
