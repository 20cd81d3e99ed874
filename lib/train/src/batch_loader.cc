#include "batch_loader.h"

#include <utility>

#include "dtrain/common/errors.h"

namespace dtrain::train::detail {

BatchLoader::BatchLoader(Options o) : o_(o) {
  DTRAIN_CHECK(o_.set != nullptr && o_.batch > 0);
  if (o_.background) thread_ = std::thread([this] { run(); });
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
  std::vector<float> xs(o_.wantX ? 0 : in), ys(o_.wantY || !o_.mse ? 0 : yw);
  for (size_t i = 0; i < B; ++i) {
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
