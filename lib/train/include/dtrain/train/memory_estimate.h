#pragma once
// The memory a trainer job's workers need, derived from what the trainers allocate
// (trainer.cc, pipeline.cc, mlp.cc, backend.cc, batch_loader.cc, data.cc, the CUDA backends),
// for the check before any worker starts (dtrain run, dtrain validate, dtrain train by hand)
// and for the line an allocation failure inside a worker becomes (docs/trainer.md, "Memory").
//
// Accuracy: within ~10% of the peak resident set measured on the CPU paths (docs/trainer.md
// has the table), a little above it rather than below. The GPU path's host side counts the
// trainer's buffers, not the CUDA runtime's own memory (unmeasured).
#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "dtrain/common/system_memory.h"
#include "dtrain/spec/job_spec.h"

namespace dtrain::train {

// Where the job's workers run, as far as their memory goes.
struct MemoryLayout {
  int world = 1;       // ranks in the job
  int first_rank = 0;  // this host runs ranks [first_rank, first_rank + workers)
  int workers = 1;
  bool gpu = false;        // math on GPUs: the model and the activations live in device memory
  uint64_t data_rows = 0;  // file data (csv, idx): rows every worker holds, training and held-out; 0 for synthetic
  // The file data is the launcher's data image (data.h), mapped by every worker of the host:
  // held once, and no worker reads the files.
  bool data_shared = false;
  // The held-out set's size: the evaluation's batches are min(batch_size, this) rows.
  // -1: unknown; synthetic data's is its spec's eval_samples, a file's taken as a batch.
  long long eval_rows = -1;
  // Whether checkpoint.dir may hold a checkpoint to resume from (read at the start, rank 0 /
  // each stage's replica 0): false for a directory without any (a first run), whose read
  // would otherwise be counted for nothing.
  bool checkpoint_to_read = true;
};

// One worker's memory in bytes, by what holds it. Each part is at its largest; peak() is
// what is held at the worst moment: a checkpoint read at the start is freed before the data
// set is read, and a file's bytes are freed before the first batch exists.
struct WorkerMemory {
  uint64_t model = 0;    // weights, gradients, optimizer state, and the trainer's host copies of weights and state
  uint64_t batch = 0;    // activations and their gradients (the batch; a stage's micro-batches in flight and the
                         // evaluation chunk), the batch buffers (one batch loading ahead), the BLAS workspace
  uint64_t data = 0;     // data sets held in memory
  uint64_t loading = 0;  // idx files: their bytes while they become floats (before the first batch)
  uint64_t resume = 0;   // rank 0 with a checkpoint directory: the checkpoint's weights and state, read at the start
  uint64_t gather = 0;   // pipeline rank 0: the whole model, gathered for the job's weight hash at the end
  uint64_t runtime = 0;  // the process itself: code, libraries, stacks, the communicators' shared memory
  uint64_t device = 0;   // GPU workers: device memory (outside peak(), which is host memory)
  // The shared-memory segments of its communicators, part of runtime: mapped by every worker
  // of the host, held once (estimateMemory counts them once).
  uint64_t shared = 0;
  // The data image, part of data: mapped by every worker of the host, held once (estimateMemory
  // counts it once).
  uint64_t data_shared = 0;
  uint64_t peak() const { return runtime + model + std::max(resume, data + std::max(loading, batch + gather)); }
  // peak() without what the host's workers hold together (shared and data_shared).
  uint64_t privatePeak() const {
    return runtime - shared + model + std::max(resume, data - data_shared + std::max(loading, batch + gather));
  }
};

struct MemoryEstimate {
  std::vector<WorkerMemory> workers;  // the host's, by rank from first_rank
  uint64_t host = 0;                  // the host's peak: every worker's together
  // The spec field that most of host's bytes come from, for a message and its fix:
  // "/trainer/model/layers", "/trainer/batch_size" or "/trainer/data/path".
  std::string field;
};

// The host's workers' memory. The spec is the resolved one (micro_batches set).
MemoryEstimate estimateMemory(const spec::TrainerSpec& t, const MemoryLayout& l);
// One worker's (rank in [0, l.world)).
WorkerMemory estimateWorkerMemory(const spec::TrainerSpec& t, const MemoryLayout& l, int rank);
// The field most of w's bytes come from (as MemoryEstimate::field).
std::string dominantField(const WorkerMemory& w);

// The launch's check (dtrain run and dtrain validate for a local job, dtrain train run by
// hand): throws SpecError, "<source>: <field>: this job needs about ... on this host ...,
// more than the ... available (MemAvailable); <fix>" (or "available under the memory limit
// of ... of this process's cgroup (DIR)"), when the host's estimate exceeds available.bytes
// (0: unknown, nothing is checked). Returns the estimate.
MemoryEstimate checkHostMemory(const spec::TrainerSpec& t, const MemoryLayout& l, const MemoryAvailability& available,
                               const std::string& source);
// The fix for a job whose memory comes mostly from `field` (dominantField), laid out as `l`
// says (its workers per host, a shared data image): "use a smaller batch_size (now 65536) or
// fewer workers per host (nproc_per_node 2)".
std::string memoryFix(const spec::TrainerSpec& t, const std::string& field, const MemoryLayout& l);
// What holds one worker's memory, the largest parts first, for messages: "activations and
// batch buffers 31.6 GiB, weights, gradients and optimizer state 3 MiB".
std::string describeWorkerMemory(const WorkerMemory& w);

// Whether the launch refuses a job over the available memory: yes unless DTRAIN_MEMORY_CHECK=0
// (also off, false, no: a host that swaps, or whose MemAvailable undercounts what the job may
// take), where the estimate is said, not enforced. Throws SpecError for another value.
bool memoryCheckEnforced();

}  // namespace dtrain::train
