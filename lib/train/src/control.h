#pragma once
// The trainers' side of TrainControl (trainer.h): this rank's request offered to the
// agreement, what the agreed value means, and the phase and timing reports. One per train()
// call, on the trainer's thread.
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>

#include "dtrain/comm/communicator.h"
#include "dtrain/common/strings.h"  // signalName
#include "dtrain/train/trainer.h"

namespace dtrain::train::detail {

// A rank's offer as one int32 (the max over ranks is the agreed one): a stop is
// (2 << 24) | signal, which wins over any checkpoint; otherwise (checkpoint requests received
// so far << 8) | the last one's signal, so the agreed count is the highest any rank has seen.
enum RequestKind : int32_t { kNoRequest = 0, kCheckpointRequest = 1, kStopRequest = 2 };
inline constexpr int32_t kMaxRequestCount = 0xffff;  // (counts saturate here)
inline int32_t encodeStop(int signal) { return (kStopRequest << 24) | (signal & 0xff); }
inline int32_t encodeCheckpoints(int count, int signal) {
  return count <= 0 ? 0 : (std::min(count, kMaxRequestCount) << 8) | (signal & 0xff);
}
inline bool isStop(int32_t offer) { return (offer >> 24) == kStopRequest; }
inline int requestCount(int32_t offer) { return isStop(offer) ? 0 : (offer >> 8) & kMaxRequestCount; }
inline int requestSignal(int32_t offer) { return offer & 0xff; }

// This rank's offer.
inline int32_t offerOf(const TrainControl& c) {
  if (int s = c.stop.load(); s != 0) return encodeStop(s);
  return encodeCheckpoints(c.checkpoint_requests.load(), c.checkpoint_signal.load());
}

// A trainer's agreement points and reports. Without a TrainControl every call is a no-op and
// no collective is issued (the same on every rank: TrainOptions::control is set on all or
// none). Two ways to agree, the same on every rank:
// - overlapped (a host communicator: tcp, shared memory): at the end of every step the
//   request is offered by an asynchronous max all-reduce of one int32, and the agreed value
//   is read at the end of the next step, where it is acted on. The trainer's thread never
//   waits for it: the operation runs on the communicator's thread, ordered before the next
//   step's gradient all-reduces (which wait for the slower rank anyway), so it adds no
//   synchronisation point of its own. A request takes effect one step later.
// - blocking (NCCL): every `period` steps a blocking all-reduce through device memory (a copy
//   there and back that waits for the step's queued work): so only every
//   kControlPeriodOnDevice steps.
class ControlPoints {
 public:
  ControlPoints(TrainControl* c, bool overlapped, int period)
      : c_(c), overlapped_(overlapped), period_(overlapped || period < 1 ? 1 : period) {}
  ~ControlPoints() {
    // (an operation still in flight when an error unwinds the trainer writes into offer_)
    if (pending_) try {
        pending_->wait();
      } catch (...) {
      }
  }
  ControlPoints(const ControlPoints&) = delete;
  ControlPoints& operator=(const ControlPoints&) = delete;

  int period() const { return period_; }
  void phase(TrainControl::Phase p) {
    if (c_) c_->phase.store(p);
  }
  void stepStarted() {
    if (c_) started_ = std::chrono::steady_clock::now();
  }
  // What to do now, at the end of a step.
  struct Request {
    RequestKind kind = kNoRequest;
    int signal = 0;
  };
  // At the end of a step, `step` steps done (`last`: the final one): the agreed request to
  // act on now. startAsync(int32_t*) -> comm::WorkPtr starts the overlapped all-reduce (max)
  // on the buffer; blocking(int32_t*) runs the blocking one. Every rank calls this at every
  // step, and sees the same request.
  template <typename StartAsync, typename Blocking>
  Request agree(long long step, bool last, StartAsync&& startAsync, Blocking&& blocking) {
    if (!c_) return {};
    const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - started_);
    c_->boundary_ms.store(static_cast<long long>(period_ + (overlapped_ ? 1 : 0)) * ms.count());
    if (!overlapped_) {
      if (step % period_ != 0) return {};
      int32_t r = offerOf(*c_);
      blocking(&r);
      return decide(r);
    }
    Request now;
    if (pending_) {
      auto w = std::move(pending_);
      w->wait();  // (done long ago: it ran before this step's gradient all-reduces)
      now = decide(offer_);
    }
    // The next one, unless none will be read: after the last step, or a stop acted on now
    // (every rank knows both).
    if (!last && now.kind != kStopRequest) {
      offer_ = offerOf(*c_);
      pending_ = startAsync(&offer_);
    }
    return now;
  }
  // Counts a checkpoint write in progress (inline or on the writer's thread), for the watcher
  // that must not cut one short: held by the write's job from before it starts until it is
  // destroyed.
  struct Write {
    explicit Write(TrainControl* c) : c_(c) {
      if (c_) c_->writes.fetch_add(1);
    }
    ~Write() {
      if (c_) c_->writes.fetch_sub(1);
    }
    Write(const Write&) = delete;
    Write& operator=(const Write&) = delete;
    TrainControl* c_;
  };
  TrainControl* control() const { return c_; }

 private:
  // The agreed offer as a request: a stop, or a checkpoint when the agreed count is past the
  // ones acted on (the same on every rank: they all see the same agreed offers).
  Request decide(int32_t agreed) {
    if (isStop(agreed)) return {kStopRequest, requestSignal(agreed)};
    const int count = requestCount(agreed);
    if (count <= handled_) return {};
    handled_ = count;
    return {kCheckpointRequest, requestSignal(agreed)};
  }

  TrainControl* c_;
  bool overlapped_;
  int period_;
  int handled_ = 0;  // checkpoint requests acted on
  int32_t offer_ = 0;
  comm::WorkPtr pending_;
  std::chrono::steady_clock::time_point started_ = std::chrono::steady_clock::now();
};

// Enters kFinishing with `words` as the run's last words should a stop end the evaluation
// (TrainControl::on_stop_while_finishing), for as long as it lives: declared after what
// `words` refers to, it takes them back (under the lock the watcher calls them under) before
// that is gone.
class FinishingWords {
 public:
  FinishingWords(ControlPoints& points, std::function<void()> words) : c_(points.control()) {
    if (c_) {
      std::lock_guard<std::mutex> lk(c_->finishing_mu);
      c_->on_stop_while_finishing = std::move(words);
    }
    points.phase(TrainControl::kFinishing);
  }
  ~FinishingWords() {
    if (!c_) return;
    std::lock_guard<std::mutex> lk(c_->finishing_mu);
    c_->on_stop_while_finishing = nullptr;
  }
  FinishingWords(const FinishingWords&) = delete;
  FinishingWords& operator=(const FinishingWords&) = delete;

 private:
  TrainControl* c_;
};

}  // namespace dtrain::train::detail
