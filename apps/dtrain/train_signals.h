#pragma once
// The signals of `dtrain train` (docs/job-spec.md, "Checkpoints"; README, "Signals"):
// - SIGUSR1, SIGUSR2 (Slurm's --signal=USR1@120, passed on by dtrain run): a checkpoint at
//   the next step boundary the ranks agree on, and training goes on.
// - SIGTERM, SIGINT, SIGHUP (dtrain's teardown, a scheduler's time limit): a final checkpoint
//   at the next agreed boundary, then exit 128 + the signal, which the launcher counts as
//   stopped by dtrain. A second SIGINT (Ctrl-C twice, run by hand) exits at once.
//
// The handlers only store the request in a train::TrainControl and wake a watcher thread
// through a pipe. The signals are blocked in the thread that installs them and so in every
// thread started after it (the communicator's, the loader's, OpenBLAS's, which is loaded on
// first use): no system call of the communicator or the store is cut short by one (a poll()
// failing with EINTR would be a lost peer). The watcher takes them.
//
// The watcher bounds a stop, so that a teardown never waits for the communicator's timeout:
// - before the first step and after the last (the last checkpoint durable): exit at once
//   (after the last: with the run's last words, TrainControl::on_stop_while_finishing);
// - in the steps: if no agreement is reached within 2 s + 2 x the time between agreements
//   (a peer that does not answer: stopped, hung), exit without a final checkpoint, once any
//   checkpoint write in progress has finished;
// - while the final checkpoint is written: exit at shutdown_timeout_s - 1 s at the latest,
//   just before the launcher's SIGKILL.
// Every exit is 128 + the first stop signal, with one line on stderr when a bound cut it
// short.
#include <chrono>

#include "dtrain/train/trainer.h"

namespace dtrain::app {

class TrainSignals {
 public:
  // Installs the handlers and starts the watcher; at most one per process, living until it
  // exits (the handlers stay installed).
  explicit TrainSignals(train::TrainControl& control);
  TrainSignals(const TrainSignals&) = delete;
  TrainSignals& operator=(const TrainSignals&) = delete;

  // The launcher's grace period (the job's shutdown_timeout_s): the bound of a final checkpoint.
  void setGraceSeconds(double s);
  // The stop signal this process received (0: none), waiting up to `max` for one.
  int waitForStop(std::chrono::milliseconds max) const;

 private:
  train::TrainControl& control_;
};

}  // namespace dtrain::app
