#pragma once
// Pipeline (model) parallelism combined with data parallelism in the built-in trainer
// (trainer.parallel; docs/trainer.md, "Pipeline parallelism").
//
// Layout: world = D x P. Rank r is stage p = r % P of pipeline (data-parallel replica)
// d = r / P: a pipeline is P consecutive ranks, a stage group the D ranks p, P + p, 2P + p...
// Consecutive ranks usually share a node, so activations (every micro-batch) travel between
// neighbours on one node while only the per-step gradient reduction crosses nodes.
#include <cstddef>
#include <vector>

#include "dtrain/comm/communicator.h"
#include "dtrain/spec/job_spec.h"
#include "dtrain/train/trainer.h"

namespace dtrain::train {

struct PipelineLayout {
  int stages = 1, replicas = 1;
  int stage = 0, replica = 0;
  int rankOf(int replica_, int stage_) const { return replica_ * stages + stage_; }
};

// Throws SpecError when world is not a multiple of stages.
PipelineLayout pipelineLayout(int rank, int world, int stages);

// The first weight layer of each stage plus the total at the end (stages + 1 entries) for an
// MLP of `widths` (input, hidden..., output): contiguous, every stage at least one layer.
// With stageLayers (counts per stage) exactly those; otherwise the partition that minimises
// the largest stage's parameter count (ties: the earliest such split).
std::vector<int> partitionStages(const std::vector<int>& widths, int stages, const std::vector<int>& stageLayers = {});

// The pipeline trainer: called by train() when pipeline_stages > 1, same contract (every
// rank calls it; the result's weights_sha256 is the hash of the whole model, flat and layer
// by layer as with P = 1, on every rank). Stages run on the device trainer.device resolves
// to (resolveDevice, as the data-parallel trainer). Throws SpecError for a world size that is
// not a multiple of pipeline_stages, for an unusable batch, for "cuda" without a usable GPU,
// and for the "nccl" communicator with CPU stages.
TrainResult trainPipeline(const spec::TrainerSpec& spec, comm::Communicator& comm, const TrainOptions& opts = {});

}  // namespace dtrain::train
