#include "checkpoint_writer.h"

#include <chrono>

namespace dtrain::train::detail {

CheckpointWriter::CheckpointWriter(bool async, std::function<void()> heartbeat,
                                   std::function<void(const std::string&)> warn)
    : async_(async), heartbeat_(std::move(heartbeat)), warn_(std::move(warn)) {}

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
  if (!async_) {
    path_ = job(heartbeat_ ? heartbeat_ : std::function<void()>{}, warn_ ? warn_ : std::function<void(const std::string&)>{});
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
  if (err) std::rethrow_exception(err);
  return path;
}

}  // namespace dtrain::train::detail
