#pragma once
#include <map>
#include <string>

#include "dtrain/launch/plan.h"

namespace dtrain::launch {

using EnvMap = std::map<std::string, std::string>;

struct EnvOptions {
  int restart_count = 0;
  std::string error_file;  // TORCHELASTIC_ERROR_FILE for this worker
};

// The environment of one worker: `base` (dtrain's own environment), then the torchrun
// contract, then OMP_NUM_THREADS=1 when several workers share the node and neither `base`
// nor the spec sets it, then the spec's env (which wins over everything).
EnvMap workerEnv(const EnvMap& base, const spec::JobSpec& spec, const Plan& plan, const WorkerSlot& slot,
                 const EnvOptions& opts);

// True when workerEnv would add OMP_NUM_THREADS=1 (the launcher prints a notice once).
bool setsOmpThreads(const EnvMap& base, const spec::JobSpec& spec);

EnvMap currentEnvironment();

}  // namespace dtrain::launch
