#pragma once
#include <memory>
#include <string>

#include "dtrain/launch/launcher.h"
#include "dtrain/spec/job_spec.h"

namespace dtrain::store {
class TcpStoreServer;
}

namespace dtrain::launch {

namespace detail {
class SignalScope;
}

// The stop signals (SIGINT, SIGTERM, SIGHUP) caught and kept, not acted on, while it lives:
// for `dtrain run`'s pre-flight (the spec, its data files, the checkpoint directory), where
// their default action would end dtrain before it wrote the run's summary, leaving an earlier
// run's in place. The caller asks stopSignal() between its steps and ends the run by the
// signal, before any worker starts. The launch's own handling nests inside it (a signal that
// comes just before the launch is the launch's to handle). SIGUSR1/SIGUSR2 are dropped, with
// a notice: no worker runs yet to take them. SIGHUP ignored at the start stays ignored
// (nohup), as in a launch.
class HeldStopSignals {
 public:
  HeldStopSignals();
  ~HeldStopSignals();
  HeldStopSignals(const HeldStopSignals&) = delete;
  HeldStopSignals& operator=(const HeldStopSignals&) = delete;
  // The first stop signal that came so far (asked again, the same), 0 when none did.
  int stopSignal();
  // The handlers dtrain had before, back; a signal from now on takes its default action, and
  // one held and not asked for is dropped. For a write that may block for good (a FIFO no one
  // reads), which Ctrl-C must still end, and for the end of the run.
  void release();

 private:
  std::unique_ptr<detail::SignalScope> scope_;
  int got_ = 0;
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
// remove_if_killed: files of the run's own that the caller removes at its end (see
// LocalRunOptions).
RunResult runLocalJob(spec::JobSpec& spec, const std::string& run_id, const std::vector<std::string>& remove_if_killed = {});

}  // namespace dtrain::launch
