#pragma once
// The trainer's metrics.jsonl: one JSON object per line, appended by rank 0 as training goes.
// Every row names its run (DTRAIN_RUN_ID) and attempt (the restart count), and each attempt
// begins with a "start" row, so runs and restarts that share a log_dir stay apart.
// JSON stays inside lib/spec; the trainer sees these structs.
#include <istream>
#include <string>
#include <vector>

namespace dtrain::spec {

struct MetricsRun {
  std::string run_id;
  int attempt = 0;          // restarts before this attempt
  int world_size = 1;
  long long start_step = 0; // the step this attempt starts (resumes) from
};

struct MetricsPoint {
  long long step = 0;
  int epoch = 0;
  double loss = 0, accuracy = 0, samples_per_s = 0, lr = 0, elapsed_s = 0;
};

// One line each, newline-terminated. A non-finite number is written as null (a diverged
// loss): "nan" would make the line unreadable to every JSON parser.
std::string metricsStartLine(const MetricsRun& run, const std::string& utcTime);
std::string metricsTrainLine(const MetricsRun& run, const MetricsPoint& p);
std::string metricsEvalLine(const MetricsRun& run, long long step, double loss, double accuracy);

// One run's curve as its attempts left it: the train rows of `runId` in step order, where an
// attempt that resumed from step S replaces the earlier attempts' rows after S (that work
// was redone). evalAccuracy: the run's last eval row, -1 when none. Lines that are not
// JSON objects (a torn last line) or belong to other runs are skipped; read line by line,
// and only the run's own lines are parsed (the file holds every run of its log_dir).
struct MetricsCurve {
  std::vector<MetricsPoint> points;
  double eval_accuracy = -1;
};
MetricsCurve readMetricsRun(std::istream& jsonl, const std::string& runId);

}  // namespace dtrain::spec
