#pragma once
// The built-in data-parallel trainer: one instance per worker, all ranks in lock step.
#include <atomic>
#include <cstdint>
#include <functional>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "dtrain/comm/communicator.h"
#include "dtrain/spec/job_spec.h"
#include "dtrain/train/lr_schedule.h"  // learningRate

namespace dtrain::train {

struct TrainResult {
  double final_loss = 0;       // mean training loss of the last logged window, all ranks
  double eval_accuracy = 0;    // 0..1 on the held-out split (classification; 0 without one)
  double eval_loss = 0;
  uint64_t eval_samples = 0;   // the held-out split's size: 0 = nothing was evaluated
  double samples_per_s = 0;    // global, over the whole run after the first step
  long long steps = 0;
  long long steps_run = 0;     // steps trained by this run (0: its checkpoint already completed the job)
  std::string weights_sha256;  // identical on every rank (checked)
  // Pipeline parallelism (trainer.parallel.pipeline_stages > 1; pipeline.h); defaults otherwise.
  int pipeline_stages = 1;
  double bubble_fraction = 0;        // 1 - all ranks' compute / (stages x the pipeline's span)
  std::vector<double> stage_ms;      // per stage: forward + backward compute per step (ms); empty: none timed
  size_t stage_params = 0;           // parameters this rank holds (the whole model when P = 1)
  size_t peak_activation_bytes = 0;  // this rank's peak of stashed activations (pipeline only)
};

// Requests to a running train() from outside its thread: dtrain train's signal handlers store
// them (the atomics are lock-free, so a handler may), the trainer reads them at step
// boundaries, where the ranks agree on them (a max all-reduce of one int32 on the world
// communicator, so that every rank acts at the same step: on a host communicator started at
// the end of every step and acted on at the end of the next, without the training thread
// waiting for it; with NCCL a blocking one every kControlPeriodOnDevice steps; see
// src/control.h). The trainer reports where it is (`phase`, `writes`, `boundary_ms`) for a
// watcher that bounds how long a stop may take.
struct TrainControl {
  // SIGUSR1/SIGUSR2: write a checkpoint at the next agreed boundary and go on. Counted, not
  // flagged: one signal passed on to every worker reaches them at slightly different times
  // (on other nodes a network hop later), maybe on either side of a boundary; the ranks
  // agree on the highest count, so it is one checkpoint however the copies straddle steps,
  // and each further signal one more.
  void requestCheckpoint(int signal) {
    checkpoint_signal.store(signal);
    checkpoint_requests.fetch_add(1);
  }
  std::atomic<int> checkpoint_requests{0};
  std::atomic<int> checkpoint_signal{0};  // the last one's number
  // A signal number (SIGTERM/SIGINT/SIGHUP): at the next agreed boundary write a final
  // checkpoint (with a checkpoint dir), wait until it is durable and throw TrainingStopped.
  // Never reset.
  std::atomic<int> stop{0};
  enum Phase : int {
    kSetup = 0,  // before the first step (communicator, resume): no boundary is coming soon
    kTraining,   // in the steps: a boundary comes within about boundary_ms
    kSaving,     // writing a checkpoint (the final one after a stop), or waiting for one
    kFinishing,  // after the last step (evaluation, hashes): the last checkpoint is durable
    kDone,       // (set by the caller) train() has returned or thrown
  };
  std::atomic<int> phase{kSetup};
  std::atomic<int> writes{0};             // checkpoint writes in progress on this rank (inline or async)
  std::atomic<long long> boundary_ms{0};  // about the time a request takes to be acted on (its steps)
  // A stop during kFinishing (the final evaluation: the last checkpoint is durable) ends the
  // process at once (train_signals.h), after the run's last words (its metrics curve, and
  // TrainOptions::on_stop_while_finishing), called from the watcher's thread under
  // finishing_mu, which train() holds to take them back before what they refer to is gone
  // (detail::FinishingWords).
  std::mutex finishing_mu;
  std::function<void()> on_stop_while_finishing;
};
static_assert(std::atomic<int>::is_always_lock_free && std::atomic<long long>::is_always_lock_free,
              "TrainControl is written from signal handlers");

// Steps between two agreements on TrainControl's requests with the NCCL communicator: there
// the all-reduce of one int32 is a copy to the device and back that waits for the step's
// queued work (a stall of the stream), so it is taken only every 16 steps. (On a host
// communicator it is overlapped with the next step and taken every step.)
inline constexpr int kControlPeriodOnDevice = 16;

// Thrown by train() on every rank when the ranks agreed on a stop (TrainControl::stop): at a
// step boundary, after the final checkpoint (when there is a checkpoint dir) is durable.
class TrainingStopped : public std::runtime_error {
 public:
  TrainingStopped(int signal, long long step, std::string checkpoint)
      : std::runtime_error("training stopped by a signal"),
        signal_(signal),
        step_(step),
        checkpoint_(std::move(checkpoint)) {}
  int signal() const { return signal_; }  // the agreed one (the highest-numbered stop signal of any rank)
  long long step() const { return step_; }
  const std::string& checkpoint() const { return checkpoint_; }  // what rank 0 says was written; "" = none

