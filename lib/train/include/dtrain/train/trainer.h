#pragma once
// The built-in data-parallel trainer: one instance per worker, all ranks in lock step.
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "dtrain/comm/communicator.h"
#include "dtrain/spec/job_spec.h"

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
  double bubble_fraction = 0;        // mean over ranks of 1 - compute / schedule time
  std::vector<double> stage_ms;      // per stage: forward + backward compute per step (ms)
  size_t stage_params = 0;           // parameters this rank holds (the whole model when P = 1)
  size_t peak_activation_bytes = 0;  // this rank's peak of stashed activations (pipeline only)
};

struct TrainOptions {
  // Progress lines (rank 0 only); empty = silent.
  std::function<void(const std::string&)> log;
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
  // When set, sees every batch this rank trains on: (epoch, sample indices, count).
  std::function<void(int, const uint64_t*, int)> on_batch;
  // Pipeline trainer only: called as each micro-batch's forward begins on this rank, with
  // the global step and the micro-batch index (fault injection in the middle of a step).
  std::function<void(long long, int)> on_micro_batch;
  // Pipeline trainer only: when set, each rank writes DIR/trace-rank<R>.json, a Chrome trace
  // (ui.perfetto.dev) of a few steps after the first: compute, transfers and waits.
  std::string trace_dir;
  // Overrides spec.device ("auto", "cpu" or "cuda"); "" = the spec's. The GPU is always
  // LOCAL_RANK (else the rank) modulo the visible GPUs, as in the NCCL communicator.
  std::string device;
};

// Trains per spec. Collective: every rank calls it. The math runs on the device of
// resolveDevice() (device.h); an "nccl" communicator needs that to be a GPU (it takes device
// pointers), a "tcp" one works with either. Throws PeerLostError when a peer fails,
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

// The learning rate for 0-based `step` of `totalSteps` under the spec's schedule.
double learningRate(const spec::TrainerSpec& ts, long long step, long long totalSteps);

// The global step training ends at, resuming at `step` from (startEpoch, startCursor):
// full global batches of the rest of the epochs (drop_last), capped by max_steps.
long long plannedSteps(const spec::TrainerSpec& ts, long long step, int startEpoch, uint64_t startCursor, uint64_t samples,
                       uint64_t globalBatch);

}  // namespace dtrain::train
