#pragma once
// The trainer's metrics.jsonl: one JSON object per line, appended by rank 0 as training goes.
// Every row names its run (DTRAIN_RUN_ID) and attempt (the restart count), and each attempt
// begins with a "start" row, so runs and restarts that share a log_dir stay apart. A start
// row also names the training it continues (its checkpoint directory and config hash): a
// later run that resumes from that directory's checkpoints draws the whole training.
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
  // The training: trainer.checkpoint.dir ("" = none: each run trains from step 0 alone) and
  // the config hash its checkpoints must carry (16 hex digits).
  std::string checkpoint_dir;
  std::string config_hash;
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

// The curve of the training `run` belongs to, as its runs and attempts left it: the train
// rows of `run` and of the earlier runs whose start rows name the same checkpoint directory
// and config hash (runs of one log_dir that resumed from each other's checkpoints; none
// without a checkpoint directory), in file order and so in step order, where an attempt that
// starts at step S replaces the rows after S (that work was redone from the checkpoint of
// step S; a start at 0, a training begun afresh, replaces them all), and a row of a step at
// or before the last one kept replaces the rows from that step on (the later value for a
// step wins). eval_accuracy: the last eval row after the last start row, -1 when none.
// Lines that are not JSON objects (a torn line) or belong to other runs are skipped; read
// line by line, and only start rows and the training's own rows are parsed (the file holds
// every run of its log_dir).
struct MetricsCurve {
  std::vector<MetricsPoint> points;
  double eval_accuracy = -1;
};
MetricsCurve readMetricsRun(std::istream& jsonl, const MetricsRun& run);

}  // namespace dtrain::spec
