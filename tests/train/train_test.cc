#include <gtest/gtest.h>
#include <limits>
#include <sys/stat.h>

#include <sched.h>
#include <signal.h>
#include <sys/resource.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <mutex>
#include <thread>

#include <unistd.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "dtrain/comm/communicator.h"
#include "dtrain/store/hash_store.h"
#include "dtrain/common/errors.h"
#include "dtrain/train/checkpoint.h"
#include "dtrain/train/data.h"
#include "dtrain/train/device.h"
#include "dtrain/train/metrics.h"
#include "dtrain/train/mlp.h"
#include "dtrain/train/trainer.h"

#include "checkpoint_file.h"

namespace dtrain::train {
namespace {

// Central finite differences (in double, from float forward passes) against backward.
void checkGradients(Activation act, Loss loss) {
  MlpConfig cfg{{5, 7, 6, 3}, act, loss};
  Mlp m(cfg);
  m.init(3);
  const int n = 4;
  std::vector<float> x(n * 5), y(loss == Loss::kMse ? n * 3 : n);
  SyntheticData d(5, 3, 9);
  for (int i = 0; i < n; ++i) {
    int label;
    d.sample(static_cast<uint64_t>(i), false, x.data() + i * 5, &label, loss == Loss::kMse ? y.data() + i * 3 : nullptr);
    if (loss != Loss::kMse) y[static_cast<size_t>(i)] = static_cast<float>(label);
  }
  m.forward(x.data(), n, y.data(), nullptr);
  std::vector<int> order;
  m.backward([&](int l) { order.push_back(l); });
  EXPECT_EQ(order, (std::vector<int>{2, 1, 0}));  // last layer first
  auto grads = m.grads();
  auto& p = m.params();
  int checked = 0;
  for (size_t i = 0; i < p.size(); i += 3) {
    float orig = p[i];
    const float h = 1e-2f;
    p[i] = orig + h;
    double up = m.forward(x.data(), n, y.data(), nullptr);
    p[i] = orig - h;
    double down = m.forward(x.data(), n, y.data(), nullptr);
    p[i] = orig;
    double numeric = (up - down) / (2 * h);
    EXPECT_NEAR(grads[i], numeric, 2e-3 + 2e-2 * std::fabs(numeric)) << "param " << i;
    ++checked;
  }
  EXPECT_GT(checked, 20);
}

TEST(Mlp, GradientsMatchFiniteDifferences) {
  checkGradients(Activation::kGelu, Loss::kCrossEntropy);
  checkGradients(Activation::kGelu, Loss::kMse);
  checkGradients(Activation::kRelu, Loss::kCrossEntropy);
}

TEST(Buckets, ReverseLayerOrderAndSizes) {
  // Layer sizes 100, 50, 10 floats.
  auto b = planBuckets({0, 100, 150, 160}, 55, 1000);
  ASSERT_EQ(b.size(), 2u);
  EXPECT_EQ(b[0].begin, 100u);  // layers 2+1 = 60 floats >= 55
  EXPECT_EQ(b[0].end, 160u);
  EXPECT_EQ(b[0].closes_at, 1);
  EXPECT_EQ(b[1].begin, 0u);
  EXPECT_EQ(b[1].closes_at, 0);
  EXPECT_EQ(planBuckets({0, 100, 150, 160}, 1, 1000).size(), 3u);
  // The first bucket is capped lower: layer 2 (10 floats) alone, then the rest.
  auto f = planBuckets({0, 100, 150, 160}, 1000, 10);
  ASSERT_EQ(f.size(), 2u);
  EXPECT_EQ(f[0].begin, 150u);
  EXPECT_EQ(f[0].closes_at, 2);
  EXPECT_EQ(f[1].begin, 0u);
}

TEST(Data, SamplesAreAFunctionOfTheIndexAndEpochsArePermutations) {
  SyntheticData a(20, 4, 5), b(20, 4, 5);
  std::vector<float> x1(20), x2(20);
  int l1, l2;
  a.sample(12345, false, x1.data(), &l1);
  b.sample(12345, false, x2.data(), &l2);
  EXPECT_EQ(x1, x2);
  EXPECT_EQ(l1, l2);
  a.sample(12345, true, x2.data(), &l2);
  EXPECT_NE(x1, x2);  // the held-out split is different data
  auto e0 = epochOrder(1000, 7, 0), e1 = epochOrder(1000, 7, 1);
  EXPECT_NE(e0, e1);
  std::sort(e0.begin(), e0.end());
  for (uint64_t i = 0; i < 1000; ++i) ASSERT_EQ(e0[i], i);
  EXPECT_EQ(epochOrder(1000, 7, 1), e1);
}

spec::TrainerSpec small(int batch) {
  spec::TrainerSpec t;
  t.device = "cpu";  // the CPU path even on GPU machines (gpu_train_test.cc covers the GPU)
  t.model.layers = {20, 16, 4};
  t.data.train_samples = 4096;
  t.data.eval_samples = 512;
  t.batch_size = batch;
  t.epochs = 1;
  t.max_steps = 20;
  t.optimizer.lr = 0.05;
  t.optimizer.momentum = 0.9;
  t.bucket_mb = 0.0005;  // several buckets
  return t;
}

std::vector<std::vector<float>> runWorld(int world, const spec::TrainerSpec& t, std::vector<TrainResult>* results = nullptr) {
  auto store = std::make_shared<store::HashStore>();
  std::vector<std::vector<float>> params(static_cast<size_t>(world));
  std::vector<TrainResult> res(static_cast<size_t>(world));
  std::vector<std::thread> ts;
  for (int r = 0; r < world; ++r)
    ts.emplace_back([&, r] {
      auto c = comm::createTcpCommunicator(store, r, world, {});
      TrainOptions o;
      o.final_params = &params[static_cast<size_t>(r)];
      res[static_cast<size_t>(r)] = train(t, *c, o);
    });
  for (auto& th : ts) th.join();
  if (results) *results = res;
  return params;
}

TEST(Trainer, TwoWorkersOfBMatchOneWorkerOf2B) {
  auto two = runWorld(2, small(32));
  auto one = runWorld(1, small(64));
  ASSERT_EQ(two[0].size(), one[0].size());
  EXPECT_EQ(two[0], two[1]);  // replicas bit-identical
  double maxDiff = 0;
  for (size_t i = 0; i < one[0].size(); ++i) maxDiff = std::max(maxDiff, static_cast<double>(std::fabs(one[0][i] - two[0][i])));
  EXPECT_LT(maxDiff, 1e-4);
}

TEST(Trainer, OverlapOnAndOffGiveTheSameWeights) {
  auto t = small(32);
  t.overlap = true;  // not "auto": that depends on this machine's cores
  auto on = runWorld(2, t);
  t.overlap = false;
  auto off = runWorld(2, t);
  EXPECT_EQ(on[0], off[0]);
}

TEST(Trainer, LearnsTheSyntheticTask) {
  auto t = small(32);
  t.max_steps = 0;
  t.epochs = 4;
  t.data.train_samples = 20000;
  t.model.layers = {64, 128, 4};
  t.optimizer.lr = 0.01;
  std::vector<TrainResult> res;
  runWorld(2, t, &res);
  EXPECT_GT(res[0].eval_accuracy, 0.9);
  EXPECT_EQ(res[0].weights_sha256, res[1].weights_sha256);
  EXPECT_EQ(res[0].steps, 4 * (20000 / 64));
}

}  // namespace
}  // namespace dtrain::train

