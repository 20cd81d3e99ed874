// The trainers' memory estimate (memory_estimate.h) against peaks measured on the CPU paths,
// its parts, the launch's refusal, and the line an allocation failure in a worker becomes.
#include "dtrain/train/memory_estimate.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "dtrain/common/errors.h"
#include "dtrain/train/trainer.h"
#include "out_of_memory.h"

namespace dtrain::train {
namespace {

constexpr double kMiB = 1024.0 * 1024.0;

spec::TrainerSpec mlp(std::vector<int> layers, int batch, const std::string& optimizer = "sgd") {
  spec::TrainerSpec t;
  t.model.layers = std::move(layers);
  t.batch_size = batch;
  t.optimizer.type = optimizer;
  t.data.train_samples = 2000000;
  t.data.eval_samples = 100;
  return t;
}

spec::TrainerSpec pipeline(std::vector<int> layers, int batch, int stages, int micro,
                           const std::string& schedule = "1f1b", const std::string& optimizer = "sgd") {
  spec::TrainerSpec t = mlp(std::move(layers), batch, optimizer);
  t.parallel.pipeline_stages = stages;
  t.parallel.micro_batches = micro;
  t.parallel.schedule = schedule;
  return t;
}

MemoryLayout local(int workers) {
  MemoryLayout l;
  l.world = l.workers = workers;
  return l;
}

// Peak resident sets (VmHWM, MiB) of `dtrain train` workers measured on the 2-core x86-64 dev
// machine (OpenBLAS 0.3.21, one BLAS thread; one worker alone, or each rank under dtrain run
// with /usr/bin/time), docs/trainer.md "Memory". The estimate may be above a peak (it counts
// buffers whose pages a run may never touch) but not more than 10% (+ 6 MiB for small jobs),
// and never more than 2% below.
struct Measured {
  const char* what;
  spec::TrainerSpec spec;
  MemoryLayout layout;
  std::vector<double> rss_mib;  // by rank
};

std::vector<Measured> measured() {
  std::vector<Measured> m;
  m.push_back({"SGD 784-4000-4000-10, batch 8", mlp({784, 4000, 4000, 10}, 8), local(1), {378.8}});
  auto momentum = mlp({784, 4000, 4000, 10}, 8);
  momentum.optimizer.momentum = 0.9;
  m.push_back({"SGD momentum 0.9", momentum, local(1), {378.9}});
  m.push_back({"AdamW 784-4000-4000-10, batch 8", mlp({784, 4000, 4000, 10}, 8, "adamw"), local(1), {525.2}});
  m.push_back({"batch 65536, 784-512-10", mlp({784, 512, 10}, 65536), local(1), {1405.0}});
  m.push_back({"batch 32768, 784-2048-256-10, AdamW", mlp({784, 2048, 256, 10}, 32768, "adamw"), local(1), {1369.6}});
  auto dp2 = mlp({784, 3000, 3000, 10}, 4096);
  dp2.optimizer.momentum = 0.9;
  m.push_back({"2 workers, 784-3000-3000-10, batch 4096", dp2, local(2), {571.2, 570.8}});
  auto resume = mlp({784, 4000, 4000, 10}, 8, "adamw");
  resume.checkpoint.dir = "/ck";
  m.push_back({"AdamW resuming from a checkpoint", resume, local(1), {741.0}});
  auto csv = mlp({200, 256, 10}, 64);
  csv.data.type = "csv";
  MemoryLayout csvLayout = local(2);
  csvLayout.data_rows = 20000;
  m.push_back({"csv, 20000 rows x 200 features, 2 workers", csv, csvLayout, {34.6, 36.4}});
  m.push_back({"pipeline P=2 M=2, 784-4000-4000-10, batch 8",
               pipeline({784, 4000, 4000, 10}, 8, 2, 2),
               local(2),
               {163.8, 324.8}});
  m.push_back({"pipeline P=2 1F1B M=4, 784-2048x3-10, batch 8192, AdamW",
               pipeline({784, 2048, 2048, 2048, 10}, 8192, 2, 4, "1f1b", "adamw"),
               local(2),
               {482.0, 213.8}});
  m.push_back({"pipeline P=2 GPipe M=4, 784-2048x3-10, batch 8192",
               pipeline({784, 2048, 2048, 2048, 10}, 8192, 2, 4, "gpipe"),
               local(2),
               {578.0, 326.5}});
  auto evalBig = pipeline({784, 2048, 2048, 2048, 10}, 8192, 2, 4, "1f1b", "adamw");
  evalBig.data.eval_samples = 100000;
  m.push_back({"pipeline P=2, evaluation in chunks of 8192", evalBig, local(2), {690.2, 381.5}});
  m.push_back({"pipeline 2 x 2, 784-1024x3-10, batch 4096",
               pipeline({784, 1024, 1024, 1024, 10}, 4096, 2, 2),
               local(4),
               {223.5, 101.3, 205.0, 101.2}});
  auto wide = pipeline({4096, 16, 16, 10}, 32768, 2, 2);
  wide.data.train_samples = 200000;
  wide.data.eval_samples = 10;
  m.push_back({"pipeline P=2, 4096-wide input, batch 32768", wide, local(2), {2073.9, 26.0}});
  return m;
}

TEST(MemoryEstimate, MatchesMeasuredPeaks) {
  for (const Measured& m : measured()) {
    const MemoryEstimate e = estimateMemory(m.spec, m.layout);
    ASSERT_EQ(e.workers.size(), m.rss_mib.size()) << m.what;
    double host = 0, own = 0, shared = 0;
    for (size_t r = 0; r < m.rss_mib.size(); ++r) {
      const double est = static_cast<double>(e.workers[r].peak()) / kMiB, rss = m.rss_mib[r];
      EXPECT_GE(est, rss * 0.98) << m.what << ", rank " << r;
      EXPECT_LE(est, rss * 1.10 + 6) << m.what << ", rank " << r;
      host += est;
      own += est - static_cast<double>(e.workers[r].shared) / kMiB;
      shared = std::max(shared, static_cast<double>(e.workers[r].shared) / kMiB);
    }
    // The host's: its workers' own memory, and the shared segments once each.
    EXPECT_LE(static_cast<double>(e.host) / kMiB, host + 0.01) << m.what;
    EXPECT_GE(static_cast<double>(e.host) / kMiB, own + shared - 0.01) << m.what;
  }
}

TEST(MemoryEstimate, CountsTheCopiesOfTheParameters) {
  // Per worker: weights, gradients, optimizer state and the trainer's host copies of weights
  // and state: 5 copies for SGD (its momentum buffer exists even at momentum 0), 7 for AdamW.
  const uint64_t P = (784 + 1) * 4000 + (4000 + 1) * 4000 + (4000 + 1) * 10;
  EXPECT_EQ(estimateWorkerMemory(mlp({784, 4000, 4000, 10}, 8), local(1), 0).model, 5 * P * 4);
  EXPECT_EQ(estimateWorkerMemory(mlp({784, 4000, 4000, 10}, 8, "adamw"), local(1), 0).model, 7 * P * 4);
  // On a GPU only the host copies are host memory; the rest, and the activations, are the device's.
  MemoryLayout gpu = local(1);
  gpu.gpu = true;
  const WorkerMemory g = estimateWorkerMemory(mlp({784, 4000, 4000, 10}, 8, "adamw"), gpu, 0);
  EXPECT_EQ(g.model, 3 * P * 4);
  EXPECT_GE(g.device, 4 * P * 4);
}

TEST(MemoryEstimate, ActivationsGrowWithTheBatch) {
  // 784-4096-10: per sample the input copy, pre-activations and outputs (784 + 2 x 4106),
  // two gradient buffers of the widest layer, two loader slots and the evaluation's buffers
  // (3 x 785), indices; the BLAS workspace (384 per sample) is capped at 128 MiB.
  const WorkerMemory a = estimateWorkerMemory(mlp({784, 4096, 10}, 1 << 16), local(1), 0);
  const WorkerMemory b = estimateWorkerMemory(mlp({784, 4096, 10}, 1 << 17), local(1), 0);
  const uint64_t perSample = (784 + 2 * 4106 + 2 * 4096 + 3 * 785) * 4 + 3 * 8;
  EXPECT_EQ(b.batch - a.batch, perSample * (1 << 16) + ((128ull << 20) - (1ull << 16) * 384 * 4));
  EXPECT_EQ(b.model, a.model);
  // The audit's job: 2 workers of batch 1048576 need about 150 GiB, not "OK".
  const MemoryEstimate big = estimateMemory(mlp({784, 4096, 10}, 1 << 20), local(2));
  EXPECT_GT(big.host, 140ull << 30);
  EXPECT_EQ(big.field, "/trainer/batch_size");
}

TEST(MemoryEstimate, PipelineStagesHoldTheirShare) {
  // 784-4000-4000-10 on two stages: layer 0 alone (3.1 M parameters) and layers 1-2 (16.0 M).
  const auto t = pipeline({784, 4000, 4000, 10}, 8, 2, 2);
  const MemoryEstimate e = estimateMemory(t, local(2));
  const uint64_t p0 = 785 * 4000, p1 = 4001 * 4000 + 4001 * 10;
  EXPECT_EQ(e.workers[0].model, 5 * p0 * 4);
  EXPECT_EQ(e.workers[1].model, 5 * p1 * 4);
  // Rank 0 gathers the whole model for the job's hash, the old and the grown vector at once.
  EXPECT_EQ(e.workers[0].gather, (2 * p0 + p1) * 4);
  EXPECT_EQ(e.workers[1].gather, 0u);
  // GPipe stashes every micro-batch, 1F1B at most P - p of them.
  const auto g = pipeline({784, 2048, 2048, 2048, 10}, 8192, 2, 8, "gpipe");
  const auto f = pipeline({784, 2048, 2048, 2048, 10}, 8192, 2, 8, "1f1b");
  EXPECT_GT(estimateWorkerMemory(g, local(2), 0).batch, 2 * estimateWorkerMemory(f, local(2), 0).batch);
  // Resume: the stage checkpoints are read by replica 0's ranks.
  auto r = pipeline({784, 4000, 4000, 10}, 8, 2, 2);
  r.checkpoint.dir = "/ck";
  const MemoryEstimate re = estimateMemory(r, local(4));
  EXPECT_GT(re.workers[1].resume, 0u);
  EXPECT_EQ(re.workers[3].resume, 0u);
}

// The communicators' shared-memory segment is mapped by every worker and held once: many
// small workers cost their own memory each, not the segment each (a 256-worker CPU host
// was estimated at 36 GiB for a 16-8-3 model, 32 GiB of it one segment counted 256 times).
TEST(MemoryEstimate, SharedSegmentsAreCountedOncePerHost) {
  const auto t = mlp({16, 8, 3}, 8);
  const auto e64 = estimateMemory(t, local(64)), e256 = estimateMemory(t, local(256));
  ASSERT_GT(e64.workers[0].shared, 0u);
  const uint64_t own = e256.workers[1].peak() - e256.workers[1].shared;  // a worker's own (not rank 0)
  EXPECT_LT(e256.host, 256 * own + 4 * e256.workers[1].shared) << e256.host / kMiB;
  EXPECT_LT(static_cast<double>(e256.host) / kMiB, 8 * 1024.0);
  // One worker's own peak still includes the segment it maps.
  EXPECT_EQ(e64.workers[1].peak(), e64.workers[1].runtime + e64.workers[1].model +
                                       std::max(e64.workers[1].resume, e64.workers[1].data + std::max(e64.workers[1].loading, e64.workers[1].batch + e64.workers[1].gather)));
}

// A first run's checkpoint directory holds nothing to read at the start.
TEST(MemoryEstimate, NoCheckpointReadWithoutACheckpoint) {
  auto t = mlp({784, 4000, 4000, 10}, 8, "adamw");
  t.checkpoint.dir = "/nonexistent";
  MemoryLayout l = local(1);
  const uint64_t withRead = estimateMemory(t, l).host;
  l.checkpoint_to_read = false;
  const uint64_t without = estimateMemory(t, l).host;
  EXPECT_GT(withRead, without + 100 * kMiB);
  t.checkpoint.dir.clear();
  EXPECT_EQ(estimateMemory(t, local(1)).host, without);
}

TEST(MemoryEstimate, DataSetsAreHeldByEveryWorker) {
  auto t = mlp({784, 64, 10}, 64);
  t.data.type = "csv";
  MemoryLayout l = local(4);
  l.data_rows = 1000000;
  const MemoryEstimate e = estimateMemory(t, l);
  for (const WorkerMemory& w : e.workers) EXPECT_EQ(w.data, 1000000ull * 785 * 4);
  EXPECT_EQ(e.field, "/trainer/data/path");
  t.data.type = "idx";  // read whole as bytes first
  EXPECT_EQ(estimateWorkerMemory(t, l, 0).loading, 1000000ull * 784);
}

MemoryAvailability hostWith(uint64_t bytes) {
  MemoryAvailability a;
  a.bytes = a.host_available = bytes;
  return a;
}

TEST(MemoryEstimate, TheLaunchRefusesWhatTheHostCannotHold) {
  const auto big = mlp({784, 4096, 10}, 1 << 20);
  try {
    checkHostMemory(big, local(2), hostWith(8ull << 30), "job.json");
    FAIL() << "153 GiB on a host with 8 GiB available";
  } catch (const SpecError& e) {
    const std::string w = e.what();
    EXPECT_EQ(w.rfind("job.json: /trainer/batch_size: this job needs about 153.", 0), 0u) << w;
    EXPECT_NE(w.find("2 workers, the largest (rank 0) 76.6 GiB: activations and batch buffers 76.5 GiB"),
              std::string::npos)
        << w;
    EXPECT_NE(w.find("more than the 8.0 GiB available (MemAvailable); use a smaller batch_size (now 1048576) or fewer "
                     "workers per host (nproc_per_node 2)"),
              std::string::npos)
        << w;
  }
  try {
    checkHostMemory(mlp({784, 17000, 17000, 10}, 8), local(2), hostWith(8ull << 30), "job.json");
    FAIL() << "2 x 5.7 GiB on a host with 8 GiB available";
  } catch (const SpecError& e) {
    const std::string w = e.what();
    EXPECT_EQ(w.rfind("job.json: /trainer/model/layers: this job needs about 11.3 GiB", 0), 0u) << w;
    EXPECT_NE(w.find("use smaller layers (now 784-17000-17000-10: 302.5 M parameters, 1.1 GiB per copy), fewer workers "
                     "per host (nproc_per_node 2), or pipeline stages"),
              std::string::npos)
        << w;
  }
  EXPECT_NO_THROW(checkHostMemory(big, local(2), hostWith(0), "job.json")) << "unknown: not checked";
  EXPECT_NO_THROW(checkHostMemory(mlp({784, 64, 10}, 64), local(2), hostWith(8ull << 30), "job.json"));
  EXPECT_GT(memoryAvailability().host_available, 0u) << "MemAvailable in /proc/meminfo";
}

TEST(MemoryEstimate, TheCheckSwitchTakesTheUsualSpellings) {
  ::unsetenv("DTRAIN_MEMORY_CHECK");
  EXPECT_TRUE(memoryCheckEnforced());
  for (const char* off : {"0", "off", "false", "no"}) {
    ::setenv("DTRAIN_MEMORY_CHECK", off, 1);
    EXPECT_FALSE(memoryCheckEnforced()) << off;
  }
  ::setenv("DTRAIN_MEMORY_CHECK", "1", 1);
  EXPECT_TRUE(memoryCheckEnforced());
  ::setenv("DTRAIN_MEMORY_CHECK", "maybe", 1);
  EXPECT_THROW(memoryCheckEnforced(), SpecError);
  ::unsetenv("DTRAIN_MEMORY_CHECK");
}

TEST(MemoryEstimate, ACgroupLimitIsNamedWhenItBinds) {
  MemoryAvailability a = hostWith(2ull << 30);
  a.host_available = 20ull << 30;
  a.cgroup_limit = 3ull << 30;
  a.cgroup_dir = "/sys/fs/cgroup/job";
  a.cgroup_bound = true;
  try {
    checkHostMemory(mlp({784, 17000, 17000, 10}, 8), local(2), a, "job.json");
    FAIL() << "11.3 GiB under a 3 GiB limit";
  } catch (const SpecError& e) {
    EXPECT_NE(std::string(e.what()).find("more than the 2.0 GiB available under the memory limit of 3.0 GiB of this "
                                         "process's cgroup (/sys/fs/cgroup/job); use smaller layers"),
              std::string::npos)
        << e.what();
  }
}

// An allocation failure anywhere in a run becomes one SpecError (the worker's exit 2) naming
// what was being allocated, this worker's need and the field to change.
TEST(MemoryEstimate, AllocationFailuresSayWhatAndWhichField) {
  const auto t = mlp({784, 4096, 10}, 65536);
  auto failAt = [&](detail::AllocationSite::Kind k, const std::exception_ptr& e) -> std::string {
    try {
      detail::withAllocationSite(t, 1, 2, [&](detail::AllocationSite& site) {
        site.at(k);
        std::rethrow_exception(e);
        return TrainResult{};
      });
    } catch (const SpecError& s) {
      return s.what();
    }
    return "no SpecError";
  };
  const std::string batch = failAt(detail::AllocationSite::kBatch, std::make_exception_ptr(std::bad_alloc()));
  EXPECT_EQ(batch.rfind("trainer: rank 1 ran out of memory allocating the activations and buffers of a batch of 65536 "
                        "samples (std::bad_alloc): this worker needs about ",
                        0),
            0u)
      << batch;
  EXPECT_NE(batch.find("; /trainer/batch_size: use a smaller batch_size (now 65536)"), std::string::npos) << batch;
  const std::string model = failAt(detail::AllocationSite::kModel, std::make_exception_ptr(std::bad_alloc()));
  EXPECT_NE(model.find("allocating the model's weights, gradients and optimizer state"), std::string::npos) << model;
  EXPECT_NE(model.find("; /trainer/model/layers: use smaller layers (now 784-4096-10"), std::string::npos) << model;
  const std::string device = failAt(detail::AllocationSite::kBatch,
                                    std::make_exception_ptr(AllocationError(
                                        "cudaMalloc of 274877906944 bytes on cuda:0: out of device memory", true)));
  EXPECT_NE(device.find("rank 1 ran out of device memory allocating the activations and buffers of a batch of 65536 "
                        "samples (cudaMalloc of 274877906944 bytes on cuda:0: out of device memory): this worker needs "
                        "about "),
            std::string::npos)
      << device;
  // Other errors pass through as they are.
  EXPECT_THROW(
      detail::withAllocationSite(t, 0, 1, [](detail::AllocationSite&) -> TrainResult { throw IoError("disk"); }),
      IoError);
}

}  // namespace
}  // namespace dtrain::train