 private:
  int signal_;
  long long step_;
  std::string checkpoint_;
};

struct TrainOptions {
  // Progress lines (rank 0 only); empty = silent.
  std::function<void(const std::string&)> log;
  // Warnings (a corrupt checkpoint skipped, a failed background write's cleanup, ...), one
  // line each without a prefix; empty = to `log` as "warning: ...". `dtrain train` sends them
  // to stderr, so that a script reading stdout sees progress alone.
  std::function<void(const std::string&)> warn;
  void warning(const std::string& line) const {
    if (warn)
      warn(line);
    else if (log)
      log("warning: " + line);
  }
  // When set, receives the final weights (flat, layer by layer). Pipeline: the whole model on
  // rank 0, this rank's stage on the others.
  std::vector<float>* final_params = nullptr;
  // Live status (a progress bar), rank 0 only, a few times a second; empty = none.
  std::function<void(const std::string&)> status;
  // Rank 0 writes metrics.jsonl and metrics.svg here; "" = none.
  std::string metrics_dir;
  // What metrics.jsonl's rows name: the run (DTRAIN_RUN_ID) and attempt (restart count).
  std::string run_id;
  int attempt = 0;
  // When set, called as each step begins, with the global step (0-based): a heartbeat.
  std::function<void(long long)> on_step;
  // When set, called often while the trainer works outside its steps (the final evaluation,
  // around a checkpoint write), so that a watchdog does not take that work for a hang.
  std::function<void()> heartbeat;
  // Test hook: called on the thread that writes a checkpoint, as its bytes go out (after
  // each write to the temporary file): a test slows a write down to interrupt it mid-way.
  std::function<void()> on_checkpoint_bytes;
  // When set, sees every batch this rank trains on: (epoch, sample indices, count).
  std::function<void(int, const uint64_t*, int)> on_batch;
  // Pipeline trainer only: called as each micro-batch's forward begins on this rank, with
  // the global step and the micro-batch index (fault injection in the middle of a step).
  std::function<void(long long, int)> on_micro_batch;
  // Pipeline trainer only: when set, each rank writes DIR/trace-rank<R>.json, a Chrome trace
  // (ui.perfetto.dev) of a few steps after the first: compute, transfers and waits.
  std::string trace_dir;
  // Requests from outside (signals), polled and agreed on at step boundaries; nullptr = none.
  // Set on every rank or on none: the agreement is a collective.
  TrainControl* control = nullptr;
  // With `control`: called with the step the training ended at when a stop ends the final
  // evaluation, on the signal watcher's thread, just before the process exits (the summary's
  // last words: where the run stopped).
  std::function<void(long long step)> on_stop_while_finishing;
  // Overrides spec.device ("auto", "cpu" or "cuda"); "" = the spec's. The GPU is always
  // LOCAL_RANK (else the rank) modulo the visible GPUs, as in the NCCL communicator.
  std::string device;
};

// Trains per spec. Collective: every rank calls it. The math runs on the device of
// resolveDevice() (device.h); an "nccl" communicator needs that to be a GPU (it takes device
// pointers), a "tcp" one works with either. Throws TrainingStopped on a stop request
// (TrainOptions::control), SpecError when a checkpoint cannot be written (a full disk, a
// read-only mount: checkpointWriteRefusal's line), PeerLostError when a peer fails,
// InternalError when replicas end with different weights, SpecError for an unusable device
// and for a run that diverged (a loss that is not finite: no checkpoint of it is written).
TrainResult train(const spec::TrainerSpec& spec, comm::Communicator& comm, const TrainOptions& opts = {});

// Buckets of the flat gradient buffer, in the order backward completes them (last layer
// first): each is [begin, end) in floats and closes at the layer whose index is `closes_at`.
struct Bucket {
  size_t begin = 0, end = 0;
  int closes_at = 0;
};
// As in PyTorch DDP, the first bucket is capped lower (firstBucketFloats) so that its
// all-reduce starts early in backward.
std::vector<Bucket> planBuckets(const std::vector<size_t>& layerOffsets, size_t bucketFloats, size_t firstBucketFloats);

std::string sha256Hex(const void* data, size_t bytes);

// The global step training ends at, resuming at `step` from (startEpoch, startCursor):
// full global batches of the rest of the epochs (drop_last), capped by max_steps.
long long plannedSteps(const spec::TrainerSpec& ts, long long step, int startEpoch, uint64_t startCursor, uint64_t samples,
                       uint64_t globalBatch);

}  // namespace dtrain::train
