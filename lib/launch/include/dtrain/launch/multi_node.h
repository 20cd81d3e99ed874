#pragma once
// Multi-node jobs: the launcher hosts the store, checks every remote host (pre-flight),
// starts one `dtrain agent` per node (over ssh, or as a child for local entries), streams
// their workers' output, and tears every node down on a failure or a signal.
#include <chrono>
#include <string>
#include <vector>

#include "dtrain/common/errors.h"
#include "dtrain/launch/launcher.h"
#include "dtrain/launch/plan.h"
#include "dtrain/spec/job_spec.h"

namespace dtrain::launch {

struct MultiNodeOptions {
  std::string version;      // what `dtrain --version` prints here; every host must match
  std::string result_file;  // where the trainer's outcome goes ("" = dropped)
  // Whether each node's agent makes a data image for its workers (the launcher's
  // DTRAIN_DATA_SHARE): passed to the agents, whose environment over ssh is not the launcher's.
  bool data_share = true;
  // Whether each node's agent refuses a trainer job its host cannot hold (the launcher's
  // DTRAIN_MEMORY_CHECK), passed on the same way.
  bool memory_check = true;
};

// Raised when one or more hosts fail the pre-flight check; what() is a per-host table.
class PreflightError : public IoError {
 public:
  using IoError::IoError;
};

// Runs the job across spec.nodes to completion. spec.rendezvous.port is written back with
// the store's port. Throws SpecError for a busy port, PreflightError for unreachable hosts.
RunResult runMultiNodeJob(spec::JobSpec& spec, const std::string& run_id, const MultiNodeOptions& opts);

// The ssh client argv that reaches `node` (everything up to and including the host), per
// the spec's ssh section: BatchMode, ConnectTimeout, host key policy, keepalives.
std::vector<std::string> sshArgv(const spec::JobSpec& spec, const spec::NodeSpec& node);

// The plan as the hostfile describes it (node order = node rank), for --dry-run.
Plan makeNodesPlan(const spec::JobSpec& spec, const std::string& run_id);

namespace detail {

// The round an elastic event of a multi-node job carries (docs/elastic.md, "Events"):
// `openRound`, the round that runs or forms (0 during startup); once a restart has been
// announced (`restartAnnounced`: its `restart` event names openRound + 1) and until that
// round is opened, the round it opens. Rounds never go down along the event log.
int eventRound(int openRound, bool restartAnnounced);

// How long a worker's failure in a round of several nodes may wait for its verdict: a node
// lost meanwhile is the incident's cause, the failure likely its collateral (docs/elastic.md,
// "Who is blamed").
inline constexpr std::chrono::milliseconds kCollateralHold{1000};

// Whether a failure held since `heldAt` is judged now: its hold is over, or every node of
// the round has reported its workers ended (no node's loss can be on its way).
bool heldFailureDue(std::chrono::steady_clock::time_point heldAt, std::chrono::steady_clock::time_point now,
                    bool everyNodeHeardFrom);

}  // namespace detail

}  // namespace dtrain::launch
