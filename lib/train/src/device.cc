#include "dtrain/train/device.h"


#include <algorithm>
#include <cstdlib>
#include <string>

#include <fmt/format.h>

#ifdef DTRAIN_HAVE_CUDA
#include <cuda_runtime.h>
#endif
#ifdef DTRAIN_CUDART_SONAME
#include <dlfcn.h>

#include "dtrain/common/dynlib.h"
#endif

#include "dtrain/common/errors.h"
#include "dtrain/common/strings.h"
#include "dtrain/common/system_cpus.h"

namespace dtrain::train {

bool cudaBuild() {
#ifdef DTRAIN_HAVE_CUDA
  return true;
#else
  return false;
#endif
}

namespace {

#if defined(DTRAIN_CUDART_SONAME)
// cudart, loaded for the probe instead of linked (lib/train/CMakeLists.txt). The GPU
// plugins link the same soname, so they share this copy. Resolved once; thread-safe.
struct Cudart {
  decltype(&cudaGetDeviceCount) getDeviceCount = nullptr;
  decltype(&cudaGetLastError) getLastError = nullptr;
  decltype(&cudaGetErrorString) getErrorString = nullptr;
  std::string missing;  // why it could not be loaded
};

const Cudart& cudart() {
  static const Cudart c = [] {
    Cudart r;
    void* h = openLibrary({DTRAIN_CUDART_SONAME, DTRAIN_CUDART_PATH}, "cudaGetDeviceCount", &r.missing);
    if (!h) return r;
    r.getDeviceCount = reinterpret_cast<decltype(&cudaGetDeviceCount)>(::dlsym(h, "cudaGetDeviceCount"));
    r.getLastError = reinterpret_cast<decltype(&cudaGetLastError)>(::dlsym(h, "cudaGetLastError"));
    r.getErrorString = reinterpret_cast<decltype(&cudaGetErrorString)>(::dlsym(h, "cudaGetErrorString"));
    if (!r.getLastError || !r.getErrorString) {
      r.getDeviceCount = nullptr;
      r.missing = std::string(DTRAIN_CUDART_SONAME) + " lacks cudaGetLastError or cudaGetErrorString";
    }
    return r;
  }();
  return c;
}
#elif defined(DTRAIN_HAVE_CUDA)
// Linked directly: the GPU emulation (tests/train/gpu_emulation) provides these.
struct Cudart {
  decltype(&cudaGetDeviceCount) getDeviceCount = &cudaGetDeviceCount;
  decltype(&cudaGetLastError) getLastError = &cudaGetLastError;
  decltype(&cudaGetErrorString) getErrorString = &cudaGetErrorString;
  std::string missing;
};
const Cudart& cudart() {
  static const Cudart c;
  return c;
}
#endif

// The visible GPU count, and why there are none (the driver's words) in *why; -1 when CUDA's
// runtime itself cannot be loaded (*why: the loader's words).
int probeGpus(std::string* why) {
#ifdef DTRAIN_HAVE_CUDA
  const Cudart& rt = cudart();
  if (!rt.getDeviceCount) {
    if (why) *why = rt.missing;
    return -1;
  }
  int n = 0;
  // No driver, no device, or CUDA_VISIBLE_DEVICES hiding all: an error code, not an exception.
  cudaError_t e = rt.getDeviceCount(&n);
  if (e != cudaSuccess) {
    (void)rt.getLastError();  // clear the (non-sticky) error so later calls start clean
    if (why) *why = rt.getErrorString(e);
    return 0;
  }
  if (n == 0 && why) *why = "0 devices";
  return n;
#else
  if (why) *why = "a CPU build";
  return 0;
#endif
}

}  // namespace

int visibleGpus() { return std::max(0, probeGpus(nullptr)); }

int localRankFromEnv(int fallback) { return envIndex("LOCAL_RANK", fallback); }
int localWorldSizeFromEnv(int fallback) { return envIndex("LOCAL_WORLD_SIZE", fallback); }

namespace {

// A CPU (of this worker's usable ones: affinity, cgroup CPU quota) that none of this node's workers' BLAS threads computes
// on: LOCAL_WORLD_SIZE x (OPENBLAS_NUM_THREADS, else OMP_NUM_THREADS; unset: every core).
bool spareCore() {
  const int cores = usableCpus();
  const int threads = envIndex("OPENBLAS_NUM_THREADS", envIndex("OMP_NUM_THREADS", 0));
  return threads > 0 && cores > localWorldSizeFromEnv(1) * threads;
}

// A true/false/"auto" trainer setting for work on a thread beside the worker's math: as
// set, else on for GPU math or with a spare core.
bool onGpuOrSpareCore(const std::optional<bool>& setting, bool gpu) { return setting ? *setting : gpu || spareCore(); }

}  // namespace

bool prefetchBatches(const std::optional<bool>& setting, bool gpu) { return onGpuOrSpareCore(setting, gpu); }

int loaderThreads(const std::optional<int>& setting, bool gpu) {
  if (setting) return *setting;
  if (!gpu) return 1;
  return std::clamp(usableCpus() / std::max(1, localWorldSizeFromEnv(1)) - 1, 1, 16);
}

bool overlapGradients(const std::optional<bool>& setting, bool gpu) { return onGpuOrSpareCore(setting, gpu); }

DeviceChoice resolveDevice(const std::string& device, int localRank, int localWorldSize) {
  DeviceChoice c;
  c.name = "cpu";
  if (device == "cpu") return c;
  if (device != "auto" && device != "cuda")
    throw SpecError(fmt::format("trainer.device \"{}\" is not one of auto, cpu, cuda", device));
  if (!cudaBuild()) {
    if (device == "cuda")
      throw SpecError("trainer.device is \"cuda\" but this is a CPU build; rebuild with -DDTRAIN_WITH_CUDA=ON or use "
                      "\"auto\" or \"cpu\"");
    return c;
  }
  std::string why;
  const int gpus = probeGpus(&why);
  if (gpus < 0) {
    if (device == "cuda")
      throw SpecError(fmt::format("trainer.device is \"cuda\" but CUDA's runtime cannot be loaded on this host ({}); "
                                  "install it or use \"auto\" or \"cpu\"",
                                  why));
    return c;
  }
  if (gpus == 0) {
    if (device == "cuda")
      throw SpecError(fmt::format("trainer.device is \"cuda\" but no GPU is visible to this worker ({}; check the "
                                  "driver and CUDA_VISIBLE_DEVICES / nodes[].gpus); use \"auto\" or \"cpu\"",
                                  why));
    return c;
  }
  if (localWorldSize > gpus) {
    if (device == "cuda")
      throw SpecError(fmt::format("trainer.device is \"cuda\" but {} workers on this node share {} visible GPU(s), and "
                                  "NCCL needs a GPU per worker; set nproc_per_node to at most {} or use \"cpu\"",
                                  localWorldSize, gpus, gpus));
    return c;
  }
  c.cuda = true;
  c.index = (localRank < 0 ? 0 : localRank) % gpus;
  c.name = fmt::format("cuda:{}", c.index);
  return c;
}

}  // namespace dtrain::train
