// The line an allocation failure in a worker becomes (out_of_memory.h).
#include "out_of_memory.h"

#include <fmt/format.h>
#include <sys/resource.h>

#include "dtrain/common/strings.h"
#include "dtrain/common/system_memory.h"

namespace dtrain::train::detail {
namespace {

// ", its address space is limited to 3.8 GiB (ulimit -v)" when it is: an allocation can then
// fail with memory to spare on the host.
std::string addressSpaceLimit() {
  struct rlimit r {};
  if (::getrlimit(RLIMIT_AS, &r) != 0 || r.rlim_cur == RLIM_INFINITY) return "";
  return fmt::format(", its address space is limited to {} (ulimit -v)", formatBytes(r.rlim_cur));
}

}  // namespace

std::string outOfMemoryMessage(const spec::TrainerSpec& t, const MemoryLayout& layout, int rank,
                               AllocationSite::Kind site, const std::exception& e) {
  const WorkerMemory w = estimateWorkerMemory(t, layout, rank);
  const auto* alloc = dynamic_cast<const AllocationError*>(&e);
  const bool device = alloc && alloc->device();
  const uint64_t B = static_cast<uint64_t>(t.batch_size);
  std::string what, field;
  switch (site) {
    case AllocationSite::kModel:
      what = "the model's weights, gradients and optimizer state";
      field = "/trainer/model/layers";
      break;
    case AllocationSite::kHostCopies:
      what = "the host copies of the weights and optimizer state";
      field = "/trainer/model/layers";
      break;
    case AllocationSite::kCheckpoint:
      what = "the weights and optimizer state of the checkpoint to resume from";
      field = "/trainer/model/layers";
      break;
    case AllocationSite::kData:
      what = fmt::format("the data set ({})", t.data.path);
      field = "/trainer/data/path";
      break;
    case AllocationSite::kBatch:
      what = fmt::format(
          "the activations and buffers of a batch of {} samples{}", B,
          t.parallel.pipeline_stages > 1
              ? fmt::format(" (micro-batches of {})", B / static_cast<uint64_t>(std::max(1, t.parallel.micro_batches)))
              : std::string());
      field = "/trainer/batch_size";
      break;
    case AllocationSite::kEval:
      what = fmt::format("the evaluation's batches of {} samples", B);
      field = "/trainer/batch_size";
      break;
    case AllocationSite::kGather:
      what = "the whole model, gathered for the job's weight hash";
      field = "/trainer/model/layers";
      break;
    case AllocationSite::kSetup:
      what = "its buffers";
      field = dominantField(w);
      break;
  }
  std::string need;
  if (device) {
    need = fmt::format("this worker needs about {} of device memory", formatBytes(w.device));
  } else {
    const MemoryAvailability avail = memoryAvailability();
    std::string left;
    if (avail.cgroup_bound)
      left = fmt::format(", {} left under the memory limit of {} of its cgroup", formatBytes(avail.bytes),
                         formatBytes(avail.cgroup_limit));
    else if (avail.bytes)
      left = fmt::format(", {} available on this host", formatBytes(avail.bytes));
    need = fmt::format("this worker needs about {} ({}){}{}", formatBytes(w.peak()), describeWorkerMemory(w),
                       addressSpaceLimit(), left);
  }
  return fmt::format("trainer: rank {} ran out of {}memory allocating {} ({}): {}; {}: {}", rank,
                     device ? "device " : "", what, e.what(), need, field, memoryFix(t, field, layout));
}

}  // namespace dtrain::train::detail
