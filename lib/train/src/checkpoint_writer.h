#pragma once
// Writes the trainer's checkpoints inline or, with trainer.checkpoint.async, on a thread of
// its own, so that training goes on while a checkpoint's bytes reach the disk (and every
// other rank, which would wait for the writer in the next step's collective, goes on too).
//
// Contract:
// - One write at a time. The buffers a write reads (the trainer's host copies of weights and
//   optimizer state) must stay untouched until it is waited for: wait() returns only when the
//   write started last is durable (renamed, directory synced) or has failed.
// - Not thread-safe: one owner thread (the trainer's) calls every method. `heartbeat` and
//   `warn` are called on that thread only: warnings of a background write are handed over by
//   the next wait(), and while wait() blocks on a write that still makes progress it calls
//   `heartbeat` (a write that stalls is a silence the watchdog should see).
// - The destructor waits for a write in flight and drops its error: an exception that unwinds
//   the trainer (a lost peer) still leaves the checkpoint of the last good step on disk.
// - `root`, the job's checkpoint directory (trainer.checkpoint.dir): a write starts only while
//   it is the directory it was when the writer was made (held open from then on). One removed while the job ran ends
//   the job (SpecError, exit 2) instead of being made again by the save: that bypassed the
//   one-job-per-directory lock (a second job then took the directory, resumed from this
//   one's files, and each pruned the other's).
#include <condition_variable>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "dtrain/common/errors.h"
#include "dtrain/common/fd.h"
#include "dtrain/train/checkpoint.h"

namespace dtrain::train::detail {

class CheckpointWriter {
 public:
  // Writes the checkpoint, calling `progress` as bytes go out and `warn` for each warning;
  // returns the path written. `rootFd`: `root` held open (-1 when there is none yet), for
  // writes through it: a directory swapped in under root's name between the check before
  // the write and the write gets none of its files.
  using Job = std::function<std::string(int rootFd, const std::function<void()>& progress,
                                        const std::function<void(const std::string&)>& warn)>;

  CheckpointWriter(bool async, std::function<void()> heartbeat, std::function<void(const std::string&)> warn,
                   std::string root = "");
  ~CheckpointWriter();
  CheckpointWriter(const CheckpointWriter&) = delete;
  CheckpointWriter& operator=(const CheckpointWriter&) = delete;

  // Waits for the previous write (rethrowing its error), then starts `job`: on the thread
  // when async, else here, before returning.
  // Throws SpecError, and starts nothing, when `root` was removed (or removed and made again).
  void start(Job job);
  // Waits for the write started last; returns its path ("" when none was started since the
  // last wait) and rethrows its error. A write that completed in `root` after it was removed
  // or replaced (the file is where the held directory went, not at the path) is that refusal.
  std::string wait();
  bool async() const { return async_; }
  // `root` held open (-1 while it has not been seen): for the writes beside the job's
  // (a pipeline's manifest), through it as the job's are.
  int rootFd() const { return rootFd_.get(); }

 private:
  void flushWarnings();
  // "" while `root` is the directory it was (or was never there), and its lock file the one
  // it was (or was never there), else the refusal.
  std::string rootProblem() const;
  void checkRoot();
  void rethrowAsRootProblem() const;
  std::string lockPath() const;

  const bool async_;
  std::function<void()> heartbeat_;
  std::function<void(const std::string&)> warn_;
  std::string root_;
  Fd rootFd_;  // root_ as it was when first seen (O_DIRECTORY): what it must still be
  Fd lockFd_;  // root_/.dtrain.lock as first seen (the job's lock, held by its launcher)
  std::thread thread_;
  std::mutex mu_;
  std::condition_variable cv_;
  // Guarded by mu_.
  bool running_ = false;
  unsigned long long progress_ = 0;
  std::exception_ptr error_;
  std::string path_;
  std::vector<std::string> warnings_;
};

// The refusal for a checkpoint directory removed while the job ran (its write, or the check
// before it, found it gone).
std::string checkpointDirRemovedRefusal(const std::string& dir, const std::string& note = "");

// The trainer's checkpoint job: `view` saved into root/sub (the newest 3 kept), `onBytes` (a
// test hook; may be empty) called after each write of its bytes. `root` is the writer's
// root; `sub` "" (the root itself) or the name of a directory in it (a pipeline stage's),
// made and written through the root's descriptor when the writer holds one. A write that fails (a full disk, a read-only mount) becomes the
// SpecError no attempt gets past (checkpointWriteRefusal). `inFlight` is kept alive until the
// job is destroyed (the trainer's count of writes in flight). `view` refers to buffers the
// caller keeps unchanged until the write is waited for (CheckpointWriter's contract).
CheckpointWriter::Job checkpointJob(std::string root, std::string sub, CheckpointView view,
                                    std::function<void()> onBytes, std::shared_ptr<void> inFlight);

}  // namespace dtrain::train::detail
