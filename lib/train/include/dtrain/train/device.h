#pragma once
// Where a worker's trainer runs: the CPU, or one CUDA device.
#include <optional>
#include <string>

namespace dtrain::train {

struct DeviceChoice {
  bool cuda = false;
  int index = 0;       // CUDA device ordinal (cuda only)
  std::string name;    // "cpu" or "cuda:N"
};

// True in CUDA builds (the GPU trainer and the NCCL backend are compiled in).
bool cudaBuild();

// CUDA devices visible to this process (CUDA_VISIBLE_DEVICES honoured); 0 in CPU builds or
// when the driver reports none or fails.
int visibleGpus();

// Resolves trainer.device ("auto", "cpu" or "cuda") for the worker with local rank
// `localRank` among `localWorldSize` workers on its node (0 = unknown): cuda uses device
// localRank % visibleGpus(), the rule the NCCL communicator follows too, so both land on the
// same GPU. NCCL needs a GPU per worker, so "auto" is cuda only in a CUDA build with at least
// one visible GPU per local worker, else cpu. Every worker of a node decides alike.
// Throws SpecError for "cuda" in a CPU build, without a visible GPU, or with more local
// workers than GPUs.
DeviceChoice resolveDevice(const std::string& device, int localRank, int localWorldSize = 0);

// LOCAL_RANK / LOCAL_WORLD_SIZE from the environment (set by dtrain run), else `fallback`.
int localRankFromEnv(int fallback);
// Whether to load batches one step ahead on a thread (trainer.data.prefetch): as set, else
// ("auto") for GPU math, or when this node's CPUs (affinity) outnumber its workers' BLAS
// threads (LOCAL_WORLD_SIZE x OPENBLAS_NUM_THREADS or OMP_NUM_THREADS; unset: the BLAS takes
// every core), so that the loader thread has a core no worker computes on.
bool prefetchBatches(const std::optional<bool>& setting, bool gpu);
// How many threads compute a batch's samples (trainer.data.loader_threads): as set, else
// ("auto") for GPU math this worker's share of the node's CPUs (affinity / LOCAL_WORLD_SIZE)
// less one for the worker's own thread, between 1 and 16; for CPU math 1 (the BLAS threads
// have the cores).
int loaderThreads(const std::optional<int>& setting, bool gpu);
// Whether gradient buckets are all-reduced during backward (trainer.overlap): as set, else
// ("auto") for GPU math (NCCL runs on its own stream), or on CPUs under the same spare-core
// rule as prefetchBatches. Without a spare core the all-reduce thread only takes turns with
// backward on the same cores: measured 4-12% slower than reducing after backward.
bool overlapGradients(const std::optional<bool>& setting, bool gpu);
int localWorldSizeFromEnv(int fallback);

}  // namespace dtrain::train
