#pragma once
// Takes a launcher's workers, and everything they started, with it when the launcher dies.
//
// Each worker runs in its own process group and gets PR_SET_PDEATHSIG, which reaches only the
// worker itself: what it started (a wrapper script's python, a DataLoader's processes) would
// outlive a SIGKILLed launcher, holding GPUs and ports. The guard is a small process (a
// /bin/sh loop named "dtrain-guard", see orphan_guard.cc) started with each run: it reads
// the workers' process groups from a pipe, and when the pipe closes without a release (the
// launcher is gone, however it died) it SIGKILLs every group it still knows, then exits.
// Cost: ~2-3 ms of a 2-worker launch on a 2-vCPU VM (docs/PERFORMANCE.md).
//
// A node's agent keeps one for its whole life too, for its private files alone (the spec
// snapshot it writes before any launcher's guard exists, and keeps between rounds).
//
// Safety: a group is watched only while its leader (the worker) is unreaped, or, in a
// teardown, while the launcher still sees members in it (a wrapper script's python in its
// grace period): a pgid is not reused while its group has a member. The launcher unwatches
// a worker as it reaps it, or once its lingering group is gone. Thread-safety: none; the
// launcher's event loop owns it.
#include <sys/types.h>

#include <set>
#include <string>

#include "dtrain/common/fd.h"

namespace dtrain::launch {

class OrphanGuard {
 public:
  OrphanGuard();  // starts the guard; without one (spawn failed) the calls below do nothing
  // Releases the guard when no group is watched (the run ended cleanly), else lets it kill
  // those left. Does not wait for it to exit.
  ~OrphanGuard();
  OrphanGuard(const OrphanGuard&) = delete;
  OrphanGuard& operator=(const OrphanGuard&) = delete;

  // The guard's pipe, for SpawnOptions::announce_fd (-1 without a guard); then
  // watchAnnounced(pid) for the spawned child, which told the guard itself (the only way a
  // group is watched: a parent's word after the spawn came too late for a kill in between).
  int announceFd() const { return pipe_ ? pipe_.get() : -1; }
  void watchAnnounced(pid_t pgid);
  void unwatch(pid_t pgid);
  // A file or directory of the run's own (a private spec snapshot, the temp dir of the error
  // files) that the launcher removes at its end; the guard removes it (a directory with all
  // it holds) when the launcher dies without that end.
  void removeIfKilled(const std::string& path);

 private:
  void send(const std::string& line);

  pid_t pid_ = -1;
  Fd pipe_;  // write end; its EOF is the guard's signal
  std::set<pid_t> watched_;
};

}  // namespace dtrain::launch
