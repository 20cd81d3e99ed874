#pragma once
// Rank 0's progress reporting, one definition for the data-parallel and the pipeline
// trainers: samples/s since the end of the first step (its warm-up would skew the rate), the
// time left at that rate, the status line's throttle and its bar.
// Not thread-safe; one per training run.
#include <chrono>
#include <cstdint>
#include <string>

namespace dtrain::train::detail {

// "42s", "3m05s".
std::string fmtDuration(double seconds);

// "12345 samples/s", or "- samples/s" while it is not measured (0: the first step is left out
// of the rate), as the summary's null and metrics.jsonl's null say.
std::string rateText(double samplesPerSecond);

// Milliseconds with three significant digits or so: "12.3", "0.42", "0.037" (a small stage's
// compute is not "0.0").
std::string msText(double ms);

class Progress {
 public:
  using Clock = std::chrono::steady_clock;
  // Steps are global and counted from 0; firstStep: where this run started (a resume's step).
  Progress(long long firstStep, long long totalSteps, uint64_t globalBatch);

  // Call once a step is done; `step` = steps done so far. Starts the rate's clock after the
  // run's first step.
  void stepDone(long long step);
  // Samples/s over the steps after the first (0 until there is one).
  double samplesPerSecond(long long step) const;
  // The time left at that rate, formatted.
  std::string eta(long long step) const;
  // A few times a second, and at the last step: whether to redraw the live status line.
  bool statusDue(long long step);
  // "[##########....................]  33% step 33/100"
  std::string bar(long long step) const;

 private:
  long long firstStep_, totalSteps_;
  double globalBatch_;
  Clock::time_point afterFirst_, lastStatus_;
};

}  // namespace dtrain::train::detail
