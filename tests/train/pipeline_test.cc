// The pipeline trainer against the data-parallel one: ranks are threads over a HashStore.
#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <regex>
#include <thread>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include "dtrain/comm/communicator.h"
#include "dtrain/common/errors.h"
#include "dtrain/common/fd.h"
#include "dtrain/spec/checkpoint_manifest.h"
#include "dtrain/store/hash_store.h"
#include "dtrain/train/checkpoint.h"
#include "dtrain/train/device.h"
#include "dtrain/train/pipeline.h"
#include "dtrain/train/trainer.h"

namespace dtrain::train {
namespace {

spec::TrainerSpec model(int stages, int micro, const std::string& schedule) {
  spec::TrainerSpec t;
  t.device = "cpu";
  t.model.layers = {20, 32, 24, 16, 4};
  t.data.train_samples = 4096;
  t.data.eval_samples = 300;
  t.batch_size = 32;
  t.max_steps = 12;
  t.optimizer.lr = 0.05;
  t.optimizer.momentum = 0.9;
  t.log_every_steps = 1;
  t.parallel.pipeline_stages = stages;
  t.parallel.micro_batches = micro;
  t.parallel.schedule = schedule;
  return t;
}

struct Run {
  std::vector<TrainResult> results;
  std::vector<float> weights;  // the whole model (rank 0)
  std::vector<double> losses;  // rank 0's logged loss per step
};

Run run(int world, const spec::TrainerSpec& t) {
  auto store = std::make_shared<store::HashStore>();
  Run out;
  out.results.resize(static_cast<size_t>(world));
  std::vector<std::vector<float>> params(static_cast<size_t>(world));
  std::vector<std::thread> ts;
  for (int r = 0; r < world; ++r)
    ts.emplace_back([&, r] {
      auto c = comm::createTcpCommunicator(store, r, world, {});
      TrainOptions o;
      o.final_params = &params[static_cast<size_t>(r)];
      if (r == 0)
        o.log = [&](const std::string& line) {
          static const std::regex re(R"(step (\d+)/\d+ loss ([0-9.]+))");
          std::smatch m;
          if (std::regex_search(line, m, re)) out.losses.push_back(std::stod(m[2]));
        };
      out.results[static_cast<size_t>(r)] = train(t, *c, o);
    });
  for (auto& th : ts) th.join();
  out.weights = params[0];
  return out;
}

// How many of `world` ranks training t fail with a SpecError containing `text`.
int refusals(int world, const spec::TrainerSpec& t, const std::string& text) {
  auto store = std::make_shared<store::HashStore>();
  std::vector<std::thread> ts;
  std::atomic<int> refused{0};
  for (int r = 0; r < world; ++r)
    ts.emplace_back([&, r] {
      auto c = comm::createTcpCommunicator(store, r, world, {});
      try {
        train(t, *c);
      } catch (const SpecError& e) {
        if (std::string(e.what()).find(text) != std::string::npos) ++refused;
      }
    });
  for (auto& th : ts) th.join();
  return refused.load();
}

void expectClose(const Run& a, const Run& b) {
  ASSERT_EQ(a.weights.size(), b.weights.size());
  double maxDiff = 0, maxAbs = 0;
  for (size_t i = 0; i < a.weights.size(); ++i) {
    maxDiff = std::max(maxDiff, static_cast<double>(std::fabs(a.weights[i] - b.weights[i])));
    maxAbs = std::max(maxAbs, static_cast<double>(std::fabs(a.weights[i])));
  }
  // Float tolerance: the micro-batch and replica sums run in another order than with P = 1.
  std::printf("    max |w - w_ref| %.3g (max |w| %.3g, relative %.3g)\n", maxDiff, maxAbs, maxDiff / maxAbs);
  EXPECT_LT(maxDiff, 1e-5 * std::max(1.0, maxAbs)) << "max |w| " << maxAbs;
  ASSERT_EQ(a.losses.size(), b.losses.size());
  ASSERT_FALSE(a.losses.empty());
  for (size_t i = 0; i < a.losses.size(); ++i) EXPECT_NEAR(a.losses[i], b.losses[i], 2e-4) << "step " << i + 1;
  EXPECT_NEAR(a.results[0].final_loss, b.results[0].final_loss, 1e-5 * std::max(1.0, b.results[0].final_loss));
  EXPECT_NEAR(a.results[0].eval_loss, b.results[0].eval_loss, 1e-4);
}

TEST(Pipeline, PartitionBalancesParameters) {
  // Layer parameters: 16640, 65792, 65792, 2570.
  EXPECT_EQ(partitionStages({64, 256, 256, 256, 10}, 2), (std::vector<int>{0, 2, 4}));
  EXPECT_EQ(partitionStages({64, 256, 256, 256, 10}, 4), (std::vector<int>{0, 1, 2, 3, 4}));
  EXPECT_EQ(partitionStages({64, 256, 256, 256, 10}, 2, {1, 3}), (std::vector<int>{0, 1, 4}));
  EXPECT_THROW(partitionStages({8, 4}, 2), SpecError);
  auto l = pipelineLayout(5, 6, 2);
  EXPECT_EQ(l.stage, 1);
  EXPECT_EQ(l.replica, 2);
  EXPECT_EQ(l.replicas, 3);
  EXPECT_THROW(pipelineLayout(0, 3, 2), SpecError);
}

TEST(Pipeline, TwoStagesMatchOneWorker) {
  auto one = run(1, model(1, 1, "1f1b"));
  auto onefoneb = run(2, model(2, 4, "1f1b"));
  auto gpipe = run(2, model(2, 4, "gpipe"));
  expectClose(onefoneb, one);
  // Both schedules accumulate the micro-batches in the same order.
  EXPECT_EQ(onefoneb.weights, gpipe.weights);
  EXPECT_EQ(onefoneb.results[0].weights_sha256, gpipe.results[0].weights_sha256);
  EXPECT_EQ(onefoneb.results[0].weights_sha256, onefoneb.results[1].weights_sha256);
  EXPECT_EQ(onefoneb.results[0].steps, 12);
}

TEST(Pipeline, TwoStagesTimesTwoReplicasMatchTwoDataParallelWorkers) {
  auto dp = run(2, model(1, 1, "1f1b"));
  auto pp = run(4, model(2, 2, "1f1b"));
  expectClose(pp, dp);
  for (const auto& r : pp.results) EXPECT_EQ(r.weights_sha256, pp.results[0].weights_sha256);
}

TEST(Pipeline, FourStagesAdamWClippingMatchOneWorker) {
  auto t1 = model(1, 1, "1f1b");
  t1.optimizer.type = "adamw";
  t1.optimizer.lr = 0.01;
  t1.optimizer.weight_decay = 0.01;
  t1.grad_clip_norm = 0.5;
  auto t4 = t1;
  t4.parallel = model(4, 8, "1f1b").parallel;
  expectClose(run(4, t4), run(1, t1));
}

TEST(Pipeline, StagesHoldTheirShareAndOneFOneBStashesLess) {
  auto t = model(2, 8, "gpipe");
  t.model.layers = {64, 256, 256, 256, 10};
  t.max_steps = 3;
  auto g = run(2, t);
  t.parallel.schedule = "1f1b";
  auto f = run(2, t);
  const size_t total = 16640 + 65792 + 65792 + 2570;
  EXPECT_EQ(g.results[0].stage_params + g.results[1].stage_params, total);
  for (const auto& r : g.results) EXPECT_LT(r.stage_params, total * 6 / 10);  // ~1/2 each
  for (int r = 0; r < 2; ++r) {
    // GPipe stashes all 8 micro-batches; 1F1B at most P - stage = 2 (stage 0) or 1 (stage 1).
    EXPECT_LT(f.results[static_cast<size_t>(r)].peak_activation_bytes * 3, g.results[static_cast<size_t>(r)].peak_activation_bytes)
        << "rank " << r;
  }
  for (int r = 0; r < 2; ++r)
    std::printf("    rank %d: %zu of %zu params; peak stashed activations gpipe %zu B, 1f1b %zu B\n", r,
                g.results[static_cast<size_t>(r)].stage_params, total, g.results[static_cast<size_t>(r)].peak_activation_bytes,
                f.results[static_cast<size_t>(r)].peak_activation_bytes);
  EXPECT_EQ(f.weights, g.weights);
  EXPECT_GE(f.results[0].bubble_fraction, 0.0);
  EXPECT_LT(f.results[0].bubble_fraction, 1.0);
  EXPECT_EQ(f.results[0].stage_ms.size(), 2u);
}

// Three replicas: the stage groups' all-reduce starts layer by layer during the last
// backward (overlap) or after it; both reduce the same layers in the same order, so the
// weights must be bit-identical (a race between the reduction and the backward would show).
TEST(Pipeline, StageGroupReductionOverlapOnAndOffAreBitIdentical) {
  auto t = model(2, 4, "1f1b");
  t.batch_size = 16;
  t.overlap = true;  // not "auto": that depends on this machine's cores
  auto on = run(6, t);
  t.overlap = false;
  auto off = run(6, t);
  EXPECT_EQ(on.weights, off.weights);
  for (const auto& r : on.results) EXPECT_EQ(r.weights_sha256, on.results[0].weights_sha256);
  auto dp = model(1, 1, "1f1b");
  dp.batch_size = 16;
  expectClose(on, run(3, dp));
}

// The first stage's inputs and the last stage's targets loaded one step ahead
// (trainer.data.prefetch) are the inline ones: bit-identical weights, across epochs.
TEST(Pipeline, PrefetchedBatchesGiveTheSameWeights) {
  auto t = model(2, 4, "1f1b");
  t.data.train_samples = 600;  // 9 steps per epoch with 2 replicas of 32
  t.epochs = 2;
  t.max_steps = 0;
  t.data.prefetch = false;
  auto inline_ = run(4, t);
  t.data.prefetch = true;
  auto prefetched = run(4, t);
  EXPECT_EQ(prefetched.weights, inline_.weights);
  EXPECT_EQ(prefetched.losses, inline_.losses);
  EXPECT_EQ(prefetched.results[0].steps, 18);
}

// 8 MiB activations and gradients per micro-batch, more than the socket buffers hold: 1F1B's
// steady state exchanges them with a neighbour in both directions at once.
TEST(Pipeline, ActivationsLargerThanSocketBuffersDoNotDeadlock) {
  auto t = model(2, 4, "1f1b");
  t.model.layers = {16, 32768, 8, 4};
  t.batch_size = 256;
  t.max_steps = 2;
  t.data.eval_samples = 64;
  auto a = run(2, t);
  t.parallel.schedule = "gpipe";
  auto b = run(2, t);
  EXPECT_EQ(a.weights, b.weights);
  EXPECT_EQ(a.results[0].steps, 2);
}

TEST(Pipeline, WorldNotAMultipleOfTheStagesIsRefused) {
  EXPECT_EQ(refusals(3, model(2, 2, "1f1b"), "does not divide the world size 3"), 3);
}

// Without a GPU (or in a CPU build) "cuda" is refused on every rank before any transfer;
// with one, tests/train/gpu_train_test.cc runs the GPU stages.
TEST(Pipeline, CudaWithoutAGpuIsRefused) {
  if (visibleGpus() > 0) GTEST_SKIP() << "a GPU is visible: GpuPipeline.* covers cuda";
  auto t = model(2, 2, "1f1b");
  t.device = "cuda";
  EXPECT_EQ(refusals(2, t, "trainer.device is \"cuda\" but"), 2);
}

TEST(Pipeline, ResumeFromStageCheckpointsIsBitIdentical) {
  std::string dir = ::testing::TempDir() + "/dtrain_pipe_ckpt_" + std::to_string(::getpid());
  std::filesystem::remove_all(dir);
  auto t = model(2, 2, "1f1b");
  t.max_steps = 16;
  auto straight = run(4, t);
  t.checkpoint.dir = dir;
  t.max_steps = 8;
  run(4, t);
  EXPECT_TRUE(std::filesystem::exists(dir + "/stage-0-of-2"));
  EXPECT_TRUE(std::filesystem::exists(dir + "/stage-1-of-2"));
  t.max_steps = 16;
  auto resumed = run(4, t);
  EXPECT_EQ(resumed.weights, straight.weights);
  EXPECT_EQ(resumed.results[0].steps, 16);
  std::filesystem::remove_all(dir);
}

// The manifest names the newest step all stages wrote and the layout; another layout on the
// same directory is refused on every rank (not a silent fresh start); a damaged manifest is
// only a warning.
// A manifest write that fails says the OS's reason (checkpointWriteRefusal puts it first) and
// leaves no partial .tmp: its .tmp is a link to /dev/full, where every write is ENOSPC.
TEST(Pipeline, ManifestWriteFailureSaysWhyAndLeavesNoTmp) {
  const std::string dir = ::testing::TempDir() + "/dtrain_manifest_full_" + std::to_string(::getpid());
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  std::filesystem::create_symlink("/dev/full", dir + "/manifest.json.tmp");
  spec::PipelineManifest m;
  m.step = 4;
  m.stages = 2;
  m.stage_layers = {1, 1};
  m.files = {"stage-0-of-2/ckpt-0000000004.bin", "stage-1-of-2/ckpt-0000000004.bin"};
  try {
    spec::writePipelineManifest(dir + "/manifest.json", m);
    FAIL() << "a write to /dev/full succeeded";
  } catch (const IoError& e) {
    EXPECT_NE(std::string(e.what()).find("cannot write " + dir + "/manifest.json.tmp: No space left on device"),
              std::string::npos)
        << e.what();
  }
  EXPECT_FALSE(std::filesystem::exists(std::filesystem::symlink_status(dir + "/manifest.json.tmp")));
  EXPECT_FALSE(std::filesystem::exists(dir + "/manifest.json"));
  std::filesystem::remove_all(dir);
}

// Through the directory held open: one swapped in under its name gets no manifest (the
// trainer writes it beside the stage files, which go through the held directory too).
TEST(Pipeline, ManifestWrittenThroughTheHeldDirectory) {
  const std::string base = ::testing::TempDir() + "/dtrain_manifest_at_" + std::to_string(::getpid());
  std::filesystem::remove_all(base);
  std::filesystem::create_directories(base + "/ck");
  Fd dirFd(::open((base + "/ck").c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  ASSERT_TRUE(dirFd);
  std::filesystem::rename(base + "/ck", base + "/moved");
  std::filesystem::create_directories(base + "/ck");
  spec::PipelineManifest m;
  m.step = 4;
  m.stages = 2;
  m.stage_layers = {1, 1};
  m.files = {"stage-0-of-2/ckpt-0000000004.bin", "stage-1-of-2/ckpt-0000000004.bin"};
  spec::writePipelineManifest(base + "/ck/manifest.json", m, dirFd.get());
  EXPECT_TRUE(std::filesystem::is_empty(base + "/ck"));
  const auto back = spec::readPipelineManifest(base + "/moved/manifest.json");
  ASSERT_TRUE(back.has_value());
  EXPECT_EQ(back->step, 4);
  EXPECT_FALSE(std::filesystem::exists(base + "/moved/manifest.json.tmp"));
  std::filesystem::remove_all(base);
}

TEST(Pipeline, CheckpointManifestTiesTheStagesAndGuardsTheLayout) {
  std::string dir = ::testing::TempDir() + "/dtrain_pipe_manifest_" + std::to_string(::getpid());
  std::filesystem::remove_all(dir);
  auto t = model(2, 2, "1f1b");
  t.checkpoint.dir = dir;
  t.checkpoint.every_steps = 5;
  t.max_steps = 12;
  run(2, t);
  auto m = spec::readPipelineManifest(dir + "/manifest.json");
  ASSERT_TRUE(m.has_value());
  EXPECT_EQ(m->step, 12);
  EXPECT_EQ(m->stages, 2);
  EXPECT_EQ(m->stage_layers, (std::vector<int>{1, 3}));
  ASSERT_EQ(m->files.size(), 2u);
  for (const auto& f : m->files) EXPECT_TRUE(std::filesystem::exists(dir + "/" + f)) << f;
  EXPECT_EQ(m->files[1], "stage-1-of-2/ckpt-0000000012.bin");

  auto four = t;
  four.parallel.pipeline_stages = 4;
  four.max_steps = 16;
  EXPECT_EQ(refusals(4, four,
                     "manifest.json (step 12) was written by a pipeline of 2 stages with layers per stage [1, "
                     "3], this job is a pipeline of 4 stages with layers per stage [1, 1, 1, 1]; "),
            4);  // (every rank, with rank 0's words)
  auto other = t;
  other.parallel.stage_layers = {2, 2};
  other.max_steps = 16;
  // Every rank refuses, each with rank 0's words (whichever exits first makes the headline).
  EXPECT_EQ(refusals(2, other, "trainer: /trainer/parallel/pipeline_stages: "), 2);
  EXPECT_EQ(refusals(2, other, "or pipeline_stages 2 with stage_layers [1, 3] (the layout they were written with)"), 2);

  {
    std::FILE* f = std::fopen((dir + "/manifest.json").c_str(), "w");
    std::fputs("{\"format\": \"dtrain-pipeline-checkpoint/1\", \"step\": \"x\"}", f);
    std::fclose(f);
  }
  EXPECT_THROW(spec::readPipelineManifest(dir + "/manifest.json"), SpecError);
  // Cut short or damaged: said as such, not as "not a JSON object".
  for (const auto& [text, said] : {std::pair<const char*, const char*>{"", "manifest.json: empty (a save cut short?)"},
                                   {"{\"format\": \"dtrain-pipe", "manifest.json: not valid JSON (damaged"},
                                   {"[1, 2]", "manifest.json: not a JSON object; remove it"}}) {
    std::ofstream(dir + "/manifest.json", std::ios::trunc) << text;
    try {
      spec::readPipelineManifest(dir + "/manifest.json");
      ADD_FAILURE() << "no error for \"" << text << "\"";
    } catch (const SpecError& e) {
      EXPECT_NE(std::string(e.what()).find(said), std::string::npos) << e.what();
    }
  }
  // Not a manifest's kind of file: said at once (a FIFO blocked the launcher's pre-check until
  // a writer came; /dev/zero would have been read until memory ran out).
  std::filesystem::remove(dir + "/manifest.json");
  ASSERT_EQ(::mkfifo((dir + "/manifest.json").c_str(), 0600), 0);
  for (const char* said : {"manifest.json: not a regular file; remove it", "bytes, more than a manifest's"}) {
    try {
      spec::readPipelineManifest(dir + "/manifest.json");
      ADD_FAILURE() << "no error for " << said;
    } catch (const SpecError& e) {
      EXPECT_NE(std::string(e.what()).find(said), std::string::npos) << e.what();
    }
    std::filesystem::remove(dir + "/manifest.json");
    std::ofstream(dir + "/manifest.json") << std::string((1 << 20) + 1, ' ');
  }
  std::filesystem::remove(dir + "/manifest.json");
  t.max_steps = 16;
  auto resumed = run(2, t);  // warns, resumes from the stage files at step 12
  EXPECT_EQ(resumed.results[0].steps, 16);
  EXPECT_EQ(spec::readPipelineManifest(dir + "/manifest.json")->step, 16);
  std::filesystem::remove_all(dir);
}

// Another layout's checkpoints in the directory (a pipeline's stage directories and manifest
// for a data-parallel job, the data-parallel trainer's ckpt-*.bin for a pipeline, stage
// directories of another stage count without a manifest) are refused on every rank, as
// before the launch (prepareCheckpointDir), naming the file and both layouts: the job would
// not find them and would train from step 0 beside them. Junk named like a checkpoint is no
// such evidence.
TEST(Pipeline, CheckpointsOfAnotherLayoutAreRefused) {
  const std::string base = ::testing::TempDir() + "/dtrain_pipe_layout_" + std::to_string(::getpid());
  std::filesystem::remove_all(base);
  auto pipe = model(2, 2, "1f1b");
  pipe.checkpoint.dir = base + "/pp";
  pipe.checkpoint.every_steps = 5;
  run(2, pipe);  // stage-0-of-2/ and stage-1-of-2/ up to step 12, manifest.json
  auto dp = pipe;
  dp.parallel = {};
  const std::string stageFile = pipe.checkpoint.dir + "/stage-0-of-2/ckpt-0000000012.bin";
  const std::string toDp = stageFile +
                           " (step 12) was written by a pipeline of 2 stages with layers per stage [1, 3], "
                           "this job is data-parallel (pipeline_stages 1); ";
  EXPECT_EQ(checkpointLayoutMismatch(pipe), "");
  EXPECT_EQ(checkpointLayoutMismatch(dp).rfind(toDp, 0), 0u) << checkpointLayoutMismatch(dp);
  EXPECT_NE(checkpointLayoutMismatch(dp).find("use another /trainer/checkpoint/dir, or pipeline_stages 2 with "
                                              "stage_layers [1, 3] (the layout they were written with), or remove "
                                              "them (the stage-*-of-2/ directories and manifest.json in " +
                                              pipe.checkpoint.dir + ")"),
            std::string::npos);
  EXPECT_EQ(refusals(2, dp, "trainer: /trainer/parallel/pipeline_stages: "), 2);
  EXPECT_EQ(refusals(2, dp, toDp), 2);  // (every rank, with rank 0's words)
  try {
    (void)prepareCheckpointDir(dp, "job.json");
    ADD_FAILURE() << "no error";
  } catch (const SpecError& e) {
    EXPECT_EQ(std::string(e.what()).rfind("job.json: /trainer/parallel/pipeline_stages: " + toDp, 0), 0u) << e.what();
  }
  // Without the manifest (a run stopped before its first): the stage files alone.
  std::filesystem::remove(pipe.checkpoint.dir + "/manifest.json");
  EXPECT_EQ(checkpointLayoutMismatch(dp).rfind(stageFile + " (step 12) was written by a pipeline of 2 stages, this job "
                                                           "is data-parallel (pipeline_stages 1); ",
                                               0),
            0u)
      << checkpointLayoutMismatch(dp);
  EXPECT_EQ(checkpointLayoutMismatch(dp).find("manifest.json"), std::string::npos) << checkpointLayoutMismatch(dp);
  auto four = pipe;
  four.parallel.pipeline_stages = 4;
  EXPECT_NE(checkpointLayoutMismatch(four).find("was written by a pipeline of 2 stages, this job is a pipeline of 4 "
                                                "stages with layers per stage [1, 1, 1, 1]; "),
            std::string::npos);
  EXPECT_EQ(checkpointLayoutMismatch(pipe), "");

  // The other way: the data-parallel trainer's checkpoints in a pipeline job's directory.
  dp.checkpoint.dir = base + "/dp";
  run(1, dp);  // ckpt-*.bin up to step 12
  pipe.checkpoint.dir = dp.checkpoint.dir;
  const std::string toPipe = dp.checkpoint.dir +
                             "/ckpt-0000000012.bin (step 12) was written by the data-parallel "
                             "trainer (pipeline_stages 1), this job is a pipeline of 2 stages with layers per stage "
                             "[1, 3]; ";
  EXPECT_EQ(checkpointLayoutMismatch(pipe).rfind(toPipe, 0), 0u) << checkpointLayoutMismatch(pipe);
  EXPECT_NE(checkpointLayoutMismatch(pipe).find("or pipeline_stages 1 (the layout they were written with), or remove "
                                                "them (every ckpt-*.bin in " +
                                                dp.checkpoint.dir + ")"),
            std::string::npos);
  EXPECT_EQ(refusals(2, pipe, "trainer: /trainer/parallel/pipeline_stages: "), 2);
  EXPECT_EQ(refusals(2, pipe, toPipe), 2);
  EXPECT_THROW((void)prepareCheckpointDir(pipe, "job.json"), SpecError);
  EXPECT_EQ(checkpointLayoutMismatch(dp), "");
  // Both layouts' checkpoints in one directory (left by runs from before this check): each
  // job resumes its own, and the other's files are named in a warning, not a refusal whose
  // other layout would be refused the same way.
  std::filesystem::copy(base + "/pp/stage-0-of-2", dp.checkpoint.dir + "/stage-0-of-2");
  std::vector<std::string> warnings;
  EXPECT_EQ(checkpointLayoutMismatch(dp, [&](const std::string& w) { warnings.push_back(w); }), "");
  ASSERT_EQ(warnings.size(), 1u);
  EXPECT_NE(warnings[0].find("stage-0-of-2/ckpt-0000000012.bin (step 12) was written by a pipeline of 2 stages; left "
                             "alone: this job (data-parallel (pipeline_stages 1)) resumes from its own checkpoints"),
            std::string::npos)
      << warnings[0];
  EXPECT_EQ(warnings[0].find("manifest.json"), std::string::npos) << warnings[0];  // (there is none)
  EXPECT_EQ(checkpointLayoutMismatch(pipe), "");
  std::filesystem::remove_all(dp.checkpoint.dir + "/stage-0-of-2");

  // Junk and damaged files of the other layout are not: both jobs run.
  const std::string junk = base + "/junk";
  std::filesystem::create_directories(junk + "/stage-0-of-2");
  std::ofstream(junk + "/stage-0-of-2/ckpt-0000000005.bin") << "not a checkpoint";
  std::filesystem::copy_file(dp.checkpoint.dir + "/ckpt-0000000012.bin", junk + "/ckpt-0000000012.bin");
  {
    std::fstream f(junk + "/ckpt-0000000012.bin", std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(100);
    const char c = static_cast<char>(f.get());
    f.seekp(100);
    f.put(static_cast<char>(~c));  // a checksum mismatch
  }
  std::ofstream(junk + "/stage-0-of-3") << "a file, not a directory";
  dp.checkpoint.dir = pipe.checkpoint.dir = junk;
  EXPECT_EQ(checkpointLayoutMismatch(pipe), "");
  (void)prepareCheckpointDir(pipe, "job.json");
  EXPECT_EQ(run(2, pipe).results[0].steps, 12);
  std::filesystem::remove(junk + "/ckpt-0000000012.bin");
  std::filesystem::remove_all(junk + "/stage-0-of-2");
  std::filesystem::remove_all(junk + "/stage-1-of-2");
  std::filesystem::remove(junk + "/manifest.json");
  std::filesystem::create_directories(junk + "/stage-1-of-2");
  std::ofstream(junk + "/stage-1-of-2/ckpt-0000000003.bin") << "DTRCKPT1 junk";
  EXPECT_EQ(checkpointLayoutMismatch(dp), "");
  (void)prepareCheckpointDir(dp, "job.json");
  EXPECT_EQ(run(1, dp).results[0].steps, 12);
  std::filesystem::remove_all(base);
}

// What a next run resumes from, and the launch's cheap look for a first run's directory (its
// memory estimate counts a checkpoint read only when there may be one).
TEST(Pipeline, ResumeFileAndCheckpointFilesOfBothLayouts) {
  const std::string base = ::testing::TempDir() + "/dtrain_pipe_files_" + std::to_string(::getpid());
  std::filesystem::remove_all(base);
  auto pipe = model(2, 2, "1f1b");
  pipe.checkpoint.dir = base + "/pp";
  EXPECT_EQ(resumeFile(pipe, 12), base + "/pp/manifest.json");
  auto dp = pipe;
  dp.parallel = {};
  EXPECT_EQ(resumeFile(dp, 12), base + "/pp/ckpt-0000000012.bin");
  dp.checkpoint.dir.clear();
  EXPECT_EQ(resumeFile(dp, 12), "");
  EXPECT_FALSE(holdsCheckpointFiles(base + "/pp"));  // (not there yet)
  std::filesystem::create_directories(base + "/pp/stage-1-of-2");
  std::ofstream(base + "/pp/notes.txt") << "x";
  EXPECT_FALSE(holdsCheckpointFiles(base + "/pp"));
  std::ofstream(base + "/pp/stage-1-of-2/ckpt-0000000004.bin") << "x";  // (named: the look reads no file)
  EXPECT_TRUE(holdsCheckpointFiles(base + "/pp"));
  std::filesystem::remove_all(base + "/pp/stage-1-of-2");
  std::ofstream(base + "/pp/ckpt-0000000004.bin") << "x";
  EXPECT_TRUE(holdsCheckpointFiles(base + "/pp"));
  std::filesystem::remove_all(base);
}

// checkpoint.async: each stage's file is written on a thread and the manifest follows once all
// are durable (at the next checkpoint or the end): the end state is the inline one's, and a
// resume is bit-identical to a straight run.
TEST(Pipeline, AsyncCheckpointsWriteTheManifestAndResumeBitIdentical) {
  std::string dir = ::testing::TempDir() + "/dtrain_pipe_async_" + std::to_string(::getpid());
  std::filesystem::remove_all(dir);
  auto t = model(2, 2, "1f1b");
  t.max_steps = 16;
  auto straight = run(4, t);
  t.checkpoint.dir = dir;
  t.checkpoint.every_steps = 3;
  t.checkpoint.async = true;
  t.max_steps = 8;
  run(4, t);
  auto m = spec::readPipelineManifest(dir + "/manifest.json");
  ASSERT_TRUE(m.has_value());
  EXPECT_EQ(m->step, 8);
  ASSERT_EQ(m->files.size(), 2u);
  for (const auto& f : m->files) EXPECT_TRUE(std::filesystem::exists(dir + "/" + f)) << f;
  EXPECT_EQ(m->files[1], "stage-1-of-2/ckpt-0000000008.bin");
  t.max_steps = 16;
  auto resumed = run(4, t);
  EXPECT_EQ(resumed.weights, straight.weights);
  EXPECT_EQ(resumed.results[0].steps, 16);
  EXPECT_EQ(spec::readPipelineManifest(dir + "/manifest.json")->step, 16);
  std::filesystem::remove_all(dir);
}

TEST(Pipeline, StageCheckpointsFromDifferentStepsResumeFromTheCommonStep) {
  // A run killed between two stages' writes: stage 1's newest is missing, so both stages go
  // back to step 4, and the run ends as a straight one.
  std::string dir = ::testing::TempDir() + "/dtrain_pipe_torn_" + std::to_string(::getpid());
  std::filesystem::remove_all(dir);
  auto t = model(2, 2, "gpipe");
  t.max_steps = 12;
  auto straight = run(2, t);
  t.checkpoint.dir = dir;
  t.checkpoint.every_steps = 4;
  t.max_steps = 8;
  run(2, t);
  ASSERT_TRUE(std::filesystem::remove(dir + "/stage-1-of-2/ckpt-0000000008.bin"));
  t.max_steps = 12;
  auto resumed = run(2, t);
  EXPECT_EQ(resumed.weights, straight.weights);
  EXPECT_EQ(resumed.results[0].steps, 12);

  // A stage's files lost while the manifest says it wrote step 12: refused on every rank,
  // naming the file, not a silent start from step 0.
  std::filesystem::remove_all(dir + "/stage-1-of-2");
  EXPECT_EQ(refusals(2, t, "trainer: "), 2);
  EXPECT_EQ(refusals(2, t,
                     "manifest.json says every stage wrote step 12, but stage 1 holds no intact checkpoint now (" +
                         dir + "/stage-1-of-2/ckpt-0000000012.bin is missing): restore it, or remove"),
            2);
  // A stage without any checkpoint and no manifest (the run stopped before the first save
  // was complete): nothing to resume, every stage starts over, and the run ends as a
  // straight one.
  std::filesystem::remove(dir + "/manifest.json");
  auto again = run(2, t);
  EXPECT_EQ(again.weights, straight.weights);
  EXPECT_EQ(again.results[0].steps, 12);

  // Stages each holding steps, none in common: refused on every rank, naming what each held.
  for (const char* f :
       {"/stage-0-of-2/ckpt-0000000004.bin", "/stage-0-of-2/ckpt-0000000008.bin", "/stage-1-of-2/ckpt-0000000012.bin"})
    ASSERT_TRUE(std::filesystem::remove(dir + f)) << f;
  auto store = std::make_shared<store::HashStore>();
  std::vector<std::thread> ts;
  std::atomic<int> refused{0};
  for (int r = 0; r < 2; ++r)
    ts.emplace_back([&, r] {
      auto c = comm::createTcpCommunicator(store, r, 2, {});
      try {
        train(t, *c);
      } catch (const SpecError& e) {
        if (std::string(e.what()).find("no intact step in common (stage 0 at step 12, stage 1 at step 8 on start") !=
            std::string::npos)
          ++refused;
      }
    });
  for (auto& th : ts) th.join();
  EXPECT_EQ(refused.load(), 2);
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace dtrain::train