namespace dtrain::train {
namespace {

std::string tempDir(const std::string& name) {
  std::string d = ::testing::TempDir() + "/dtrain_ckpt_" + name + "_" + std::to_string(::getpid());
  std::filesystem::remove_all(d);
  return d;
}

std::vector<std::vector<float>> runWith(int world, const spec::TrainerSpec& t,
                                        std::function<void(int, const uint64_t*, int)> onBatch = {}) {
  auto store = std::make_shared<store::HashStore>();
  std::vector<std::vector<float>> params(static_cast<size_t>(world));
  std::vector<std::thread> ts;
  std::mutex mu;
  for (int r = 0; r < world; ++r)
    ts.emplace_back([&, r] {
      auto c = comm::createTcpCommunicator(store, r, world, {});
      TrainOptions o;
      o.final_params = &params[static_cast<size_t>(r)];
      if (onBatch)
        o.on_batch = [&](int e, const uint64_t* idx, int n) {
          std::lock_guard<std::mutex> l(mu);
          onBatch(e, idx, n);
        };
      train(t, *c, o);
    });
  for (auto& th : ts) th.join();
  return params;
}

TEST(Checkpoint, ResumeAtTheSameWorldSizeIsBitIdentical) {
  auto t = small(32);
  t.max_steps = 40;
  auto straight = runWith(2, t);
  t.checkpoint.dir = tempDir("same");
  t.checkpoint.every_steps = 7;
  t.max_steps = 17;  // "interrupted" after step 17 (its last checkpoint)
  runWith(2, t);
  t.max_steps = 40;
  auto resumed = runWith(2, t);
  EXPECT_EQ(resumed[0], straight[0]);
  EXPECT_EQ(resumed[1], straight[0]);
}

std::string fileBytes(const std::filesystem::path& p) {
  std::ifstream f(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

// checkpoint.async writes on a thread while training goes on: the same files, byte for byte,
// as written inline (the snapshot is the step's, not a later one's), the last one durable
// when train() returns, and a resume from them is bit-identical to a straight run.
TEST(Checkpoint, AsyncWritesTheSameFilesAndResumesBitIdentical) {
  auto t = small(32);
  t.max_steps = 40;
  auto straight = runWith(2, t);
  t.checkpoint.every_steps = 3;
  t.max_steps = 17;  // checkpoints at 3, 6, ..., 15 and 17; the newest 3 are kept
  const std::string inlineDir = tempDir("inline"), asyncDir = tempDir("async");
  t.checkpoint.dir = inlineDir;
  runWith(2, t);
  t.checkpoint.dir = asyncDir;
  t.checkpoint.async = true;
  runWith(2, t);
  std::vector<std::string> names;
  for (const auto& e : std::filesystem::directory_iterator(asyncDir)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{"ckpt-0000000012.bin", "ckpt-0000000015.bin", "ckpt-0000000017.bin"}));
  for (const auto& n : names) EXPECT_EQ(fileBytes(asyncDir + "/" + n), fileBytes(inlineDir + "/" + n)) << n;
  t.max_steps = 40;
  auto resumed = runWith(2, t);
  EXPECT_EQ(resumed[0], straight[0]);
  EXPECT_EQ(resumed[1], straight[0]);
}

// Loading the next batch on a thread (trainer.data.prefetch) changes when a batch is made,
// never what it holds: the same batches in the same order, across an epoch boundary (where
// nothing is prefetched) and a mid-epoch end, and bit-identical weights.
TEST(Trainer, PrefetchedBatchesAreTheInlineOnes) {
  auto t = small(32);
  t.data.train_samples = 1000;  // 15 steps per epoch with 2 workers
  t.epochs = 3;
  t.max_steps = 37;
  std::vector<std::vector<uint64_t>> batches[2];
  std::vector<std::vector<float>> weights[2];
  for (int on = 0; on < 2; ++on) {
    t.data.prefetch = on == 1;
    weights[on] = runWith(2, t, [&](int epoch, const uint64_t* idx, int n) {
      std::vector<uint64_t> b{static_cast<uint64_t>(epoch)};
      b.insert(b.end(), idx, idx + n);
      batches[on].push_back(b);
    });
  }
  ASSERT_EQ(batches[0].size(), 2u * 37);
  std::sort(batches[0].begin(), batches[0].end());  // the two ranks' hooks interleave
  std::sort(batches[1].begin(), batches[1].end());
  EXPECT_EQ(batches[1], batches[0]);
  EXPECT_EQ(weights[1][0], weights[0][0]);
  EXPECT_EQ(weights[1][1], weights[0][0]);
}

// Several loader threads (trainer.data.loader_threads) compute the same batches: bit-identical
// weights, inline and prefetched.
TEST(Trainer, LoaderThreadsTrainTheSameWeights) {
  auto t = small(32);
  t.data.train_samples = 1000;
  t.max_steps = 20;
  t.data.prefetch = false;
  const auto reference = runWith(2, t);
  for (bool prefetch : {false, true}) {
    t.data.prefetch = prefetch;
    t.data.loader_threads = 3;
    const auto w = runWith(2, t);
    EXPECT_EQ(w[0], reference[0]) << "prefetch " << prefetch;
    EXPECT_EQ(w[1], reference[0]) << "prefetch " << prefetch;
  }
}

// "auto": a loader thread for GPU math, and for CPU math only when the node has a core beyond
// its workers' BLAS threads.
// trainer.data.prefetch and trainer.overlap: as set, else ("auto") on for GPU math, and on
// CPUs only with a core that no worker's BLAS thread computes on.
TEST(Trainer, PrefetchAndOverlapAutoWantASpareCore) {
  cpu_set_t set;
  ASSERT_EQ(::sched_getaffinity(0, sizeof(set), &set), 0);
  const int cores = CPU_COUNT(&set);
  auto envOr = [](const char* name) { const char* v = std::getenv(name); return v ? std::string(v) : std::string(); };
  const std::string saved[3] = {envOr("LOCAL_WORLD_SIZE"), envOr("OPENBLAS_NUM_THREADS"), envOr("OMP_NUM_THREADS")};
  const char* names[3] = {"LOCAL_WORLD_SIZE", "OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS"};
  for (auto* decide : {&prefetchBatches, &overlapGradients}) {
    SCOPED_TRACE(decide == &prefetchBatches ? "prefetch" : "overlap");
    EXPECT_TRUE(decide(true, false));
    EXPECT_FALSE(decide(false, true));
    EXPECT_TRUE(decide(std::nullopt, true));
    ::unsetenv("OPENBLAS_NUM_THREADS");
    ::unsetenv("OMP_NUM_THREADS");
    EXPECT_FALSE(decide(std::nullopt, false)) << "an unset thread count: the BLAS takes every core";
    ::setenv("OMP_NUM_THREADS", "1", 1);
    ::setenv("LOCAL_WORLD_SIZE", std::to_string(cores).c_str(), 1);
    EXPECT_FALSE(decide(std::nullopt, false)) << "one worker per core";
    const int fewer = std::max(1, cores - 1);
    ::setenv("LOCAL_WORLD_SIZE", std::to_string(fewer).c_str(), 1);
    EXPECT_EQ(decide(std::nullopt, false), cores > fewer) << "a core left over";
    ::setenv("OPENBLAS_NUM_THREADS", "2", 1);  // wins over OMP_NUM_THREADS, as in OpenBLAS
    EXPECT_EQ(decide(std::nullopt, false), cores > 2 * fewer);
    for (int i = 0; i < 3; ++i) {
      if (saved[i].empty()) ::unsetenv(names[i]);
      else ::setenv(names[i], saved[i].c_str(), 1);
    }
  }
}

// A resume mid-epoch (a cursor that starts no epoch) with batches prefetched continues
// exactly as an uninterrupted run that loaded them inline.
TEST(Checkpoint, ResumeMidEpochWithPrefetchIsBitIdentical) {
  auto t = small(32);
  t.data.train_samples = 1000;  // 15 steps per epoch with 2 workers
  t.epochs = 3;
  t.max_steps = 37;
  t.data.prefetch = false;
  auto straight = runWith(2, t);
  t.data.prefetch = true;
  t.checkpoint.dir = tempDir("prefetch");
  t.checkpoint.every_steps = 4;
  t.max_steps = 22;  // the last checkpoint at step 22: epoch 2, 7 steps in
  runWith(2, t);
  t.max_steps = 37;
  auto resumed = runWith(2, t);
  EXPECT_EQ(resumed[0], straight[0]);
  EXPECT_EQ(resumed[1], straight[0]);
}

TEST(Checkpoint, ResumeAtAnotherWorldSizeSeesEverySampleOnce) {
  auto t = small(32);
  t.max_steps = 0;
  t.epochs = 1;
  t.checkpoint.dir = tempDir("resize");
  t.checkpoint.every_steps = 10;
  std::vector<int> seen(4096, 0);
  auto count = [&](int epoch, const uint64_t* idx, int n) {
    ASSERT_EQ(epoch, 0);
    for (int i = 0; i < n; ++i) ++seen[idx[i]];
  };
  t.max_steps = 10;  // 2 workers x 32 = 640 samples
  runWith(2, t, count);
  t.max_steps = 0;   // then 4 workers finish the epoch: (4096 - 640) / 128 = 27 steps
  runWith(4, t, count);
  int once = 0, twice = 0;
  for (int v : seen) once += v == 1, twice += v > 1;
  EXPECT_EQ(twice, 0);
  EXPECT_EQ(once, 640 + 27 * 128);  // the last 4096 - 640 - 27*128 = 0 are dropped (none here)
}

// A write cut short leaves ckpt-<step>.bin.tmp; the next save removes those of older steps
// (no writer of the job can finish them) and nothing else.
TEST(Checkpoint, TemporaryFilesOfWritesCutShortAreRemoved) {
  auto dir = tempDir("stale-tmp");
  std::filesystem::create_directories(dir);
  for (const char* n : {"ckpt-0000000003.bin.tmp", "ckpt-0000000099.bin.tmp", "ckpt-x.bin.tmp", "notes.tmp"})
    std::ofstream(dir + "/" + n) << "partial";
  TrainState a{1, 10, 0, 640, 2, {1, 2, 3}, {0, 0, 0}};
  saveCheckpoint(dir, a);
  EXPECT_FALSE(std::filesystem::exists(dir + "/ckpt-0000000003.bin.tmp"));
  for (const char* n : {"ckpt-0000000099.bin.tmp", "ckpt-x.bin.tmp", "notes.tmp", "ckpt-0000000010.bin"})
    EXPECT_TRUE(std::filesystem::exists(dir + "/" + n)) << n;
}

// A run that resumed from an older step (its newer checkpoints damaged, so skipped) keeps its
// own newest 3: the newer files are neither counted nor deleted (before, the 3 damaged ones
// were the "newest 3 kept" and every checkpoint of this run but the last was pruned).
TEST(Checkpoint, PruningLeavesCheckpointsOfLaterStepsAlone) {
  auto dir = tempDir("later-steps");
  for (long long step : {1100, 1200, 1250}) saveCheckpoint(dir, TrainState{1, step, 0, 0, 2, {1, 2, 3}, {0, 0, 0}});
  for (long long step = 100; step <= 450; step += 50)
    saveCheckpoint(dir, TrainState{1, step, 0, 0, 2, {1, 2, 3}, {0, 0, 0}});
  std::vector<long long> left;
  for (const auto& e : std::filesystem::directory_iterator(dir)) left.push_back(std::stoll(e.path().stem().string().substr(5)));
  std::sort(left.begin(), left.end());
  EXPECT_EQ(left, (std::vector<long long>{350, 400, 450, 1100, 1200, 1250}));
}

TEST(Checkpoint, DamagedNewestIsSkippedAndConfigChangesAreRefused) {
  auto dir = tempDir("damaged");
  TrainState a{1, 10, 0, 640, 2, {1, 2, 3}, {0, 0, 0}}, b{1, 20, 0, 1280, 2, {4, 5, 6}, {0, 0, 0}};
  saveCheckpoint(dir, a);
  std::string newest = saveCheckpoint(dir, b);
  {
    std::fstream f(newest, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(30);
    f.put('\x7f');  // flip a byte in the payload
  }
  std::vector<std::string> warnings;
  auto s = loadLatestCheckpoint(dir, [&](const std::string& w) { warnings.push_back(w); });
  ASSERT_TRUE(s);
  EXPECT_EQ(s->step, 10);
  EXPECT_EQ(s->params, (std::vector<float>{1, 2, 3}));
  ASSERT_EQ(warnings.size(), 1u);
  EXPECT_NE(warnings[0].find("corrupt (checksum mismatch)"), std::string::npos);
  std::filesystem::resize_file(newest, 20);  // truncated
  warnings.clear();
  EXPECT_EQ(loadLatestCheckpoint(dir, [&](const std::string& w) { warnings.push_back(w); })->step, 10);
  EXPECT_NE(warnings[0].find("truncated"), std::string::npos);

  auto t = small(32);
  t.checkpoint.dir = tempDir("config");
  t.max_steps = 3;
  runWith(1, t);
  t.model.layers = {20, 8, 4};
  auto store = std::make_shared<store::HashStore>();
  auto c = comm::createTcpCommunicator(store, 0, 1, {});
  EXPECT_THROW(train(t, *c), SpecError);
}

// The hash of synthetic-data configs is the one checkpoints written before data files were
// hashed carry (they must stay resumable); file data adds which files, read how.
TEST(Checkpoint, ConfigHashCoversDataFilesAndKeepsSyntheticHashes) {
  auto t = small(32);
  std::string key = fmt::format("{}|{}|{}|{}|{}|{}|{}|{}|{}", t.model.type, fmt::join(t.model.layers, ","),
                                t.model.activation, t.model.loss, t.data.type, t.data.seed, t.data.train_samples,
                                t.optimizer.type, t.seed);
  uint64_t legacy = 0;
  std::string hex = sha256Hex(key.data(), key.size());
  for (int i = 0; i < 8; ++i)
    legacy |= static_cast<uint64_t>(std::stoi(hex.substr(static_cast<size_t>(2 * i), 2), nullptr, 16)) << (8 * i);
  EXPECT_EQ(configHash(t), legacy);
  auto f = t;
  f.data.type = "csv";
  f.data.path = "/d/a.csv";
  const uint64_t base = configHash(f);
  for (auto change : std::vector<std::function<void(spec::TrainerSpec&)>>{
           [](spec::TrainerSpec& x) { x.data.path = "/moved/a.csv"; },
           [](spec::TrainerSpec& x) { x.data.labels_path = "/d/labels.csv"; },
           [](spec::TrainerSpec& x) { x.data.label_column = "3"; },
           [](spec::TrainerSpec& x) { x.data.header = false; }}) {
    auto g = f;
    change(g);
    EXPECT_NE(configHash(g), base);
  }
  auto g = f;
  g.data.eval_path = "/d/eval.csv";  // the held-out set shapes no state
  EXPECT_EQ(configHash(g), base);
}

// A file of the format before the config's description was kept still loads.
TEST(Checkpoint, FilesWithoutTheConfigDescriptionLoad) {
  auto dir = tempDir("olderformat");
  std::filesystem::create_directories(dir);
  std::string payload;
  auto put = [&](const auto& v) { payload.append(reinterpret_cast<const char*>(&v), sizeof(v)); };
  put(uint64_t{7});
  put(static_cast<long long>(5));
  put(static_cast<long long>(1));
  put(uint64_t{64});
  put(static_cast<long long>(2));
  for (int k = 0; k < 2; ++k) {
    put(uint64_t{2});
    put(1.5f);
    put(2.5f);
  }
  std::ofstream(dir + "/ckpt-0000000005.bin", std::ios::binary) << testing::checkpointFileBytes(payload);
  auto s = loadLatestCheckpoint(dir, [](const std::string& w) { ADD_FAILURE() << w; });
  ASSERT_TRUE(s);
  EXPECT_EQ(s->step, 5);
  EXPECT_EQ(s->params, (std::vector<float>{1.5f, 2.5f}));
  EXPECT_TRUE(s->config.empty());
  // Without a description, what changed is told from the sizes where it can be.
  auto t = small(32);
  EXPECT_NE(checkpointMismatch(t, *s, "p", 100).find("the model changed (the checkpoint holds 2 parameters, this spec's "
                                                     "model has 100)"),
            std::string::npos);
}

TEST(Checkpoint, MismatchNamesWhatChanged) {
  auto t = small(32);
  t.data.type = "csv";
  t.data.path = "/d/a.csv";
  TrainState s{configHash(t), 40, 1, 0, 2, {1, 2}, {0, 0}, configDescription(t)};
  EXPECT_EQ(checkpointMismatch(t, s, "/c/ckpt-0000000040.bin", 0), "");
  auto moved = t;
  moved.data.path = "/e/a.csv";
  const std::string why = checkpointMismatch(moved, s, "/c/ckpt-0000000040.bin", 0);
  EXPECT_NE(why.find("the newest checkpoint /c/ckpt-0000000040.bin (step 40) was written by a different trainer config: "
                     "the data changed (checkpoint: csv /d/a.csv, label column label, header, seed 1; this spec: csv "
                     "/e/a.csv,"),
            std::string::npos)
      << why;
  EXPECT_EQ(why.find("model"), std::string::npos) << why;
  auto wider = t;
  wider.model.layers[1] = 99;
  EXPECT_NE(checkpointMismatch(wider, s, "p", 0).find("the model changed (checkpoint: mlp 20-"), std::string::npos);
}

TEST(Checkpoint, PreparingTheDirectoryCreatesAndChecksIt) {
  auto t = small(32);
  t.checkpoint.dir = std::filesystem::path(tempDir("prepare") + "/a/b").lexically_normal().string();
  (void)prepareCheckpointDir(t, "job.json");
  EXPECT_TRUE(std::filesystem::is_directory(t.checkpoint.dir));
  // The write check leaves nothing but the directory's lock file.
  std::vector<std::string> left;
  for (const auto& e : std::filesystem::directory_iterator(t.checkpoint.dir)) left.push_back(e.path().filename().string());
  EXPECT_EQ(left, std::vector<std::string>{".dtrain.lock"});
  {
    // One job per directory: while the lock is held, another is refused, naming the holder.
    Fd held = prepareCheckpointDir(t, "job.json");
    try {
      (void)prepareCheckpointDir(t, "other.json");
      ADD_FAILURE() << "no error";
    } catch (const SpecError& e) {
      EXPECT_NE(std::string(e.what()).find("other.json: /trainer/checkpoint/dir: \"" + t.checkpoint.dir +
                                           "\" is in use by another dtrain job (pid " + std::to_string(::getpid()) + " on "),
                std::string::npos)
          << e.what();
    }
  }
  (void)prepareCheckpointDir(t, "job.json");  // released with its holder
  // Under a regular file: one line naming the spec, the pointer and the part in the way.
  std::ofstream(t.checkpoint.dir + "/f") << "x";
  auto u = t;
  u.checkpoint.dir = t.checkpoint.dir + "/f/sub";
  try {
    (void)prepareCheckpointDir(u, "job.json");
    ADD_FAILURE() << "no error";
  } catch (const SpecError& e) {
    EXPECT_EQ(std::string(e.what()).rfind("job.json: /trainer/checkpoint/dir: cannot create \"" + u.checkpoint.dir +
                                              "\": " + t.checkpoint.dir + "/f is not a directory; ",
                                          0),
              0u)
        << e.what();
  }
  // A checkpoint of another config: refused before any worker, with the fix for all of them.
  std::filesystem::remove(t.checkpoint.dir + "/f");
  t.max_steps = 2;
  t.checkpoint.every_steps = 1;
  runWith(1, t);
  (void)prepareCheckpointDir(t, "job.json");  // the same config: fine
  t.model.layers = {20, 8, 4};
  try {
    (void)prepareCheckpointDir(t, "job.json");
    ADD_FAILURE() << "no error";
  } catch (const SpecError& e) {
    const std::string m = e.what();
    EXPECT_EQ(m.rfind("job.json: /trainer/checkpoint/dir: the newest checkpoint ", 0), 0u) << m;
    EXPECT_NE(m.find("the model changed (checkpoint: mlp 20-"), std::string::npos) << m;
    EXPECT_NE(m.find("remove all the checkpoints in"), std::string::npos) << m;
  }
}

// Pruning counts only checkpoints: three junk files with the highest step numbers used to
// make every real checkpoint be deleted right after it was written.
TEST(Checkpoint, PruneKeepsTheNewestValidOnesAndLeavesJunkAlone) {
  auto dir = tempDir("prune");
  std::filesystem::create_directories(dir);
  for (int i = 7; i <= 9; ++i) std::ofstream(dir + fmt::format("/ckpt-000000999{}.bin", i)) << "random junk " << i;
  std::vector<std::string> warnings;
  for (long long step = 1; step <= 5; ++step) {
    TrainState s{1, step, 0, 0, 1, {1, 2}, {0, 0}, {}};
    saveCheckpoint(dir, s, 3, [&](const std::string& w) { warnings.push_back(w); });
  }
  std::vector<std::string> left;
  for (const auto& e : std::filesystem::directory_iterator(dir)) left.push_back(e.path().filename().string());
  std::sort(left.begin(), left.end());
  EXPECT_EQ(left, (std::vector<std::string>{"ckpt-0000000003.bin", "ckpt-0000000004.bin", "ckpt-0000000005.bin",
                                            "ckpt-0000009997.bin", "ckpt-0000009998.bin", "ckpt-0000009999.bin"}));
  ASSERT_EQ(warnings.size(), 3u);  // once per junk file, not at every save
  EXPECT_NE(warnings[0].find("is named like a checkpoint but is not a dtrain checkpoint"), std::string::npos);
  // keep 1 with newer-numbered valid files: the one just written stays, and those of later
  // steps (a run that resumed before them) are neither counted nor deleted.
  TrainState s{1, 2, 0, 0, 1, {1, 2}, {0, 0}, {}};
  saveCheckpoint(dir, s, 1);
  EXPECT_TRUE(std::filesystem::exists(dir + "/ckpt-0000000002.bin"));
  EXPECT_TRUE(std::filesystem::exists(dir + "/ckpt-0000000003.bin"));
}

TEST(Checkpoint, WriteReadsBackAndAFailedWriteLeavesNoPartialFile) {
  auto dir = tempDir("write");
  TrainState s{7, 11, 1, 64, 2, std::vector<float>(300000), std::vector<float>(300000), {"model: mlp"}};
  for (size_t i = 0; i < s.params.size(); ++i) {
    s.params[i] = static_cast<float>(i) * 0.5f;
    s.momentum[i] = -static_cast<float>(i);
  }
  int progress = 0;
  const std::string path = saveCheckpoint(dir, s, 3, {}, [&] { ++progress; });
  EXPECT_GE(progress, 1);  // the watchdog is fed during the write
  auto back = loadLatestCheckpoint(dir, nullptr);
  ASSERT_TRUE(back);
  EXPECT_EQ(back->step, 11);
  EXPECT_EQ(back->cursor, 64u);
  EXPECT_EQ(back->params, s.params);
  EXPECT_EQ(back->momentum, s.momentum);
  EXPECT_EQ(back->config, s.config);
  // A write that fails part way (a full disk; here a file size limit) throws and leaves
  // neither the partial temporary file nor a checkpoint behind.
  struct rlimit old {};
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &old), 0);
  auto oldHandler = ::signal(SIGXFSZ, SIG_IGN);
  struct rlimit small = old;
  small.rlim_cur = 1 << 20;
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &small), 0);
  s.step = 12;
  EXPECT_THROW(saveCheckpoint(dir, s, 3), IoError);
  ::setrlimit(RLIMIT_FSIZE, &old);
  ::signal(SIGXFSZ, oldHandler);
  std::vector<std::string> left;
  for (const auto& e : std::filesystem::directory_iterator(dir)) left.push_back(e.path().filename().string());
  EXPECT_EQ(left, (std::vector<std::string>{std::filesystem::path(path).filename().string()}));

