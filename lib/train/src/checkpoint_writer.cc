#include "checkpoint_writer.h"

#include <fcntl.h>
#include <sys/stat.h>

#include <chrono>
#include <filesystem>

#include <fmt/format.h>

#include "dtrain/common/files.h"

namespace dtrain::train::detail {

std::string checkpointDirRemovedRefusal(const std::string& dir, const std::string& note) {
  return fmt::format(
      "trainer: /trainer/checkpoint/dir: {} was removed while this job ran{}; the checkpoints in it are gone, and "
      "making it again would pass by the lock that keeps one job per directory (another job may hold it by now): "
      "run the job again to start over in it, or set another /trainer/checkpoint/dir",
      dir, note);
}

CheckpointWriter::CheckpointWriter(bool async, std::function<void()> heartbeat,
                                   std::function<void(const std::string&)> warn, std::string root)
    : async_(async), heartbeat_(std::move(heartbeat)), warn_(std::move(warn)), root_(std::move(root)) {
  checkRoot();
}

std::string CheckpointWriter::rootProblem() const {
  if (root_.empty() || !rootFd_) return "";
  std::error_code ec;
  // (against the directory held open: the fd keeps the inode and its mount alive, so a FUSE
  // or autofs file system cannot hand it a new number and look like another directory)
  const PathHold hold = pathStillNames(rootFd_, root_);
  if ((hold == PathHold::kReplaced || hold == PathHold::kOther) && !std::filesystem::is_directory(root_, ec))
    return checkpointDirRemovedRefusal(root_, " (something that is not a directory has its name now)");
  switch (hold) {
    case PathHold::kSame:
      break;
    case PathHold::kRemoved:
    case PathHold::kMovedAway:
      return checkpointDirRemovedRefusal(root_);
    case PathHold::kReplaced:
      return fmt::format(
          "trainer: /trainer/checkpoint/dir: {} was removed and made again while this job ran (it is another "
          "directory now, perhaps another job's); the checkpoints this job wrote are gone, and writing beside another "
          "job's would mix the two: run the job again, or set another /trainer/checkpoint/dir",
          root_);
    case PathHold::kOther:
      return fmt::format(
          "trainer: /trainer/checkpoint/dir: {} is another directory than when this job started (moved away, and "
          "another put in its place); writing there would pass by the lock that keeps one job per directory: run the "
          "job again, or set another /trainer/checkpoint/dir",
          root_);
  }
  // The lock file removed (it outlives the jobs that held it, and looks stale): a second job
  // could take the directory while this one writes, each pruning and sweeping the other's
  // files. Said at this job's next checkpoint, which it does not write.
  if (lockFd_ && pathStillNames(lockFd_, lockPath()) != PathHold::kSame)
    return fmt::format(
        "trainer: /trainer/checkpoint/dir: {} was removed or replaced while this job ran, so another job may be "
        "writing in {} now: two jobs would overwrite and prune each other's checkpoints; the checkpoints written "
        "before are intact: run the job again once no other job uses the directory, or set another "
        "/trainer/checkpoint/dir (the lock is released when a job ends: leave it alone)",
        lockPath(), root_);
  return "";
}

std::string CheckpointWriter::lockPath() const { return root_ + "/.dtrain.lock"; }

void CheckpointWriter::checkRoot() {
  if (const std::string why = rootProblem(); !why.empty()) throw SpecError(why);
  // (not there yet: the first save makes it, and the next check holds it)
  if (!rootFd_ && !root_.empty()) rootFd_ = Fd(::open(root_.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  // (not there: no job's lock guards the directory, as in a test calling train() itself)
  if (!lockFd_ && rootFd_) lockFd_ = Fd(::open(lockPath().c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK));
}

CheckpointWriter::~CheckpointWriter() {
  try {
    wait();
  } catch (...) {  // the caller is unwinding already, or has returned: nobody to tell
  }
  if (thread_.joinable()) thread_.join();  // (wait() left early: a heartbeat threw)
}

void CheckpointWriter::flushWarnings() {
  std::vector<std::string> ws;
  {
    std::lock_guard<std::mutex> lk(mu_);
    ws.swap(warnings_);
  }
  if (warn_)
    for (const auto& w : ws) warn_(w);
}

void CheckpointWriter::start(Job job) {
  wait();
  checkRoot();
  if (!async_) {
    try {
      path_ = job(rootFd_.get(), heartbeat_ ? heartbeat_ : std::function<void()>{},
                  warn_ ? warn_ : std::function<void(const std::string&)>{});
    } catch (const SpecError&) {
      rethrowAsRootProblem();
      throw;
    }
    return;  // (wait() says a root that moved meanwhile, as for a write in the background)
  }
  {
    std::lock_guard<std::mutex> lk(mu_);
    running_ = true;
    progress_ = 0;
    error_ = nullptr;
    path_.clear();
  }
  struct NotStarted {  // a thread that could not be made (std::system_error): nothing runs
    CheckpointWriter* w;
    bool armed = true;
    ~NotStarted() {
      if (!armed) return;
      std::lock_guard<std::mutex> lk(w->mu_);
      w->running_ = false;
    }
  } guard{this};
  // (the descriptor's number: rootFd_ is not changed before this write is waited for)
  thread_ = std::thread([this, job = std::move(job), rootFd = rootFd_.get()] {
    std::string path;
    std::exception_ptr err;
    try {
      path = job(
          rootFd,
          [this] {
            std::lock_guard<std::mutex> lk(mu_);
            ++progress_;
          },
          [this](const std::string& w) {
            std::lock_guard<std::mutex> lk(mu_);
            warnings_.push_back(w);
          });
    } catch (...) {
      err = std::current_exception();
    }
    std::lock_guard<std::mutex> lk(mu_);
    path_ = std::move(path);
    error_ = err;
    running_ = false;
    cv_.notify_all();
  });
  guard.armed = false;
}

std::string CheckpointWriter::wait() {
  if (thread_.joinable()) {
    std::unique_lock<std::mutex> lk(mu_);
    unsigned long long seen = progress_;
    // A write that goes on is no hang: the owner's watchdog is fed while bytes still move.
    while (!cv_.wait_for(lk, std::chrono::milliseconds(200), [this] { return !running_; })) {
      if (progress_ != seen && heartbeat_) {
        seen = progress_;
        lk.unlock();
        heartbeat_();
        lk.lock();
      }
    }
    lk.unlock();
    thread_.join();
  }
  flushWarnings();
  std::string path;
  std::exception_ptr err;
  {
    std::lock_guard<std::mutex> lk(mu_);
    path.swap(path_);
    err = error_;
    error_ = nullptr;
  }
  if (err) {
    try {
      std::rethrow_exception(err);
    } catch (const SpecError&) {
      rethrowAsRootProblem();
      throw;
    }
  }
  if (!path.empty()) rethrowAsRootProblem();
  return path;
}

void CheckpointWriter::rethrowAsRootProblem() const {
  // A write that failed because the directory went away under it (its rename found no
  // file: ENOENT) is that, not a full disk with "the checkpoints written there before intact".
  if (const std::string why = rootProblem(); !why.empty()) throw SpecError(why);
}

CheckpointWriter::Job checkpointJob(std::string root, std::string sub, CheckpointView view,
                                    std::function<void()> onBytes, std::shared_ptr<void> inFlight) {
  std::string dir = sub.empty() ? root : root + "/" + sub;
  return [dir = std::move(dir), sub = std::move(sub), view = std::move(view), onBytes = std::move(onBytes),
          inFlight = std::move(inFlight)](int rootFd, const std::function<void()>& progress,
                                          const std::function<void(const std::string&)>& warn) {
    const auto bytes = [&] {
      if (progress) progress();
      if (onBytes) onBytes();
    };
    try {
      if (rootFd < 0) return saveCheckpoint(dir, view, 3, warn, bytes);
      if (!sub.empty() && ::mkdirat(rootFd, sub.c_str(), 0777) != 0 && errno != EEXIST)
        throwErrno("checkpoint: cannot create " + dir);
      Fd dirFd(::openat(rootFd, sub.empty() ? "." : sub.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
      if (!dirFd) throwErrno("checkpoint: cannot open " + dir);
      return saveCheckpointAt(dirFd.get(), dir, view, 3, warn, bytes);
    } catch (const IoError& e) {
      throw SpecError(checkpointWriteRefusal(dir, view.step, e.what()));
    }
  };
}

}  // namespace dtrain::train::detail
