#pragma once
// What a worker is allocating, for the one line an allocation failure becomes.
//
// The trainers mark each stage of their start that allocates by size (the model, the host
// copies, a checkpoint read, the data set, the batch, the evaluation, the gathered model);
// trainer.cc and pipeline.cc catch std::bad_alloc (and AllocationError: device or pinned
// memory) around the whole run and rethrow it as a SpecError naming what was being
// allocated, this worker's estimated need (memory_estimate.h), the memory available and the
// spec field to change. A SpecError is the worker's exit 2: the job ends without a restart,
// since another attempt would run out of memory at the same place.
//
// Not thread-safe: the trainer's thread marks and reads it. An allocation that fails on
// another thread (the batch loader, the checkpoint writer, a communicator's executor)
// reaches that thread as the exception and is named by the stage the trainer is in.
#include <new>
#include <string>

#include "dtrain/common/errors.h"
#include "dtrain/spec/job_spec.h"
#include "dtrain/train/device.h"
#include "dtrain/train/memory_estimate.h"

namespace dtrain::train::detail {

class AllocationSite {
 public:
  enum Kind {
    kSetup,       // the communicator, the device: named by the estimate's dominant field
    kModel,       // weights, gradients and optimizer state (the backend's or the stage's)
    kHostCopies,  // the trainer's host copies of weights and optimizer state
    kCheckpoint,  // a checkpoint read to resume from
    kData,        // the data sets
    kBatch,       // the batch buffers, the activations and their gradients, the BLAS workspace
    kEval,        // the evaluation's batches
    kGather,      // pipeline rank 0: the whole model for the job's weight hash
  };
  void at(Kind k) { kind_ = k; }
  Kind kind() const { return kind_; }
  // Where the job's workers run, as far as this worker knows yet (the device once resolved,
  // the data rows once read): what its estimate is made of.
  MemoryLayout layout;

 private:
  Kind kind_ = kSetup;
};

// The SpecError message for an allocation failure `e` at `site` on `rank` (layout: where the
// job's workers run, data_rows as far as known).
std::string outOfMemoryMessage(const spec::TrainerSpec& t, const MemoryLayout& layout, int rank,
                               AllocationSite::Kind site, const std::exception& e);

// Runs body(site) and turns an allocation failure in it into the SpecError above, for the
// trainer of `rank` in a world of `world` ranks.
template <typename F>
auto withAllocationSite(const spec::TrainerSpec& t, int rank, int world, F&& body) {
  AllocationSite site;
  site.layout.world = world;
  site.layout.first_rank = rank;
  site.layout.workers = localWorldSizeFromEnv(1);
  try {
    return body(site);
  } catch (const std::bad_alloc& e) {
    std::string message;
    try {
      message = outOfMemoryMessage(t, site.layout, rank, site.kind(), e);
    } catch (...) {  // (the message itself could not be made: memory is that short)
      throw SpecError("trainer: out of memory (an allocation failed, and so did the report of it); use smaller "
                      "/trainer/model/layers, /trainer/batch_size or fewer workers per host");
    }
    throw SpecError(message);
  }
}

}  // namespace dtrain::train::detail