  // A file whose checksum is right but whose counts overrun it (another writer's bug) is
  // "malformed", never read past its end; a flipped byte in the same file is "corrupt".
  std::string payload(5 * 8, '\0');
  const uint64_t huge = 1ull << 40;
  payload.append(reinterpret_cast<const char*>(&huge), 8);
  payload += std::string(16, 'x');
  std::string file = testing::checkpointFileBytes(payload);
  std::ofstream(dir + "/ckpt-0000000099.bin", std::ios::binary) << file;
  std::vector<std::string> warnings;
  auto kept = loadLatestCheckpoint(dir, [&](const std::string& w) { warnings.push_back(w); });
  ASSERT_TRUE(kept);
  EXPECT_EQ(kept->step, 11);  // the older, intact one
  ASSERT_EQ(warnings.size(), 1u);
  EXPECT_NE(warnings[0].find("ckpt-0000000099.bin is malformed"), std::string::npos) << warnings[0];
  file[20] ^= 1;
  std::ofstream(dir + "/ckpt-0000000099.bin", std::ios::binary) << file;
  warnings.clear();
  loadLatestCheckpoint(dir, [&](const std::string& w) { warnings.push_back(w); });
  ASSERT_EQ(warnings.size(), 1u);
  EXPECT_NE(warnings[0].find("corrupt (checksum mismatch)"), std::string::npos) << warnings[0];
  // Intact, but its header out of range (a step below 0, a world of -3): not resumed from.
  for (const auto& [step, world] : {std::pair<long long, long long>{-5, 2}, {99, -3}, {1ll << 62, 2}}) {
    std::string fields(5 * 8, '\0');
    std::memcpy(&fields[8], &step, 8);
    std::memcpy(&fields[32], &world, 8);
    fields += std::string(16, '\0');  // (no parameters, no optimizer state)
    std::ofstream(dir + "/ckpt-0000000099.bin", std::ios::binary | std::ios::trunc) << testing::checkpointFileBytes(fields);
    warnings.clear();
    kept = loadLatestCheckpoint(dir, [&](const std::string& w) { warnings.push_back(w); });
    ASSERT_TRUE(kept);
    EXPECT_EQ(kept->step, 11);
    ASSERT_EQ(warnings.size(), 1u);
    EXPECT_NE(warnings[0].find("is malformed (step " + std::to_string(step)), std::string::npos) << warnings[0];
  }
  // Found by a fuzzer (helper-70), each intact by its checksum: an epoch beyond its steps (2^31
  // ran away in the trainer's int), a copy of an older checkpoint under a newer name (resumed
  // from, the newer ones pruned), weights that are not finite; a FIFO named like a checkpoint
  // (the open blocked for good); a name that is not all digits.
  auto header = [](long long step, long long epoch) {
    std::string fields(5 * 8, '\0');
    std::memcpy(&fields[8], &step, 8);
    std::memcpy(&fields[16], &epoch, 8);
    const long long world = 2;
    std::memcpy(&fields[32], &world, 8);
    return fields;
  };
  auto onlyWarning = [&](const std::string& said) {
    warnings.clear();
    kept = loadLatestCheckpoint(dir, [&](const std::string& w) { warnings.push_back(w); });
    ASSERT_TRUE(kept);
    EXPECT_EQ(kept->step, 11);
    ASSERT_EQ(warnings.size(), 1u);
    EXPECT_NE(warnings[0].find(said), std::string::npos) << warnings[0];
  };
  std::ofstream(dir + "/ckpt-0000000099.bin", std::ios::binary | std::ios::trunc)
      << testing::checkpointFileBytes(header(99, 1ll << 31) + std::string(16, '\0'));
  onlyWarning("is malformed (step 99, epoch 2147483648");
  std::filesystem::copy_file(path, dir + "/ckpt-0000000099.bin", std::filesystem::copy_options::overwrite_existing);
  onlyWarning("is malformed (named for step 99, it holds step 11");
  const uint64_t one = 1, none = 0;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::string weights = header(99, 1);
  weights.append(reinterpret_cast<const char*>(&one), 8).append(reinterpret_cast<const char*>(&nan), 4);
  weights.append(reinterpret_cast<const char*>(&none), 8);
  std::ofstream(dir + "/ckpt-0000000099.bin", std::ios::binary | std::ios::trunc) << testing::checkpointFileBytes(weights);
  onlyWarning("is malformed (weights or optimizer state that are not finite numbers)");
  std::filesystem::remove(dir + "/ckpt-0000000099.bin");
  ASSERT_EQ(::mkfifo((dir + "/ckpt-0000000099.bin").c_str(), 0600), 0);
  onlyWarning("ckpt-0000000099.bin is not a regular file");
  std::filesystem::remove(dir + "/ckpt-0000000099.bin");
  std::filesystem::copy_file(path, dir + "/ckpt-99x.bin");
  warnings.clear();
  kept = loadLatestCheckpoint(dir, [&](const std::string& w) { warnings.push_back(w); });
  ASSERT_TRUE(kept);
  EXPECT_EQ(kept->step, 11);
  EXPECT_TRUE(warnings.empty());
}

