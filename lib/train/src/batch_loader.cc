#include "batch_loader.h"

#include <algorithm>
#include <atomic>
#include <functional>
#include <utility>

#include "dtrain/common/errors.h"
#include "dtrain/common/signal_mask.h"

namespace dtrain::train::detail {

// A fixed set of threads that, with the thread calling run(), split [0, n) into chunks and
// call fn on each. One run() at a time (the loading thread's); the helpers sleep in between.
class BatchLoader::Helpers {
 public:
  explicit Helpers(int n) {
    AllSignalsBlocked blocked;  // signals are the worker's main thread's business
    try {
      for (int i = 0; i < n; ++i) threads_.emplace_back([this] { loop(); });
    } catch (...) {
      // (a thread refused, EAGAIN under a pids limit: the ones started must be joined before
      // the members they wait on go, or destroying wake_ waits for them for good)
      stopAll();
      throw;
    }
  }
  ~Helpers() { stopAll(); }
  Helpers(const Helpers&) = delete;
  Helpers& operator=(const Helpers&) = delete;

  // Returns when every chunk is done; rethrows the first exception a chunk threw (the chunks
  // not yet started are then skipped).
  void run(size_t n, const std::function<void(size_t, size_t)>& fn) {
    {
      std::lock_guard<std::mutex> l(mu_);
      fn_ = &fn;
      n_ = n;
      // ~4 chunks per thread: an unlucky (preempted) thread holds up the batch by one chunk.
      chunk_ = std::max<size_t>(1, n / ((threads_.size() + 1) * 4));
      next_.store(0);
      busy_ = threads_.size();
      error_ = nullptr;
      ++generation_;
    }
    wake_.notify_all();
    work();
    std::unique_lock<std::mutex> l(mu_);
    done_.wait(l, [&] { return busy_ == 0; });
    fn_ = nullptr;
    if (error_) std::rethrow_exception(error_);
  }

 private:
  void stopAll() {
    {
      std::lock_guard<std::mutex> l(mu_);
      stop_ = true;
    }
    wake_.notify_all();
    for (auto& t : threads_) t.join();
  }
  void work() {
    while (true) {
      const size_t b = next_.fetch_add(chunk_);
      if (b >= n_) return;
      try {
        (*fn_)(b, std::min(n_, b + chunk_));
      } catch (...) {
        std::lock_guard<std::mutex> l(mu_);
        if (!error_) error_ = std::current_exception();
        next_.store(n_);
      }
    }
  }
  void loop() {
    uint64_t seen = 0;
    while (true) {
      {
        std::unique_lock<std::mutex> l(mu_);
        wake_.wait(l, [&] { return stop_ || generation_ != seen; });
        if (stop_) return;
        seen = generation_;
      }
      // fn_, n_ and chunk_ were set before generation_ under mu_, and stay until busy_ is 0.
      work();
      std::lock_guard<std::mutex> l(mu_);
      if (--busy_ == 0) done_.notify_one();
    }
  }

  std::vector<std::thread> threads_;
  std::mutex mu_;
  std::condition_variable wake_, done_;
  const std::function<void(size_t, size_t)>* fn_ = nullptr;
  size_t n_ = 0, chunk_ = 1, busy_ = 0;
  std::atomic<size_t> next_{0};
  uint64_t generation_ = 0;
  bool stop_ = false;
  std::exception_ptr error_;
};

BatchLoader::BatchLoader(Options o) : o_(o) {
  DTRAIN_CHECK(o_.set != nullptr && o_.batch > 0 && o_.threads >= 1);
  const int helpers = std::min(o_.threads, o_.batch) - 1;
  if (helpers > 0) helpers_ = std::make_unique<Helpers>(helpers);
  if (o_.background) {
    AllSignalsBlocked blocked;
    thread_ = std::thread([this] { run(); });
  }
}

BatchLoader::~BatchLoader() {
  if (!thread_.joinable()) return;
  {
    std::lock_guard<std::mutex> l(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void BatchLoader::request(std::vector<uint64_t> indices) {
  DTRAIN_CHECK(pending_ < 2 && indices.size() == static_cast<size_t>(o_.batch));
  Slot& s = slots_[(head_ + pending_) % 2];
  ++pending_;
  s.batch.indices = std::move(indices);
  s.error = nullptr;
  if (!o_.background) {
    s.ready = false;
    return;
  }
  {
    std::lock_guard<std::mutex> l(mu_);
    s.ready = false;
    queue_.push_back(&s);
  }
  cv_.notify_all();
}

const BatchLoader::Batch& BatchLoader::take() {
  DTRAIN_CHECK(pending_ > 0);
  Slot& s = slots_[head_];
  head_ = (head_ + 1) % 2;
  --pending_;
  if (!o_.background) {
    load(s);
  } else {
    std::unique_lock<std::mutex> l(mu_);
    cv_.wait(l, [&] { return s.ready; });
  }
  if (s.error) std::rethrow_exception(s.error);
  return s.batch;
}

void BatchLoader::load(Slot& s) const {
  const size_t B = static_cast<size_t>(o_.batch), in = static_cast<size_t>(o_.inputs);
  const size_t yw = o_.mse ? static_cast<size_t>(o_.outputs) : 1;
  s.batch.x.resize(o_.wantX ? B * in : 0);
  s.batch.y.resize(o_.wantY ? B * yw : 0);
  if (helpers_)
    helpers_->run(B, [&](size_t begin, size_t end) { loadRows(s, begin, end); });
  else
    loadRows(s, 0, B);
}

void BatchLoader::loadRows(Slot& s, size_t begin, size_t end) const {
  const size_t in = static_cast<size_t>(o_.inputs);
  const size_t yw = o_.mse ? static_cast<size_t>(o_.outputs) : 1;
  std::vector<float> xs(o_.wantX ? 0 : in), ys(o_.wantY || !o_.mse ? 0 : yw);
  for (size_t i = begin; i < end; ++i) {
    int label = 0;
    float* x = o_.wantX ? s.batch.x.data() + i * in : xs.data();
    float* y = o_.mse ? (o_.wantY ? s.batch.y.data() + i * yw : ys.data()) : nullptr;
    o_.set->sample(s.batch.indices[i], x, &label, y);
    if (o_.wantY && !o_.mse) s.batch.y[i] = static_cast<float>(label);
  }
}

void BatchLoader::run() {
  while (true) {
    Slot* s = nullptr;
    {
      std::unique_lock<std::mutex> l(mu_);
      cv_.wait(l, [&] { return stop_ || !queue_.empty(); });
      if (stop_) return;  // nobody will take what is queued
      s = queue_.front();
    }
    // The slot is the loader's until it is marked ready: the owner neither reads nor
    // re-requests it before take() has seen ready.
    try {
      load(*s);
    } catch (...) {
      s->error = std::current_exception();
    }
    {
      std::lock_guard<std::mutex> l(mu_);
      queue_.pop_front();
      s->ready = true;
    }
    cv_.notify_all();
  }
}

}  // namespace dtrain::train::detail
