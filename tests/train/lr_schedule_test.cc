// The LR schedule runs on samples trained (lr_schedule.h): at one global batch it is the
// step-based schedule bit for bit; a run resumed at another world size goes on where the
// schedule was (no jump in the learning rate) and still ends at min_lr at its last step.
// Through the trainer: a run stopped by a signal at 2 workers and resumed at 4 (and a
// pipeline at 1 replica resumed at 2), read back from metrics.jsonl's per-step "lr".
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <memory>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "dtrain/comm/communicator.h"
#include "dtrain/spec/metrics_file.h"
#include "dtrain/store/hash_store.h"
#include "dtrain/train/checkpoint.h"
#include "dtrain/train/lr_schedule.h"
#include "dtrain/train/trainer.h"

#include "checkpoint_file.h"

namespace dtrain::train {
namespace {

namespace fs = std::filesystem;

spec::TrainerSpec cosine() {
  spec::TrainerSpec t;
  t.device = "cpu";
  t.model.layers = {20, 16, 4};
  t.data.train_samples = 4096;
  t.data.eval_samples = 64;
  t.batch_size = 32;
  t.epochs = 2;
  t.max_steps = 0;
  t.optimizer.lr = 0.05;
  t.optimizer.momentum = 0.9;
  t.lr_schedule.type = "warmup_cosine";
  t.lr_schedule.warmup_steps = 10;
  t.lr_schedule.min_lr = 0.001;
  t.log_every_steps = 1;
  return t;
}

// At one global batch the samples-based schedule is the step-based one, bit for bit, for
// every step of fresh and resumed plans (the interrupted+resumed runs' bit-identity rests on
// it), and both end at min_lr.
TEST(LrSchedule, OneGlobalBatchIsTheStepBasedScheduleExactly) {
  for (const char* type : {"warmup_cosine", "step", "constant"}) {
    SCOPED_TRACE(type);
    auto t = cosine();
    t.lr_schedule.type = type;
    if (t.lr_schedule.type == "step") {
      t.lr_schedule = {};
      t.lr_schedule.type = "step";
      t.lr_schedule.step_size = 7;
      t.lr_schedule.gamma = 0.7;
    } else if (t.lr_schedule.type == "constant") {
      t.lr_schedule = {};
    }
    for (uint64_t g : {64u, 96u, 128u, 4000u}) {
      const uint64_t n = 4096;
      const long long total = plannedSteps(t, 0, 0, 0, n, g);
      const LrSchedule fresh = planSchedule(t, nullptr, 0, 0, 0, n, g);
      EXPECT_EQ(fresh.end_samples, static_cast<uint64_t>(total) * g);
      for (long long step = 0; step < total; ++step) {
        const double want = learningRate(t, step, total);
        ASSERT_EQ(learningRate(t, fresh, static_cast<uint64_t>(step) * g), want) << "g " << g << " step " << step;
        // Resumed there at the same global batch (the epoch and cursor a checkpoint keeps).
        const uint64_t done = static_cast<uint64_t>(step) * g, perEpoch = n / g * g;
        const ScheduleState st = scheduleState(fresh, done);
        const LrSchedule resumed =
            planSchedule(t, &st, step, static_cast<int>(done / perEpoch), done % perEpoch, n, g);
        ASSERT_EQ(learningRate(t, resumed, done), want) << "resumed, g " << g << " step " << step;
      }
    }
  }
  auto t = cosine();
  EXPECT_NEAR(learningRate(t, 110, 110), t.lr_schedule.min_lr, 1e-15);
}

// 2 workers of 32 (128 steps planned) for 60% of the cosine, then 4: the old schedule jumped (its progress was
// (step - warmup) / (total - warmup) with the total of the new global batch); now the
// learning rate goes on from where it was and reaches min_lr at the new end.
TEST(LrSchedule, AnotherWorldSizeGoesOnWhereTheScheduleWas) {
  const auto t = cosine();
  const uint64_t n = 4096, g2 = 64, g4 = 128;
  const LrSchedule at2 = planSchedule(t, nullptr, 0, 0, 0, n, g2);
  const long long stop = 77;  // epoch 2, 13 steps (832 samples) in
  const uint64_t done = stop * g2;
  const ScheduleState st = scheduleState(at2, done);
  const LrSchedule at4 = planSchedule(t, &st, stop, 1, 832, n, g4);
  const long long total4 = plannedSteps(t, stop, 1, 832, n, g4);  // + (4096 - 832) / 128 = 25 steps
  ASSERT_EQ(total4, stop + 25);
  EXPECT_EQ(at4.end_samples, done + 25 * g4);
  EXPECT_EQ(at4.reference_batch, g2);
  EXPECT_EQ(at4.anchor_samples, done);
  const double before = learningRate(t, at2, done - g2);  // the last step at 2 workers
  const double after = learningRate(t, at4, done);        // the first at 4
  const double next = learningRate(t, at4, done + g4);
  // The first step at 4 workers is where the schedule at 2 would have had it.
  EXPECT_DOUBLE_EQ(after, learningRate(t, at2, done));
  EXPECT_LT(after, before);
  EXPECT_LE(before - after, after - next) << "a jump at the resume";
  // (the step-based schedule of the new total jumped by 10 of the old steps' decrease)
  EXPECT_GT(before - learningRate(t, stop, total4), 10 * (before - after));
  // Decreasing to min_lr, reached just after the last step.
  double prev = after;
  for (long long k = 1; k < 25; ++k) {
    const double lr = learningRate(t, at4, done + static_cast<uint64_t>(k) * g4);
    EXPECT_LT(lr, prev) << k;
    prev = lr;
  }
  EXPECT_NEAR(learningRate(t, at4, at4.end_samples), t.lr_schedule.min_lr, 1e-12);
  // Resumed again at 4 workers: the anchor is kept, the rest is the same schedule exactly.
  const ScheduleState st4 = scheduleState(at4, done + 10 * g4);
  EXPECT_EQ(st4.anchor_samples, done);
  const LrSchedule again = planSchedule(t, &st4, stop + 10, 1, 832 + 10 * g4, n, g4);
  for (long long k = 10; k < 25; ++k)
    EXPECT_EQ(learningRate(t, again, done + static_cast<uint64_t>(k) * g4),
              learningRate(t, at4, done + static_cast<uint64_t>(k) * g4)) << k;
  // And back at 2 workers: on from there too.
  const ScheduleState back = scheduleState(at4, done + 10 * g4);
  const LrSchedule at2Again = planSchedule(t, &back, stop + 10, 1, 832 + 10 * g4, n, g2);
  EXPECT_DOUBLE_EQ(learningRate(t, at2Again, done + 10 * g4), learningRate(t, at4, done + 10 * g4));
}

// warmup_steps and step_size count steps of the first global batch: after a change the
// warm-up ends, and the step schedule decays, after the same number of samples.
TEST(LrSchedule, WarmupAndStepSizeCountStepsOfTheFirstGlobalBatch) {
  auto t = cosine();
  t.lr_schedule.warmup_steps = 20;
  const uint64_t n = 4096;
  const LrSchedule at2 = planSchedule(t, nullptr, 0, 0, 0, n, 64);
  const ScheduleState st = scheduleState(at2, 5 * 64);  // 5 of 20 warm-up steps done
  const LrSchedule at4 = planSchedule(t, &st, 5, 0, 320, n, 128);
  EXPECT_EQ(at4.anchor_samples, 0u) << "no cosine to anchor yet";
  // Each step of 128 is two warm-up steps of 64: lr * 7/20, 9/20, ... up to lr at 20.
  EXPECT_DOUBLE_EQ(learningRate(t, at4, 320), 0.05 * 7 / 20);
  EXPECT_DOUBLE_EQ(learningRate(t, at4, 320 + 128), 0.05 * 9 / 20);
  EXPECT_DOUBLE_EQ(learningRate(t, at4, 19 * 64), 0.05) << "a step across the warm-up's end: lr, not more";
  EXPECT_DOUBLE_EQ(learningRate(t, at4, 20 * 64), 0.05) << "the cosine starts at lr";
  t.lr_schedule = {};
  t.lr_schedule.type = "step";
  t.lr_schedule.step_size = 10;
  t.lr_schedule.gamma = 0.5;
  const LrSchedule s2 = planSchedule(t, nullptr, 0, 0, 0, n, 64);
  const ScheduleState s2st = scheduleState(s2, 8 * 64);
  const LrSchedule s4 = planSchedule(t, &s2st, 8, 0, 512, n, 128);
  EXPECT_DOUBLE_EQ(learningRate(t, s4, 512), 0.05);        // 8 steps of 64
  EXPECT_DOUBLE_EQ(learningRate(t, s4, 512 + 128), 0.025);  // 10 of them
  EXPECT_DOUBLE_EQ(learningRate(t, s4, 512 + 6 * 128), 0.0125);  // 20
}

// A checkpoint keeps the schedule's state; files from before it was kept read without one
// (the resume derives it), and a section this reader does not know is skipped.
TEST(LrSchedule, CheckpointsKeepTheState) {
  const std::string dir = ::testing::TempDir() + "/dtrain_lrsched_ck_" + std::to_string(::getpid());
  fs::remove_all(dir);
  const auto t = cosine();
  TrainState s{configHash(t), 40, 1, 640, 4, {1, 2}, {0, 0}, configDescription(t)};
  s.schedule = ScheduleState{5120, 64, 128, 4480, 0.375};
  saveCheckpoint(dir, s);
  auto back = loadLatestCheckpoint(dir, [](const std::string& w) { ADD_FAILURE() << w; });
  ASSERT_TRUE(back && back->schedule);
  EXPECT_EQ(*back->schedule, *s.schedule);
  EXPECT_EQ(back->config, s.config);
  s.step = 41;
  s.schedule.reset();
  saveCheckpoint(dir, s);
  back = loadLatestCheckpoint(dir, [](const std::string& w) { ADD_FAILURE() << w; });
  ASSERT_TRUE(back);
  EXPECT_EQ(back->step, 41);
  EXPECT_FALSE(back->schedule);
  EXPECT_EQ(legacyScheduleState(41, 128), (ScheduleState{41 * 128, 128, 128, 0, 0}));
  // A file with a section of a later dtrain before the schedule's: skipped, the rest read.
  std::string payload;
  auto put = [&](const auto& v) { payload.append(reinterpret_cast<const char*>(&v), sizeof(v)); };
  put(uint64_t{7});
  put(42ll);
  put(1ll);
  put(uint64_t{64});
  put(2ll);
  for (int k = 0; k < 2; ++k) {
    put(uint64_t{1});
    put(1.5f);
  }
  put(uint64_t{0});  // no config parts
  payload += "FUTURE01";
  put(uint64_t{3});
  payload += "abc";
  payload += "LRSCHED1";
  put(uint64_t{40});
  for (uint64_t v : {uint64_t{2688}, uint64_t{64}, uint64_t{64}, uint64_t{0}}) put(v);
  put(0.0);
  std::ofstream(dir + "/ckpt-0000000042.bin", std::ios::binary) << testing::checkpointFileBytes(payload);
  back = loadLatestCheckpoint(dir, [](const std::string& w) { ADD_FAILURE() << w; });
  ASSERT_TRUE(back && back->schedule);
  EXPECT_EQ(back->step, 42);
  EXPECT_EQ(*back->schedule, (ScheduleState{2688, 64, 64, 0, 0}));
}

// Rank 0's metrics rows of a run (metrics.jsonl, every step logged) as the training's curve.
std::vector<spec::MetricsPoint> curveOf(const std::string& dir, const spec::TrainerSpec& t, const std::string& runId) {
  std::ifstream in(dir + "/metrics.jsonl");
  spec::MetricsRun run{runId, 0, 1, 0, t.checkpoint.dir, fmt::format("{:016x}", configHash(t))};
  return spec::readMetricsRun(in, run).points;
}

// `world` ranks train `t`; with stopAt >= 0 every rank is asked to stop (a SIGTERM) as that
// step begins: the final checkpoint is written at the agreed step, and train() throws
// TrainingStopped.
void trainRanks(int world, const spec::TrainerSpec& t, const std::string& metricsDir, const std::string& runId,
                long long stopAt = -1) {
  auto store = std::make_shared<store::HashStore>();
  std::vector<std::unique_ptr<TrainControl>> controls;
  for (int r = 0; r < world; ++r) controls.push_back(std::make_unique<TrainControl>());
  std::vector<std::thread> ts;
  std::vector<int> stopped(static_cast<size_t>(world), 0);
  for (int r = 0; r < world; ++r)
    ts.emplace_back([&, r] {
      auto c = comm::createTcpCommunicator(store, r, world, {});
      TrainOptions o;
      o.metrics_dir = metricsDir;
      o.run_id = runId;
      TrainControl& ctl = *controls[static_cast<size_t>(r)];
      o.control = &ctl;
      o.on_step = [&ctl, stopAt](long long s) {
        if (s == stopAt) ctl.stop = SIGTERM;
      };
      try {
        train(t, *c, o);
      } catch (const TrainingStopped&) {
        stopped[static_cast<size_t>(r)] = 1;
      }
    });
  for (auto& th : ts) th.join();
  for (int r = 0; r < world; ++r) EXPECT_EQ(stopped[static_cast<size_t>(r)], stopAt >= 0 ? 1 : 0) << "rank " << r;
}

// The learning rates a run stopped at `worldBefore` and resumed at `worldAfter` trains with,
// against a run that never stopped: the same up to the stop; at the same world size the same
// throughout; at another no jump at the resume and down to about min_lr at the end.
void checkResumedSchedule(spec::TrainerSpec t, int worldBefore, int worldAfter, const std::string& name) {
  const std::string base = ::testing::TempDir() + "/dtrain_lrsched_" + name + "_" + std::to_string(::getpid());
  fs::remove_all(base);
  t.checkpoint.dir = base + "/straight-ck";
  trainRanks(worldBefore, t, base + "/straight", "straight");
  const auto straight = curveOf(base + "/straight", t, "straight");
  t.checkpoint.dir = base + "/ck";
  trainRanks(worldBefore, t, base + "/logs", "first", 70);
  trainRanks(worldAfter, t, base + "/logs", "second");
  const auto resumed = curveOf(base + "/logs", t, "second");
  ASSERT_FALSE(straight.empty());
  ASSERT_FALSE(resumed.empty());
  // The resume's step: the first run's last row.
  long long stop = 0;
  {
    std::ifstream in(base + "/logs/metrics.jsonl");
    std::string line;
    while (std::getline(in, line))
      if (line.find("\"run_id\": \"second\"") != std::string::npos && line.find("\"type\": \"start\"") != std::string::npos)
        stop = std::stoll(line.substr(line.find("\"step\": ") + 8));
  }
  ASSERT_GT(stop, 60);
  ASSERT_LT(stop, 80);
  // Every step up to the stop once, the stop step's row the stopped run's own.
  size_t i = 0;
  for (; i < resumed.size() && resumed[i].step <= stop; ++i) {
    ASSERT_LT(i, straight.size());
    EXPECT_EQ(resumed[i].step, straight[i].step);
    EXPECT_EQ(resumed[i].lr, straight[i].lr) << "step " << resumed[i].step;
  }
  ASSERT_EQ(static_cast<long long>(i), stop) << "every step up to the stop, once";
  ASSERT_EQ(resumed[i - 1].step, stop);
  if (worldBefore == worldAfter) {
    ASSERT_EQ(resumed.size(), straight.size());
    for (size_t k = i; k < resumed.size(); ++k) {
      EXPECT_EQ(resumed[k].step, straight[k].step);
      EXPECT_EQ(resumed[k].lr, straight[k].lr) << "step " << resumed[k].step;
    }
    return;
  }
  // (before: the stop step's rate; after: the resumed run's first step, the next one)
  ASSERT_GT(resumed.size(), i + 3);
  ASSERT_EQ(resumed[i].step, stop + 1);
  const double before = resumed[i - 1].lr, after = resumed[i].lr, next = resumed[i + 1].lr;
  EXPECT_LT(after, before);
  EXPECT_LE(before - after, 1.01 * (after - next))
      << "the learning rate jumped at the resume: " << before << " then " << after << ", " << next;
  for (size_t k = i + 1; k < resumed.size(); ++k) EXPECT_LT(resumed[k].lr, resumed[k - 1].lr) << "step " << resumed[k].step;
  EXPECT_NEAR(resumed.back().lr, t.lr_schedule.min_lr, 1e-4);
}

TEST(LrSchedule, DataParallelResumedAtAnotherWorldSizeHasNoJump) {
  checkResumedSchedule(cosine(), 2, 4, "dp24");
}

TEST(LrSchedule, DataParallelResumedAtTheSameWorldSizeIsTheStraightSchedule) {
  checkResumedSchedule(cosine(), 2, 2, "dp22");
}

TEST(LrSchedule, PipelineResumedWithMoreReplicasHasNoJump) {
  auto t = cosine();
  t.model.layers = {20, 32, 16, 4};
  t.parallel.pipeline_stages = 2;
  t.parallel.micro_batches = 2;
  t.batch_size = 64;  // 1 replica: 64 steps an epoch, as the data-parallel run at 2 workers
  checkResumedSchedule(t, 2, 4, "pp");
}

}  // namespace
}  // namespace dtrain::train