TEST(Data, CsvCellsReadAsStrtodReadsThem) {
  // The fast path (from_chars) and the fallback (strtod: '+', hex) give what strtod gives;
  // anything else in a cell is refused with the line and column.
  const std::string path = ::testing::TempDir() + "/dtrain_cells_" + std::to_string(::getpid()) + ".csv";
  const std::vector<std::string> cells = {"1.5", " -2.25 ", "+3", "1e-3", "0x10", "\t7\t", "0.1", "-0", "12345678.9"};
  {
    std::ofstream f(path);
    f << "a,b,c,label\n";
    for (size_t i = 0; i < cells.size(); i += 3) f << cells[i] << "," << cells[i + 1] << "," << cells[i + 2] << "," << i / 3 << ".0\r\n";
  }
  spec::TrainerSpec t = small(4);
  t.model.layers = {3, 8, 3};
  t.data.type = "csv";
  t.data.path = path;
  t.data.label_column = "label";
  auto d = openDatasets(t).train;
  ASSERT_EQ(d->size(), 3u);
  for (uint64_t r = 0; r < 3; ++r) {
    float x[3];
    int label = -1;
    d->sample(r, x, &label, nullptr);
    EXPECT_EQ(label, static_cast<int>(r));
    for (int c = 0; c < 3; ++c)
      EXPECT_EQ(x[c], static_cast<float>(std::strtod(cells[r * 3 + c].c_str(), nullptr))) << cells[r * 3 + c];
  }
  for (const std::string bad : {"1.5x", "", "--1", "1 2"}) {
    std::ofstream(path) << "a,b,c,label\n1," << bad << ",3,0\n";
    try {
      openDatasets(t);
      ADD_FAILURE() << "accepted \"" << bad << "\"";
    } catch (const SpecError& e) {
      EXPECT_NE(std::string(e.what()).find(":2: column 1 (0-based, as /trainer/data/label_column counts) is not a number"), std::string::npos) << e.what();
    }
  }
  std::filesystem::remove(path);
}

