#pragma once
#include <memory>
#include <string>
#include <vector>

#include "dtrain/launch/plan.h"
#include "dtrain/spec/job_spec.h"

namespace dtrain::launch {

// How one worker ended.
struct WorkerExit {
  int global_rank = 0;
  int local_rank = 0;
  std::string host;
  int pid = 0;
  int exit_code = 0;  // valid when signal == 0
  int signal = 0;     // terminating signal, 0 if it exited
  bool stopped_by_dtrain = false;  // killed during teardown, not a failure of its own
  std::string when;                // UTC, ISO 8601
  std::vector<std::string> stderr_tail;
  std::string error_message;       // from TORCHELASTIC_ERROR_FILE
  std::string error_traceback;
};

struct RunResult {
  int exit_code = 0;         // what dtrain should exit with
  int received_signal = 0;   // SIGINT/SIGTERM/SIGHUP that stopped the job, else 0
  std::vector<WorkerExit> workers;
  int first_failure = -1;    // index into workers, -1 when none failed
};

// Seam between "what to run" and "how processes get started" (local now; SSH and a fake
// for tests later).
class Launcher {
 public:
  virtual ~Launcher() = default;
  // Runs the plan to completion. Blocks; handles SIGINT/SIGTERM/SIGHUP while it runs.
  virtual RunResult run(const Plan& plan, const spec::JobSpec& spec) = 0;
};

std::unique_ptr<Launcher> makeLocalLauncher();

// The failure summary printed when a worker fails.
std::string formatFailure(const RunResult& result, const spec::JobSpec& spec);

}  // namespace dtrain::launch
