#pragma once
// The trainers' small host-side collectives (resume headers, statistics, weight hashes, the
// clipping norm, the whole-model gather): host buffers in, host buffers out. A communicator
// that takes device pointers (NCCL) gets them through the backend's scratch memory; the
// others use the host buffers directly. Thread-safety: that of the communicator and the
// staging backend (one trainer thread).
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "dtrain/comm/communicator.h"
#include "dtrain/train/backend.h"

namespace dtrain::train::detail {

class HostCollectives {
 public:
  HostCollectives(comm::Communicator& c, DeviceStaging& staging)
      : c_(c), staging_(staging), device_(std::string(c.backend()) == "nccl") {}

  comm::Communicator& communicator() { return c_; }
  // True when the communicator takes device pointers.
  bool onDevice() const { return device_; }

  void broadcast(void* data, size_t count, comm::DataType t, int root) {
    inPlace(data, count * comm::elementSize(t), [&](void* d) { c_.broadcast(d, count, t, root); });
  }
  void allreduce(void* data, size_t count, comm::DataType t, comm::ReduceOp op) {
    inPlace(data, count * comm::elementSize(t), [&](void* d) { c_.allreduce(d, count, t, op); });
  }
  // As allreduce, calling `alive` (the worker's heartbeat) while it waits: a rank done with
  // its share of the evaluation waits here for the slowest, silent, as long as that rank's
  // lag (over worker_timeout_s under load: the job was killed as hung).
  void allreduceAlive(void* data, size_t count, comm::DataType t, comm::ReduceOp op, const std::function<void()>& alive) {
    if (!alive) return allreduce(data, count, t, op);
    inPlace(data, count * comm::elementSize(t), [&](void* d) {
      comm::WorkPtr w = c_.allreduceAsync(d, count, t, op);
      for (auto nap = std::chrono::microseconds(200); !w->test(); nap = std::min(nap * 2, std::chrono::microseconds(20000))) {
        alive();
        std::this_thread::sleep_for(nap);
      }
      w->wait();
    });
  }
  void allgather(const void* send, void* recv, size_t count, comm::DataType t) {
    if (!device_) return c_.allgather(send, recv, count, t);
    const size_t bytes = count * comm::elementSize(t);
    char* d = static_cast<char*>(staging_.scratch(bytes * (1 + static_cast<size_t>(c_.size()))));
    staging_.copyToBackend(d, send, bytes);
    c_.allgather(d, d + bytes, count, t);
    staging_.copyToHost(recv, d + bytes, bytes * static_cast<size_t>(c_.size()));
  }
  void send(const void* data, size_t bytes, int peer) {
    if (!device_) return c_.send(data, bytes, peer);
    void* d = staging_.scratch(bytes);
    staging_.copyToBackend(d, data, bytes);
    c_.send(d, bytes, peer);
  }
  void recv(void* data, size_t bytes, int peer) {
    if (!device_) return c_.recv(data, bytes, peer);
    void* d = staging_.scratch(bytes);
    c_.recv(d, bytes, peer);
    staging_.copyToHost(data, d, bytes);
  }

 private:
  // An in-place operation on `bytes` of host data: on the data itself, or on a device copy
  // that is copied back.
  template <typename Op>
  void inPlace(void* data, size_t bytes, Op&& op) {
    if (!device_) return op(data);
    void* d = staging_.scratch(bytes);
    staging_.copyToBackend(d, data, bytes);
    op(d);
    staging_.copyToHost(data, d, bytes);
  }

  comm::Communicator& c_;
  DeviceStaging& staging_;
  bool device_;
};

// Rank `root`'s text on every rank, through `broadcast(words, count)` (an int64 broadcast
// from root): a refusal that every rank throws with root's detail, so that whichever rank
// exits first, the job's headline has it (a rank that said only "rank 0 names it" could end
// first, and rank 0 be stopped before it said its own).
template <typename Broadcast>
std::string shareText(const std::string& text, Broadcast&& broadcast) {
  int64_t n = static_cast<int64_t>(text.size());
  broadcast(&n, size_t{1});
  std::vector<int64_t> words((static_cast<size_t>(n) + 7) / 8);
  std::memcpy(words.data(), text.data(), std::min(text.size(), static_cast<size_t>(n)));
  if (!words.empty()) broadcast(words.data(), words.size());
  std::string out(static_cast<size_t>(n), '\0');
  std::memcpy(out.data(), words.data(), out.size());
  return out;
}

}  // namespace dtrain::train::detail