// A JSON number is a column index; a string a header name, even one of digits (the header
// "a,4,b,c" with label_column "4" labels by column 1, not column 4: before, any string of
// digits was an index, and such a file trained on the wrong column, silently). Digits that
// name no column still index, as specs from before wrote indexes.
TEST(Data, CsvLabelColumnStringIsAHeaderNameANumberAnIndex) {
  const std::string path = ::testing::TempDir() + "/dtrain_lc_" + std::to_string(::getpid()) + ".csv";
  std::ofstream(path) << "a,4,b,c,d\n0,1,0,0,2\n0,0,0,0,1\n";
  spec::TrainerSpec t = small(4);
  t.model.layers = {4, 8, 3};
  t.data.type = "csv";
  t.data.path = path;
  auto firstLabels = [&] {
    auto d = openDatasets(t).train;
    std::vector<int> out;
    for (uint64_t r = 0; r < d->size(); ++r) {
      float x[4];
      int label = -1;
      d->sample(r, x, &label, nullptr);
      out.push_back(label);
    }
    return out;
  };
  t.data.label_column = "4";
  t.data.label_column_is_index = false;
  EXPECT_EQ(firstLabels(), (std::vector<int>{1, 0}));  // the column named "4"
  t.data.label_column_is_index = true;
  EXPECT_EQ(firstLabels(), (std::vector<int>{2, 1}));  // column 4
  t.data.label_column = "3";
  t.data.label_column_is_index = false;
  EXPECT_EQ(firstLabels(), (std::vector<int>{0, 0}));  // no column named "3": column 3
  std::filesystem::remove(path);
}

