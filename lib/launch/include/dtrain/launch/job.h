#pragma once
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "dtrain/launch/launcher.h"
#include "dtrain/spec/job_spec.h"

namespace dtrain::store {
class TcpStoreServer;
}

namespace dtrain::launch {

namespace detail {
class SignalScope;
}

// The back-off before a restart: `base_s` doubled `doublings` times, at most `cap_s`; 0 for
// a base of 0 however many restarts (2^1024 is infinite, and 0 x infinity NaN, which
// std::min took for the cap: restart 1025 of a no-back-off job waited 60 s).
double restartBackoffS(double base_s, int doublings, double cap_s);

// The stop signals (SIGINT, SIGTERM, SIGHUP) caught and kept, not acted on, while it lives:
// for `dtrain run`'s pre-flight (the spec, its data files, the checkpoint directory), where
// their default action would end dtrain before it wrote the run's summary, leaving an earlier
// run's in place. The caller asks stopSignal() between its steps and ends the run by the
// signal, before any worker starts. The launch's own handling nests inside it (a signal that
// comes just before the launch is the launch's to handle). SIGUSR1/SIGUSR2 are dropped, with
// a notice: no worker runs yet to take them. SIGHUP ignored at the start stays ignored
// (nohup), as in a launch.
//
// A step that blocks for good (a spec given as a FIFO no one writes, a data file on a hung
// NFS mount, a terminal stopped with Ctrl-S) never reaches the next step, so the signal
// would never be acted on. Until endPreflight() (or release()), therefore:
// - a second stop signal (any of the three) ends dtrain at once by that signal's default
//   action, as if it had not been caught (killed by it: a shell's 128 + the signal); an echo
//   of the first is not a second (the same signal within 0.1 s, SIGHUP or from the same
//   sending process: timeout(1) signals dtrain and then its own process group);
// - a stop signal held kHeldStopGraceS without being asked for (stopSignal) ends dtrain the
//   same way, by that first signal: one SIGTERM (timeout(1), a scheduler's) must end a run
//   that blocked before its launch.
// Either way nothing that can block is written: no summary (a --summary-json file still says
// "running", as after a SIGKILL), only one line on stderr, and only if stderr can take it at
// once. All of it happens in the signal handlers (async-signal-safe calls only): the thread
// that would act on the signal is the one blocked.
class HeldStopSignals {
 public:
  // Longer than a pre-flight step takes on ordinary inputs, shorter than the SIGKILL grace of
  // the schedulers that send SIGTERM first (Kubernetes' 30 s, Slurm's KillWait 30 s,
  // systemd's 90 s), so that dtrain ends by the SIGTERM. A step that can go on longer polls
  // stopSignal() as it goes (the launcher's parse of a data file of several GB, ~1.5 s per
  // 300 MB here, every 65536 rows or 4 MiB) and ends with the summary; one that cannot is cut short.
  static constexpr unsigned kHeldStopGraceS = 10;

  HeldStopSignals();
  ~HeldStopSignals();
  HeldStopSignals(const HeldStopSignals&) = delete;
  HeldStopSignals& operator=(const HeldStopSignals&) = delete;
  // The first stop signal that came so far (asked again, the same), 0 when none did. The
  // caller that gets one ends the run; the rules above apply until it releases them.
  int stopSignal();
  // The launch begins: a stop signal from now on is held for it (the launch's scopes read what
  // this one holds), and neither rule above applies any more.
  void endPreflight();
  // Whether endPreflight() was called: the job was launched.
  bool launched() const { return launched_; }
  // Calls onStop for each stop signal held and not yet returned by stopSignal() (nor given
  // to onStop before), SIGUSR1/SIGUSR2 dropped: for the end of a run, which says them.
  template <typename F>
  void takeUnasked(F&& onStop) {
    drain(false);
    for (; reported_ < held_.size(); ++reported_) onStop(held_[reported_]);
  }
  // The handlers dtrain had before, back; a signal from now on takes its default action, and
  // one held and not asked for is dropped. For the end of the run (whose caller blocks the
  // signals first).
  void release();

 private:
  // Moves what the scope's pipe holds into held_; SIGUSR1/SIGUSR2 said (sayPassedOn) or not.
  void drain(bool sayPassedOn);
  std::unique_ptr<detail::SignalScope> scope_;
  std::vector<int> held_;  // the stop signals that came, in order
  size_t reported_ = 0;    // held_[0, reported_) were returned or given to onStop
  bool launched_ = false;
};

// Starts the job's store on `bind` at spec.rendezvous.port (0 = a free one; the chosen port
// is written back) with a fresh token. A busy configured port is a SpecError naming the
// field. The server serves on its own thread until destroyed.
struct JobStore {
  std::unique_ptr<store::TcpStoreServer> server;
  std::string bind;
  std::string token;
  JobStore();
  JobStore(JobStore&&) noexcept;
  JobStore& operator=(JobStore&&) noexcept;
  ~JobStore();
};
JobStore startJobStore(spec::JobSpec& spec, const std::string& bind);

// Runs a resolved single-node job: hosts its store on loopback (port spec.rendezvous.port,
// 0 = a free one; the chosen port is written back), launches the workers with the store's
// endpoint and a fresh token in their environment, and waits for them.
struct LocalJobOptions {
  // Files of the run's own that the caller removes at its end (see LocalRunOptions).
  std::vector<std::string> remove_if_killed;
  // Descriptors every worker of every attempt inherits (see LocalRunOptions).
  std::vector<std::pair<std::string, int>> inherit_fds;
  // Called before each attempt after the first (the previous attempt's workers are gone) with
  // that attempt's number; what it returns replaces inherit_fds from then on (a data image
  // made again for data files that changed). Called on the launcher's thread.
  std::function<std::vector<std::pair<std::string, int>>(int attempt)> refresh_fds;
  // Asked before a restart (the failed attempt's workers are gone): a reason not to make it
  // ("" = restart). The job then ends as the failure that would have been restarted, with
  // this reason as its message. Called on the launcher's thread.
  std::function<std::string()> refuse_restart;
};
RunResult runLocalJob(spec::JobSpec& spec, const std::string& run_id, const LocalJobOptions& options = {});

}  // namespace dtrain::launch
