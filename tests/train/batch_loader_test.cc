// The batch loader (lib/train/src/batch_loader.h) computes a batch's samples on one thread or
// several, inline or one step ahead: what a batch holds is the same whichever, row for row,
// and a sample that throws fails take() for that batch only.
#include "batch_loader.h"

#include <gtest/gtest.h>
#include <sched.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <mutex>
#include <optional>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>

#include "dtrain/spec/job_spec.h"
#include "dtrain/train/data.h"
#include "dtrain/train/device.h"

namespace dtrain::train {
namespace {

// A data set of SyntheticData samples that throws for one index.
class Poisoned final : public Dataset {
 public:
  Poisoned(int in, int out, uint64_t bad) : data_(in, out, 5), bad_(bad) {}
  uint64_t size() const override { return 1u << 20; }
  void sample(uint64_t i, float* x, int* label, float* targets) const override {
    if (i == bad_) throw std::runtime_error("sample " + std::to_string(i) + " is unreadable");
    data_.sample(i, false, x, label, targets);
  }

 private:
  SyntheticData data_;
  uint64_t bad_;
};

std::vector<uint64_t> indices(int batch, uint64_t first) {
  std::vector<uint64_t> v;
  for (int i = 0; i < batch; ++i) v.push_back(first + static_cast<uint64_t>(i) * 7919u % 100003u);
  return v;
}

detail::BatchLoader::Options options(const Dataset* set, int batch, int inputs, int outputs, bool background,
                                    int threads) {
  return {set, batch, inputs, outputs, /*mse=*/false, /*wantX=*/true, /*wantY=*/true, background, threads};
}

struct Loaded {
  std::vector<float> x, y;
};

// Four batches, requested two ahead as the trainer does.
std::vector<Loaded> loadFour(const Dataset& set, detail::BatchLoader::Options o) {
  o.set = &set;
  detail::BatchLoader loader(o);
  std::vector<Loaded> out;
  loader.request(indices(o.batch, 0));
  for (uint64_t b = 1; b <= 4; ++b) {
    if (b < 4) loader.request(indices(o.batch, b * 1000));
    const auto& got = loader.take();
    out.push_back({got.x, got.y});
  }
  return out;
}

TEST(BatchLoader, ThreadsChangeWhenNotWhat) {
  const int in = 37, out = 5;
  Poisoned set(in, out, ~0ull);
  for (bool mse : {false, true}) {
    for (bool wantX : {true, false}) {
      detail::BatchLoader::Options o;
      o.batch = 61;  // not a multiple of any thread count's chunks
      o.inputs = in;
      o.outputs = out;
      o.mse = mse;
      o.wantX = wantX;
      o.background = false;
      o.threads = 1;
      const auto reference = loadFour(set, o);
      ASSERT_EQ(reference[0].x.size(), wantX ? 61u * in : 0u);
      ASSERT_EQ(reference[0].y.size(), mse ? 61u * out : 61u);
      for (bool background : {false, true}) {
        for (int threads : {2, 3, 8, 64, 200}) {
          SCOPED_TRACE(::testing::Message() << "mse " << mse << " wantX " << wantX << " background " << background
                                            << " threads " << threads);
          o.background = background;
          o.threads = threads;
          const auto got = loadFour(set, o);
          ASSERT_EQ(got.size(), reference.size());
          for (size_t b = 0; b < got.size(); ++b) {
            EXPECT_EQ(got[b].x, reference[b].x) << "batch " << b;
            EXPECT_EQ(got[b].y, reference[b].y) << "batch " << b;
          }
        }
      }
    }
  }
}

TEST(BatchLoader, ASampleThatThrowsFailsItsBatchOnly) {
  const uint64_t bad = indices(40, 1000)[33];  // in the second batch
  Poisoned set(9, 3, bad);
  for (bool background : {false, true}) {
    for (int threads : {1, 4}) {
      SCOPED_TRACE(::testing::Message() << "background " << background << " threads " << threads);
      detail::BatchLoader loader(options(&set, 40, 9, 3, background, threads));
      loader.request(indices(40, 0));
      loader.request(indices(40, 1000));
      EXPECT_EQ(loader.take().x.size(), 40u * 9);
      loader.request(indices(40, 2000));
      try {
        loader.take();
        ADD_FAILURE() << "no exception";
      } catch (const std::runtime_error& e) {
        EXPECT_EQ(std::string(e.what()), "sample " + std::to_string(bad) + " is unreadable");
      }
      EXPECT_EQ(loader.take().x.size(), 40u * 9) << "the batch after it loads";
    }
  }
}

// The helpers do compute rows: with 4 threads and slow samples, more than one thread does.
TEST(BatchLoader, HelpersShareTheRows) {
  class Slow final : public Dataset {
   public:
    uint64_t size() const override { return 1000; }
    void sample(uint64_t, float* x, int* label, float*) const override {
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
      std::lock_guard<std::mutex> l(mu_);
      ids_.insert(std::this_thread::get_id());
      x[0] = 1;
      *label = 0;
    }
    size_t threads() const {
      std::lock_guard<std::mutex> l(mu_);
      return ids_.size();
    }

   private:
    mutable std::mutex mu_;
    mutable std::set<std::thread::id> ids_;
  } set;
  detail::BatchLoader loader(options(&set, 64, 1, 2, false, 4));
  loader.request(indices(64, 0));
  loader.take();
  EXPECT_GT(set.threads(), 1u);
}

// "auto": one thread for CPU math (the BLAS has the cores); for GPU math the worker's share
// of the node's CPUs less one, 1..16.
TEST(BatchLoader, AutoThreadsAreTheGpuWorkersShareOfTheCpus) {
  cpu_set_t set;
  ASSERT_EQ(::sched_getaffinity(0, sizeof(set), &set), 0);
  const int cores = CPU_COUNT(&set);
  const char* saved = std::getenv("LOCAL_WORLD_SIZE");
  const std::string keep = saved ? saved : "";
  EXPECT_EQ(loaderThreads(5, false), 5);
  EXPECT_EQ(loaderThreads(5, true), 5);
  EXPECT_EQ(loaderThreads(std::nullopt, false), 1);
  ::setenv("LOCAL_WORLD_SIZE", "1", 1);
  EXPECT_EQ(loaderThreads(std::nullopt, true), std::clamp(cores - 1, 1, 16));
  ::setenv("LOCAL_WORLD_SIZE", "2", 1);
  EXPECT_EQ(loaderThreads(std::nullopt, true), std::clamp(cores / 2 - 1, 1, 16));
  ::setenv("LOCAL_WORLD_SIZE", "1000", 1);
  EXPECT_EQ(loaderThreads(std::nullopt, true), 1);
  if (saved)
    ::setenv("LOCAL_WORLD_SIZE", keep.c_str(), 1);
  else
    ::unsetenv("LOCAL_WORLD_SIZE");
}

}  // namespace
}  // namespace dtrain::train