// Lines are read in 64 KiB pieces: a row longer than a piece reads whole, and a file with no
// line ends is refused at the line limit (1 MiB here) instead of being read into one string.
TEST(Data, CsvLinesLongerThanAPieceReadAndAFileWithoutLineEndsIsRefused) {
  const std::string path = ::testing::TempDir() + "/dtrain_lines_" + std::to_string(::getpid()) + ".csv";
  constexpr int kInputs = 20000;  // rows of ~160 KB: three pieces each
  {
    std::ofstream f(path);
    f << "label";
    for (int c = 0; c < kInputs; ++c) f << ",f" << c;
    f << "\n";
    for (int r = 0; r < 3; ++r) {
      f << r;
      for (int c = 0; c < kInputs; ++c) f << "," << (c % 97) * 0.25 + r;
      f << (r == 2 ? "" : "\r\n");  // (the last row without a line end)
    }
  }
  spec::TrainerSpec t = small(4);
  t.model.layers = {kInputs, 4, 3};
  t.data.type = "csv";
  t.data.path = path;
  t.data.label_column = "label";
  auto d = openDatasets(t).train;
  ASSERT_EQ(d->size(), 3u);
  std::vector<float> x(kInputs);
  for (uint64_t r = 0; r < 3; ++r) {
    int label = -1;
    d->sample(r, x.data(), &label, nullptr);
    EXPECT_EQ(label, static_cast<int>(r));
    for (int c : {0, 8191, 8192, 13000, kInputs - 1}) EXPECT_EQ(x[c], (c % 97) * 0.25f + r) << r << " " << c;
  }
  // 8 MB of cells and no line end, read whole before: refused at 1 MiB, naming the line.
  t.model.layers = {2, 4, 3};
  {
    std::ofstream f(path);
    f << "a,b,label\n";
    for (int i = 0; i < 1000000; ++i) f << "1.0,2.0,";
  }
  try {
    openDatasets(t);
    ADD_FAILURE() << "accepted a file without line ends";
  } catch (const SpecError& e) {
    EXPECT_NE(std::string(e.what()).find(":2: a line longer than 1048576 bytes: no line ends?"), std::string::npos)
        << e.what();
  }
  // The same with CR alone as line ends: said as that.
  {
    std::ofstream f(path);
    for (int i = 0; i < 200000; ++i) f << "1.0,2.0,0\r";
  }
  try {
    openDatasets(t);
    ADD_FAILURE() << "accepted CR line ends";
  } catch (const SpecError& e) {
    EXPECT_NE(std::string(e.what()).find(":1: the lines end with a carriage return alone"), std::string::npos)
        << e.what();
  }
  std::filesystem::remove(path);
}

