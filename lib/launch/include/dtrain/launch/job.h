#pragma once
#include <string>

#include "dtrain/launch/launcher.h"
#include "dtrain/spec/job_spec.h"

namespace dtrain::launch {

// Runs a resolved single-node job: hosts its store on loopback (port spec.rendezvous.port,
// 0 = a free one; the chosen port is written back), launches the workers with the store's
// endpoint and a fresh token in their environment, and waits for them.
RunResult runLocalJob(spec::JobSpec& spec, const std::string& run_id);

}  // namespace dtrain::launch
