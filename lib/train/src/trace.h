// A Chrome trace (JSON "traceEvents", opened by ui.perfetto.dev or chrome://tracing) of a few
// steps on one rank, for DTRAIN_TRACE_DIR (TrainOptions::trace_dir): the pipeline trainer's
// micro-batches and transfers, the data-parallel trainer's forward, backward, all-reduce
// buckets and optimizer step. Times are the host's monotonic clock, the same in every process
// of a host, so per-rank files merge into one timeline.
#pragma once

#include <chrono>
#include <string>
#include <vector>

namespace dtrain::train::detail {

// Steps in a trace: the ones after the first (buffers and connections warming up).
constexpr long long kTraceSteps = 4;

// Not thread-safe: one per rank, fed by the training thread (a communicator's times are
// read from its finished Work there, not recorded from its thread).
class Trace {
 public:
  using Clock = std::chrono::steady_clock;
  // The row an event is drawn in: the training thread's work, or the communicator's (the
  // data-parallel trainer's all-reduce buckets, which run while the training thread goes on).
  enum Lane { kTrainLane = 0, kCommLane = 1 };

  // `path` "" records nothing. Otherwise creates the file's directory and tries a write there
  // now, so a bad DTRAIN_TRACE_DIR is said before training (SpecError: the worker's exit 2),
  // not after it, with its result. `label` names the rank's process in the viewer.
  Trace(std::string path, int rank, std::string label);

  bool enabled() const { return !path_.empty(); }
  // Records only while on (the traced steps).
  void setOn(bool on) { on_ = on && enabled(); }
  bool on() const { return on_; }
  // `micro`: the micro-batch (or bucket) the event is of, appended to its name; -1 none. The
  // category follows the name: compute ("F", "B", "forward", "backward"), "optimizer", or
  // "comm" (transfers and waits). `queued`, where set: when the work was handed to the
  // thread that ran it from `b` (its args say "queued_us", the time it waited to start).
  void add(const char* name, int micro, long long step, Clock::time_point b, Clock::time_point e,
           Lane lane = kTrainLane, Clock::time_point queued = {}) {
    if (on_) events_.push_back({name, micro, step, b, e, lane, queued});
  }
  bool empty() const { return events_.empty(); }
  // Writes the file (temporary, then rename: a reader never sees half of it). The problem, ""
  // when written or nothing to write: no reason to lose the run's result, which follows (the
  // caller warns).
  std::string write() const;

 private:
  struct Event {
    const char* name;
    int micro;
    long long step;
    Clock::time_point b, e;
    Lane lane;
    Clock::time_point queued;
  };
  std::string path_;
  int rank_;
  std::string label_;
  bool on_ = false;
  std::vector<Event> events_;
};

}  // namespace dtrain::train::detail