// openDatasets' poll (the launcher's stop-signal check) is called as a csv is parsed, every
// 65536 rows or 4 MiB, and what it throws ends the parse.
TEST(Data, ParsingPollsAndStopsWhenThePollThrows) {
  const std::string path = ::testing::TempDir() + "/dtrain_poll_" + std::to_string(::getpid()) + ".csv";
  {
    std::ofstream f(path);
    f << "a,b,label\n";
    for (int i = 0; i < 200000; ++i) f << "0.5,1.5," << i % 3 << "\n";
  }
  spec::TrainerSpec t = small(4);
  t.model.layers = {2, 8, 3};
  t.data.type = "csv";
  t.data.path = path;
  int calls = 0;
  auto all = openDatasets(t, [&] { ++calls; });
  EXPECT_EQ(calls, 3) << "200001 lines: at lines 65536, 131072 and 196608";
  EXPECT_EQ(all.train->size() + all.eval->size(), 200000u);
  struct Stop {};
  calls = 0;
  EXPECT_THROW(openDatasets(t, [&] {
                 if (++calls == 2) throw Stop{};
               }),
               Stop);
  EXPECT_EQ(calls, 2);
  // Wide rows: every 4 MiB as well (1000 rows of 9 KB: 2 polls).
  {
    std::ofstream f(path);
    for (int c = 0; c < 1000; ++c) f << "c" << c << (c < 999 ? "," : "\n");
    for (int r = 0; r < 1000; ++r)
      for (int c = 0; c < 1000; ++c) f << (c < 999 ? "0.123456," : "1\n");
  }
  t.model.layers = {999, 8, 3};
  t.data.label_column = "c999";
  calls = 0;
  openDatasets(t, [&] { ++calls; });
  EXPECT_EQ(calls, 2);
  std::filesystem::remove(path);
}

TEST(Checkpoint, PreparingTheDirectoryPeeksAtTheNewestWithoutReadingTheWeights) {
  // The pre-check reads the header and counts only: a file of an older dtrain (no config
  // description) whose parameter count differs is still refused, by its counts; a file
  // whose header does not read is passed over for the next one.
  auto t = small(32);
  t.checkpoint.dir = tempDir("peek");
  size_t params = 0;
  for (size_t i = 0; i + 1 < t.model.layers.size(); ++i)
    params += static_cast<size_t>(t.model.layers[i] * t.model.layers[i + 1] + t.model.layers[i + 1]);
  TrainState s{configHash(t), 5, 0, 0, 1, std::vector<float>(params + 3), std::vector<float>(params + 3), {}};
  saveCheckpoint(t.checkpoint.dir, s, 3);
  std::ofstream(t.checkpoint.dir + "/ckpt-0000000009.bin") << "junk";
  try {
    (void)prepareCheckpointDir(t, "job.json");
    ADD_FAILURE() << "no error";
  } catch (const SpecError& e) {
    EXPECT_NE(std::string(e.what()).find("ckpt-0000000005.bin (step 5) was written by a different trainer config: the "
                                         "model changed (the checkpoint holds " +
                                         std::to_string(params + 3) + " parameters"),
              std::string::npos)
        << e.what();
  }
  s.params.resize(params);
  s.momentum.resize(params);
  s.step = 6;
  saveCheckpoint(t.checkpoint.dir, s, 3);
  (void)prepareCheckpointDir(t, "job.json");  // the newest readable one agrees
  // A newer one damaged where the config hash is: not taken for another config (the peek
  // alone would say so), but verified, found corrupt and skipped, as rank 0 skips it.
  s.step = 7;
  const std::string damaged = saveCheckpoint(t.checkpoint.dir, s, 3);
  {
    std::fstream f(damaged, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(16);
    f.put('\x5a');
  }
  (void)prepareCheckpointDir(t, "job.json");
}

TEST(Checkpoint, ResumeLineSaysWhenTheJobIsComplete) {
  auto t = small(32);
  t.epochs = 2;
  t.max_steps = 0;
  int64_t h[5] = {1, 624, 2, 0, 2};
  EXPECT_EQ(resumeLine("/c/x.bin", h, 2, true, t),
            "resuming from /c/x.bin: step 624, which completes the job (2 epochs); nothing left to train (written by 2 "
            "workers, now 2)");
  int64_t mid[5] = {1, 300, 1, 6400, 2};
  EXPECT_EQ(resumeLine("/c/x.bin", mid, 4, false, t),
            "resuming from /c/x.bin: step 300, epoch 2, sample 6400 of the epoch (written by 2 workers, now 4)");
}

}  // namespace
}  // namespace dtrain::train

