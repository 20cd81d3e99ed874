#pragma once
#include <map>
#include <string>

#include "dtrain/common/system_cpus.h"
#include "dtrain/launch/plan.h"

namespace dtrain::launch {

using EnvMap = std::map<std::string, std::string>;

struct EnvOptions {
  int restart_count = 0;
  std::string error_file;  // TORCHELASTIC_ERROR_FILE for this worker
  // This node's CPUs (cpuAvailability(), read once by the launcher); the default is a node
  // with no CPU quota.
  CpuAvailability cpus;
};

// The environment of one worker: `base` (dtrain's own environment), then the torchrun
// contract, then defaultOmpThreads' OMP_NUM_THREADS, then the spec's env (which wins over
// everything).
EnvMap workerEnv(const EnvMap& base, const spec::JobSpec& spec, const Plan& plan, const WorkerSlot& slot,
                 const EnvOptions& opts);

// The OMP_NUM_THREADS workerEnv adds when neither `base` nor the spec sets it, "" for none:
// "1" when several workers share the node (torchrun's rule); when one worker runs under a
// cgroup CPU quota below the affinity mask, the quota's whole CPUs (OpenBLAS, OpenMP and
// torch otherwise start a thread per CPU of the host, and the quota throttles them all).
// The launcher prints a notice once when it is not "".
std::string defaultOmpThreads(const EnvMap& base, const spec::JobSpec& spec, const CpuAvailability& cpus);

EnvMap currentEnvironment();

}  // namespace dtrain::launch
