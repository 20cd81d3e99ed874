#pragma once
// A rank's training batches, loaded one step ahead on a thread of its own (trainer.data.prefetch),
// so that producing batch k + 1 (synthetic samples are computed: a Box-Muller draw per pair of
// inputs and a small matrix product) overlaps step k's compute instead of preceding it. A GPU
// waits for nothing but the copy; a CPU worker gains whatever the machine has beyond its
// compute threads.
//
// Dataset::sample is a pure function of the index, so the batches (and everything trained on
// them) are bit-identical to loading inline, whatever the timing: the loader changes when
// a batch is made, never what it holds.
//
// A batch's samples can be computed by several threads (Options::threads: the loading thread,
// the loader's or the owner's, and threads - 1 helpers, each filling disjoint rows): one
// thread computes ~65k synthetic 784-input samples/s, which starves a GPU step that takes
// ~1.4 ms at batch 1024 (measured on an H200, docs/PERFORMANCE.md).
//
// Thread-safety: one owner thread calls request()/take(); the loader thread and the helpers
// only read the dataset (const and thread-safe: the data sets hold their data in memory) and
// write their own rows of the slot being loaded.
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "dtrain/train/data.h"

namespace dtrain::train::detail {

class BatchLoader {
 public:
  struct Options {
    const Dataset* set = nullptr;
    int batch = 0;           // samples per batch
    int inputs = 0;          // x width
    int outputs = 0;         // the model's output width (MSE targets)
    bool mse = false;        // targets are `outputs` floats per sample, else one label (as a float)
    bool wantX = true;       // false: inputs are not kept (a pipeline's later stages)
    bool wantY = true;       // false: targets are not kept (a pipeline's earlier stages)
    bool background = true;  // false: take() loads on the caller's thread (no loader thread)
    int threads = 1;         // threads computing a batch's samples (the loading one included)
  };
  struct Batch {
    std::vector<uint64_t> indices;  // the dataset indices, in batch order
    std::vector<float> x;           // [batch x inputs], empty unless wantX
    std::vector<float> y;           // [batch x outputs] (MSE) or [batch] labels, empty unless wantY
  };

  explicit BatchLoader(Options o);
  ~BatchLoader();  // stops and joins the thread (a batch being loaded is finished; queued ones are dropped)
  BatchLoader(const BatchLoader&) = delete;
  BatchLoader& operator=(const BatchLoader&) = delete;

  // Queues the batch of these dataset indices (batch of them). At most two are outstanding:
  // the one take() will return next and the one after it.
  void request(std::vector<uint64_t> indices);
  // The oldest requested batch, once loaded (rethrows what loading it threw). The reference
  // stays valid until the next take().
  const Batch& take();
  // Requested and not yet taken.
  size_t pending() const { return pending_; }

 private:
  struct Slot {
    Batch batch;
    bool ready = false;
    std::exception_ptr error;
  };
  class Helpers;
  void load(Slot& s) const;
  void loadRows(Slot& s, size_t begin, size_t end) const;
  void run();

  Options o_;
  std::unique_ptr<Helpers> helpers_;  // threads - 1 of them; null for one thread
  Slot slots_[2];
  size_t head_ = 0, pending_ = 0;  // owner's view: next slot to take, requests not yet taken
  // Shared with the loader thread, under mu_: the slots queued for loading, in order.
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Slot*> queue_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace dtrain::train::detail