namespace dtrain::train {
namespace {

// A line of metrics.jsonl cut short (its writer killed mid-write, a full disk) is ended
// before the next run appends: that run's start row stays a line of its own, so the reader
// knows where it resumed and replaces the replayed steps.
TEST(Metrics, ATornLastLineIsEndedBeforeTheNextRunAppends) {
  const std::string dir = tempDir("metrics-torn");
  std::filesystem::create_directories(dir);
  const spec::MetricsRun a{"run-a", 0, 2, 0, "/ck", "h"}, b{"run-b", 0, 2, 20, "/ck", "h"};
  std::string text = spec::metricsStartLine(a, "t");
  for (long long s = 10; s <= 30; s += 10) text += spec::metricsTrainLine(a, {s, 1, 1.0, 0.5, 0, 0.1, 0});
  text += "{\"type\": \"train\", \"run_id\": \"run-a\", \"att";  // killed mid-row
  std::ofstream(dir + "/metrics.jsonl") << text;
  {
    MetricsLog log(dir, b);  // resumed from step 20
    log.record({30, 1, 2.0, 0.5, 0, 0.1, 0});
    log.finish();
  }
  std::ifstream in(dir + "/metrics.jsonl");
  const spec::MetricsCurve curve = spec::readMetricsRun(in, b);
  ASSERT_EQ(curve.points.size(), 3u);
  EXPECT_EQ(curve.points[2].step, 30);
  EXPECT_EQ(curve.points[2].loss, 2.0) << "run-a's step 30 was redone by run-b";
  std::ifstream lines(dir + "/metrics.jsonl");
  std::string line;
  int startsOfB = 0;
  while (std::getline(lines, line)) startsOfB += line.rfind("{\"type\": \"start\", \"run_id\": \"run-b\"", 0) == 0;
  EXPECT_EQ(startsOfB, 1);
  EXPECT_TRUE(std::filesystem::exists(dir + "/metrics.svg"));
}

TEST(Optimizer, LearningRateSchedules) {
  spec::TrainerSpec t;
  t.optimizer.lr = 1.0;
  EXPECT_DOUBLE_EQ(learningRate(t, 50, 100), 1.0);
  t.lr_schedule.type = "step";
  t.lr_schedule.step_size = 10;
  t.lr_schedule.gamma = 0.5;
  EXPECT_DOUBLE_EQ(learningRate(t, 9, 100), 1.0);
  EXPECT_DOUBLE_EQ(learningRate(t, 10, 100), 0.5);
  EXPECT_DOUBLE_EQ(learningRate(t, 25, 100), 0.25);
  t.lr_schedule = {};
  t.lr_schedule.type = "warmup_cosine";
  t.lr_schedule.warmup_steps = 10;
  t.lr_schedule.min_lr = 0.1;
  EXPECT_DOUBLE_EQ(learningRate(t, 0, 110), 0.1);
  EXPECT_DOUBLE_EQ(learningRate(t, 9, 110), 1.0);
  EXPECT_NEAR(learningRate(t, 60, 110), 0.55, 1e-12);  // half way: (1 + 0.1) / 2
  EXPECT_NEAR(learningRate(t, 110, 110), 0.1, 1e-12);
}

TEST(Optimizer, AdamWLearnsAndResumesBitIdentically) {
  auto t = small(32);
  t.optimizer.type = "adamw";
  t.optimizer.lr = 0.003;
  t.optimizer.momentum = 0;
  t.optimizer.weight_decay = 0.01;
  // A schedule that does not depend on the total step count: the "interrupted" run below is
  // made by a smaller max_steps, which would change a cosine schedule's horizon.
  t.lr_schedule.type = "step";
  t.lr_schedule.step_size = 7;
  t.lr_schedule.gamma = 0.7;
  t.max_steps = 30;
  auto straight = runWith(2, t);
  t.checkpoint.dir = tempDir("adamw");
  t.max_steps = 12;
  runWith(2, t);
  t.max_steps = 30;
  auto resumed = runWith(2, t);
  EXPECT_EQ(resumed[0], straight[0]);

  t.checkpoint.dir.clear();
  t.max_steps = 0;
  t.epochs = 4;
  t.data.train_samples = 20000;
  t.model.layers = {64, 128, 4};
  std::vector<TrainResult> res;
  runWorld(2, t, &res);
  EXPECT_GT(res[0].eval_accuracy, 0.9);
}

TEST(Optimizer, GradientClippingBoundsTheStep) {
  auto t = small(32);
  t.optimizer.momentum = 0;
  t.optimizer.lr = 0.1;
  t.grad_clip_norm = 1e-3;
  t.max_steps = 1;
  auto after = runWith(1, t);
  t.max_steps = 0;
  t.epochs = 1;
  // Step 0 from the same init: the weights before any update.
  Mlp m({t.model.layers, Activation::kRelu, Loss::kCrossEntropy});
  m.init(t.seed);
  double sq = 0;
  for (size_t i = 0; i < after[0].size(); ++i) sq += std::pow(after[0][i] - m.params()[i], 2);
  EXPECT_LE(std::sqrt(sq), 0.1 * 1e-3 * 1.001);
  EXPECT_GT(std::sqrt(sq), 0.1 * 1e-3 * 0.9);
}

TEST(Device, ResolvesCpuAutoAndCuda) {
  EXPECT_FALSE(resolveDevice("cpu", 0).cuda);
  EXPECT_EQ(resolveDevice("cpu", 3).name, "cpu");
  EXPECT_THROW(resolveDevice("tpu", 0), SpecError);
  if (!cudaBuild()) {
    EXPECT_EQ(resolveDevice("auto", 0).name, "cpu");
    try {
      resolveDevice("cuda", 0);
      FAIL() << "cuda in a CPU build";
    } catch (const SpecError& e) {
      EXPECT_NE(std::string(e.what()).find("trainer.device is \"cuda\" but this is a CPU build"), std::string::npos)
          << e.what();
    }
  }
  if (visibleGpus() == 0) EXPECT_EQ(resolveDevice("auto", 0, 1).name, "cpu");
}

}  // namespace
}  // namespace dtrain::train
