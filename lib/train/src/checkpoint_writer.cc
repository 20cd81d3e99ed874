#include "checkpoint_writer.h"

#include <fcntl.h>

#include <chrono>

#include <fmt/format.h>

#include "dtrain/common/files.h"

namespace dtrain::train::detail {

std::string checkpointDirRemovedRefusal(const std::string& dir) {
  return fmt::format(
      "trainer: /trainer/checkpoint/dir: {} was removed while this job ran; the checkpoints in it are gone, and "
      "making it again would pass by the lock that keeps one job per directory (another job may hold it by now): "
      "run the job again to start over in it, or set another /trainer/checkpoint/dir",
      dir);
}

CheckpointWriter::CheckpointWriter(bool async, std::function<void()> heartbeat,
                                   std::function<void(const std::string&)> warn, std::string root)
    : async_(async), heartbeat_(std::move(heartbeat)), warn_(std::move(warn)), root_(std::move(root)) {
  checkRoot();
}

std::string CheckpointWriter::rootProblem() const {
  if (root_.empty() || !rootFd_) return "";
  // (against the directory held open: the fd keeps the inode and its mount alive, so a FUSE
  // or autofs file system cannot hand it a new number and look like another directory)
  switch (pathStillNames(rootFd_, root_)) {
    case PathHold::kSame:
      return "";
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
  return "";
}

void CheckpointWriter::checkRoot() {
  if (const std::string why = rootProblem(); !why.empty()) throw SpecError(why);
  // (not there yet: the first save makes it, and the next check holds it)
  if (!rootFd_ && !root_.empty()) rootFd_ = Fd(::open(root_.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
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
      path_ = job(heartbeat_ ? heartbeat_ : std::function<void()>{},
                  warn_ ? warn_ : std::function<void(const std::string&)>{});
    } catch (const SpecError&) {
      rethrowAsRootProblem();
      throw;
    }
    return;
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
  thread_ = std::thread([this, job = std::move(job)] {
    std::string path;
    std::exception_ptr err;
    try {
      path = job(
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
  return path;
}

void CheckpointWriter::rethrowAsRootProblem() const {
  // A write that failed because the directory went away under it (its rename found no
  // file: ENOENT) is that, not a full disk with "the checkpoints written there before intact".
  if (const std::string why = rootProblem(); !why.empty()) throw SpecError(why);
}

}  // namespace dtrain::train::detail
