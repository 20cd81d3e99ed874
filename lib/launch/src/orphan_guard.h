#pragma once
// Takes a launcher's workers, and everything they started, with it when the launcher dies.
//
// Each worker runs in its own process group and gets PR_SET_PDEATHSIG, which reaches only the
// worker itself: what it started (a wrapper script's python, a DataLoader's processes) would
// outlive a SIGKILLed launcher, holding GPUs and ports. The guard is a small process forked at
// the start of a run that holds the read end of a pipe from the launcher and knows the
// workers' process groups (a table in shared memory); when the pipe closes without a
// release (the launcher is gone, however it died), it SIGKILLs every group in the table,
// then exits.
//
// Safety: a group is watched only while its leader (the worker) is unreaped, so its ID cannot
// have been reused; the launcher unwatches a worker as it reaps it. Thread-safety: none; the
// launcher's event loop owns it.
#include <sys/types.h>

#include <atomic>

#include "dtrain/common/fd.h"

namespace dtrain::launch::detail {

class OrphanGuard {
 public:
  static constexpr int kMaxGroups = 8192;  // > kMaxProcsPerNode: one group per local worker

  OrphanGuard();  // forks the guard; without one (fork failed) the calls below do nothing
  // Releases the guard when no group is watched (the run ended cleanly), else lets it kill
  // those left; waits for it either way.
  ~OrphanGuard();
  OrphanGuard(const OrphanGuard&) = delete;
  OrphanGuard& operator=(const OrphanGuard&) = delete;

  void watch(pid_t pgid);
  void unwatch(pid_t pgid);

 private:
  pid_t pid_ = -1;
  Fd pipe_;                                  // write end; its EOF is the guard's signal
  std::atomic<pid_t>* groups_ = nullptr;     // shared with the guard; 0 = free slot
};

}  // namespace dtrain::launch::detail
