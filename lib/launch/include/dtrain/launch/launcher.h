#pragma once
#include <algorithm>
#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "dtrain/launch/plan.h"
#include "dtrain/spec/job_spec.h"
#include "dtrain/spec/summary.h"

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
  // It failed otherwise (an exit code, another signal) after a stop signal of dtrain's
  // teardown reached it: that signal (SIGTERM...), else 0. Still a failure of its own (a
  // checkpoint its handler failed to save), reported as following the teardown.
  int after_stop = 0;
  bool hung = false;               // killed by the watchdog (worker_timeout_s)
  bool start_failed = false;       // its command could not be started (exec, cwd): a restart cannot help
  // A trainer job's worker (dtrain train) exited 2, kExitUsage: its SpecError path, input it
  // refuses (spec, data file, checkpoint of another config) that every attempt would meet
  // again. Command jobs never set it: their exit codes mean what their programs say.
  bool refused_input = false;
  // Its node was lost before it reported an exit: how it ended is unknown (exit_code and
  // signal are 0 and mean nothing).
  bool lost = false;
  std::string when;                // UTC, ISO 8601
  std::vector<std::string> stderr_tail;  // its last output lines instead with merged_output
  std::string error_message;       // from TORCHELASTIC_ERROR_FILE
  std::string error_traceback;
};

struct RunResult {
  int exit_code = 0;         // what dtrain should exit with
  int received_signal = 0;   // SIGINT/SIGTERM/SIGHUP that stopped the job, else 0
  // A signal that came during the teardown after a failure that ended the job anyway (no
  // restart left or none could help): it only hurried the teardown; received_signal is 0.
  int teardown_signal = 0;
  // received_signal cut short a restart the job was making: when ("the back-off before
  // restart 1 of 3", "the teardown before restart 1 of 2"), else "". first_failure is why it
  // restarted (multi-node, none: failure_message says why, a lost node).
  std::string stopped_during;
  std::vector<WorkerExit> workers;
  int first_failure = -1;    // index into workers, -1 when none failed
  // When the first failure was reaped (one host), for kOutsideStopWindow.
  std::chrono::steady_clock::time_point first_failure_at{};
  // received_signal came within kOutsideStopWindow of the first failure, a worker's death by
  // a stop signal from outside (outsideStopSignal): one stop of the whole job (job.cc).
  bool outside_stop = false;
  // A second Ctrl-C killed the workers at once ("now"): the user wants dtrain gone, also
  // from its wait for a console that does not take its last lines (run_cmd.cc, the end).
  bool killed_now = false;
  // Each worker's stderr shared its stdout's pipe (dtrain's stdout and stderr are one file),
  // so its stderr_tail holds its last output lines, of both streams.
  bool merged_output = false;
  // Multi-node: a failure that is not a worker's (a node lost, an agent's error), "" if none.
  std::string failure_message;
  int restarts = 0;                      // restarts that spent the budget
  // The failure came with every restart of max_restarts (> 0) spent: the headline says so.
  bool budget_exhausted = false;
  std::vector<spec::JobEvent> events;    // elastic events, in order
};

// Seam between "what to run" and "how processes get started" (local now; SSH and a fake
// for tests later).
class Launcher {
 public:
  virtual ~Launcher() = default;
  // Runs the plan to completion. Blocks; handles SIGINT/SIGTERM/SIGHUP while it runs, and
  // passes SIGUSR1/SIGUSR2 on to the workers.
  virtual RunResult run(const Plan& plan, const spec::JobSpec& spec) = 0;
};

// What an outside controller (the node agent) asks of a running local launch.
enum class ControlAction {
  kNone,
  kStop,  // teardown as for SIGTERM: SIGTERM, then SIGKILL after shutdown_timeout_s
  // The same teardown with the user's Ctrl-C / SIGHUP / Ctrl-\ to the controller passed on:
  // SIGINT / SIGHUP / SIGQUIT instead of SIGTERM (a worker dying of it is stopped by dtrain),
  // as on one host.
  kStopSigint,
  kStopSighup,
  kStopSigquit,
  kKill,  // the user asked for it now (a second Ctrl-C): SIGKILL at once
  kLost,  // the controller is gone: SIGTERM, then SIGKILL within kLostControllerGraceS
  kPassOnUsr1,  // the user's SIGUSR1 / SIGUSR2, for each worker (not a stop)
  kPassOnUsr2,
};
// The stop that sends the workers `sig` (SIGINT, SIGHUP, SIGQUIT; anything else is kStop, SIGTERM),
// and back: the signal of a stop action, 0 for an action that is no graceful stop.
ControlAction stopAction(int sig);
int stopActionSignal(ControlAction a);
inline constexpr double kLostControllerGraceS = 2.0;

// The defaults are `dtrain run` on one node: output to the console and log files.
struct LocalRunOptions {
  // Agent mode: every worker line goes here instead of the console and the log files
  // (status lines included, unfiltered).
  std::function<void(const WorkerSlot&, bool is_err, std::string_view line)> line_sink;
  // Polled with the workers; when readable, on_control() says what to do.
  int control_fd = -1;
  std::function<ControlAction()> on_control;
  // Called as each worker ends, with its output so far drained (stderr tail, error file).
  std::function<void(const WorkerExit&)> on_exit;
  int restart_count = 0;
  // Agent mode: give each worker one pipe for stdout and stderr (lines keep their order and
  // all go to line_sink as stdout), because the launcher's console has them as one file.
  bool merge_output = false;
  // Files of the run's own (the trainer's spec snapshot, its result file) that the caller
  // removes when the run ends: the orphan guard removes them if the launcher is killed.
  std::vector<std::string> remove_if_killed;
  // Agent mode, in a round of several nodes: peers on other hosts wait in the same
  // collectives. A worker blocked there goes silent at the same moment as a stopped or hung
  // rank on another host, and this launcher sees only its own workers; so a pick that is not
  // stopped is killed only after watchdogDeferS(worker_timeout_s) more, giving the agent
  // that holds the culprit (stopped: killed at worker_timeout_s) time to act first and the
  // job's teardown time to stop the others.
  bool other_nodes = false;
  // Descriptors every worker inherits, each named to it by an environment variable (name,
  // fd): the trainer's data image, DTRAIN_DATA_FD (docs/trainer.md, "Data").
  std::vector<std::pair<std::string, int>> inherit_fds;
  // The OMP_NUM_THREADS default said so far ("" = none), kept by the caller across attempts:
  // the first attempt says it, a later one only when it changed (a CPU quota changed between
  // attempts), and updates it. Null: said by the first attempt only.
  std::string* omp_said = nullptr;
};

// The extra silence an agent in a round of several nodes allows a worker that is not
// stopped (LocalRunOptions::other_nodes): a quarter of the timeout, 2 s to 30 s.
inline double watchdogDeferS(double workerTimeoutS) {
  return std::clamp(workerTimeoutS * 0.25, 2.0, 30.0);
}

std::unique_ptr<Launcher> makeLocalLauncher(LocalRunOptions opts = {});

// How a worker ended, for a restart event's reason: "exited with code 3", "killed by SIGKILL",
// "hung"; a failure with a TORCHELASTIC_ERROR_FILE adds its message's first line, at most
// kExitReasonMessageMax bytes: "exited with code 1 (ValueError: lr must be positive)".
inline constexpr size_t kExitReasonMessageMax = 160;
std::string exitReason(const WorkerExit& w);

// The failure that caused the others: `first` (an index into workers, the first failure
// reaped) unless it only lost a peer. A rank whose collective failed because a peer died says
// so ("allreduce on rank 1: lost rank 0: ...", in its error file or stderr); when that peer
// failed too, on its own (not stopped by dtrain), the peer is the cause, whichever exit was
// reaped first (a SIGKILLed worker with a thread in fsync is reaped after its peers noticed
// its closed sockets). Followed along a chain of such ranks; -1 stays -1.
int rootCause(const std::vector<WorkerExit>& workers, int first);

// The signal a worker died of, or N when it exited 128 + N (as a shell or dtrain train does
// when it ends on a signal); 0 otherwise.
int endedBySignal(const WorkerExit& w);

// A scheduler ending a job signals every process of it (Slurm's scancel and time limit, a
// cgroup's kill), dtrain and its workers in no set order. A worker that dies of it at once
// (Python's default SIGTERM) is reaped before dtrain reads its own signal: when that signal
// comes within this window of the death, the two are one stop, not a failure and a restart.
inline constexpr auto kOutsideStopWindow = std::chrono::milliseconds(500);

// SIGTERM, SIGINT or SIGHUP a worker ended by (endedBySignal) that dtrain did not send it;
// 0 otherwise.
int outsideStopSignal(const WorkerExit& w);

// A failure no restart can help (start_failed, refused_input): the job ends at once with its
// code instead of spending the restart budget on attempts that would fail the same way.
inline bool restartCannotHelp(const WorkerExit& w) { return w.start_failed || w.refused_input; }

// Why a job whose first failure is one of restartCannotHelp's ends without a restart.
// `host` is named when not "".
std::string notRestartedReason(const WorkerExit& w, const spec::JobSpec& spec, const std::string& host = "");

// The failure summary printed when a worker fails; after a signal that cut a restart short
// (stopped_during), one headline for both (the stop and the failure it was restarting from).
std::string formatFailure(const RunResult& result, const spec::JobSpec& spec);

}  // namespace dtrain::launch
