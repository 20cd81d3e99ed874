// Requests to a running trainer (TrainControl: what dtrain train's SIGUSR1/SIGUSR2 and
// SIGTERM handlers set): the ranks agree on them at a step boundary, so a request seen by one
// rank makes every rank checkpoint (or stop) at the same step; a checkpoint changes nothing
// about training, and a stopped run resumes bit-identically. A checkpoint that cannot be
// written is a SpecError naming the directory. Ranks are threads over a HashStore.
#include "control.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "dtrain/comm/communicator.h"
#include "dtrain/common/errors.h"
#include "dtrain/store/hash_store.h"
#include "dtrain/train/checkpoint.h"
#include "dtrain/train/trainer.h"

namespace dtrain::train {
namespace {

namespace fs = std::filesystem;

spec::TrainerSpec dp() {
  spec::TrainerSpec t;
  t.device = "cpu";
  t.model.layers = {20, 16, 4};
  t.data.train_samples = 4096;
  t.data.eval_samples = 128;
  t.batch_size = 32;
  t.max_steps = 30;
  t.optimizer.lr = 0.05;
  t.optimizer.momentum = 0.9;
  return t;
}

spec::TrainerSpec pipeline() {
  spec::TrainerSpec t = dp();
  t.model.layers = {20, 32, 16, 4};
  t.parallel.pipeline_stages = 2;
  t.parallel.micro_batches = 2;
  return t;
}

std::string tempDir(const std::string& name) {
  std::string d = ::testing::TempDir() + "/dtrain_control_" + name + "_" + std::to_string(::getpid());
  fs::remove_all(d);
  return d;
}

struct Outcome {
  std::vector<std::string> hashes;  // per rank ("" when it threw)
  std::vector<std::exception_ptr> errors;
  std::vector<std::string> log;  // rank 0's lines
};

// Trains `world` ranks, each with a TrainControl of its own; hook(rank, step, control) runs
// as each step begins (a signal arriving then).
Outcome runControlled(int world, const spec::TrainerSpec& t,
                      const std::function<void(int, long long, TrainControl&)>& hook = {}) {
  auto store = std::make_shared<store::HashStore>();
  Outcome out;
  out.hashes.resize(static_cast<size_t>(world));
  out.errors.resize(static_cast<size_t>(world));
  std::vector<std::unique_ptr<TrainControl>> controls;
  for (int r = 0; r < world; ++r) controls.push_back(std::make_unique<TrainControl>());
  std::mutex mu;
  std::vector<std::thread> ts;
  for (int r = 0; r < world; ++r)
    ts.emplace_back([&, r] {
      try {
        auto c = comm::createTcpCommunicator(store, r, world, {});
        TrainOptions o;
        o.control = controls[static_cast<size_t>(r)].get();
        if (hook) o.on_step = [&, r](long long s) { hook(r, s, *controls[static_cast<size_t>(r)]); };
        if (r == 0)
          o.log = [&](const std::string& line) {
            std::lock_guard<std::mutex> l(mu);
            out.log.push_back(line);
          };
        out.hashes[static_cast<size_t>(r)] = train(t, *c, o).weights_sha256;
      } catch (...) {
        out.errors[static_cast<size_t>(r)] = std::current_exception();
      }
    });
  for (auto& th : ts) th.join();
  return out;
}

bool logged(const Outcome& o, const std::string& text) {
  for (const auto& l : o.log)
    if (l.find(text) != std::string::npos) return true;
  return false;
}

std::vector<std::string> files(const std::string& dir) {
  std::vector<std::string> names;
  std::error_code ec;
  for (const auto& e : fs::recursive_directory_iterator(dir, ec))
    if (e.is_regular_file()) names.push_back(fs::relative(e.path(), dir).string());
  std::sort(names.begin(), names.end());
  return names;
}

TEST(Control, OffersAreAgreedAsTheMax) {
  TrainControl c;
  EXPECT_EQ(detail::offerOf(c), 0);
  c.requestCheckpoint(SIGUSR1);
  const int32_t one = detail::offerOf(c);
  EXPECT_FALSE(detail::isStop(one));
  EXPECT_EQ(detail::requestCount(one), 1);
  EXPECT_EQ(detail::requestSignal(one), SIGUSR1);
  c.requestCheckpoint(SIGUSR2);
  const int32_t two = detail::offerOf(c);
  EXPECT_EQ(detail::requestCount(two), 2);
  EXPECT_EQ(detail::requestSignal(two), SIGUSR2);
  EXPECT_GT(two, one);  // the rank that has seen more wins
  c.stop = SIGTERM;
  const int32_t term = detail::offerOf(c);
  EXPECT_TRUE(detail::isStop(term));
  EXPECT_EQ(detail::requestSignal(term), SIGTERM);
  EXPECT_GT(term, detail::encodeCheckpoints(detail::kMaxRequestCount + 5, SIGUSR2));  // a stop wins over any count
  EXPECT_EQ(detail::requestCount(detail::encodeCheckpoints(1 << 20, SIGUSR1)), detail::kMaxRequestCount);
}

using Request = detail::ControlPoints::Request;
bool is(const Request& r, detail::RequestKind kind, int signal) { return r.kind == kind && r.signal == signal; }

// With NCCL (the blocking agreement through device memory): every kControlPeriodOnDevice
// steps, acted on at once.
TEST(Control, BlockingAgreementsAreEveryPeriodSteps) {
  TrainControl c;
  detail::ControlPoints points(&c, /*overlapped=*/false, kControlPeriodOnDevice);
  int collectives = 0;
  auto noAsync = [](int32_t*) -> comm::WorkPtr {
    ADD_FAILURE() << "no overlapped agreement here";
    return nullptr;
  };
  c.requestCheckpoint(SIGUSR1);
  for (long long step = 1; step < kControlPeriodOnDevice; ++step)
    EXPECT_EQ(points.agree(step, false, noAsync, [&](int32_t*) { ++collectives; }).kind, detail::kNoRequest) << step;
  EXPECT_EQ(collectives, 0);
  EXPECT_TRUE(is(points.agree(kControlPeriodOnDevice, false, noAsync, [&](int32_t*) { ++collectives; }),
                 detail::kCheckpointRequest, SIGUSR1));
  EXPECT_EQ(collectives, 1);
  // Acted on: the same count agreed again is no new checkpoint.
  EXPECT_EQ(points.agree(2 * kControlPeriodOnDevice, false, noAsync, [&](int32_t*) { ++collectives; }).kind,
            detail::kNoRequest);
  // Without a TrainControl nothing is issued at all.
  detail::ControlPoints none(nullptr, false, 1);
  EXPECT_EQ(none.agree(1, false, noAsync, [&](int32_t*) { ++collectives; }).kind, detail::kNoRequest);
  EXPECT_EQ(collectives, 2);
}

struct DoneWork final : comm::Work {
  void wait() override {}
  bool test() override { return true; }
};

// On a host communicator: offered at the end of every step without waiting, the agreed value
// (the max with the other rank's offer) acted on at the end of the next. One signal whose
// copies reach the ranks a step or more apart is one checkpoint; nothing is offered after the
// last step or once a stop is acted on.
TEST(Control, OverlappedAgreementsAreReadOneStepLaterAndCountSignals) {
  TrainControl c;
  detail::ControlPoints points(&c, /*overlapped=*/true, kControlPeriodOnDevice);
  TrainControl peer;  // the other rank
  int started = 0;
  auto start = [&](int32_t* r) -> comm::WorkPtr {
    ++started;
    *r = std::max(*r, detail::offerOf(peer));
    return std::make_shared<DoneWork>();
  };
  auto noBlocking = [](int32_t*) { ADD_FAILURE() << "no blocking agreement here"; };
  EXPECT_EQ(points.agree(1, false, start, noBlocking).kind, detail::kNoRequest);
  c.requestCheckpoint(SIGUSR2);  // this rank's copy of the signal, during step 2
  EXPECT_EQ(points.agree(2, false, start, noBlocking).kind, detail::kNoRequest);  // offered now
  EXPECT_TRUE(is(points.agree(3, false, start, noBlocking), detail::kCheckpointRequest, SIGUSR2));
  peer.requestCheckpoint(SIGUSR2);  // the other rank's copy of the same signal, two steps later
  for (long long step = 4; step < 8; ++step)
    EXPECT_EQ(points.agree(step, false, start, noBlocking).kind, detail::kNoRequest);
  c.requestCheckpoint(SIGUSR1);  // a second signal
  EXPECT_EQ(points.agree(8, false, start, noBlocking).kind, detail::kNoRequest);
  EXPECT_TRUE(is(points.agree(9, false, start, noBlocking), detail::kCheckpointRequest, SIGUSR1));
  peer.stop = SIGTERM;
  EXPECT_EQ(points.agree(10, false, start, noBlocking).kind, detail::kNoRequest);
  EXPECT_EQ(started, 10);
  EXPECT_TRUE(is(points.agree(11, false, start, noBlocking), detail::kStopRequest, SIGTERM));
  EXPECT_EQ(started, 10);  // a stop acted on: nothing more is offered
  detail::ControlPoints last(&c, true, 1);
  EXPECT_EQ(last.agree(1, true, start, noBlocking).kind, detail::kNoRequest);
  EXPECT_EQ(started, 10);
}

// A SIGUSR1 seen by rank 1 alone: both ranks checkpoint at the same step (the one after the
// step it arrived in: the agreement is overlapped), rank 0 says so, training goes on and
// ends with the weights of a run without it. Inline and with checkpoint.async.
TEST(Control, CheckpointRequestOnOneRankSavesOnEveryRankAtOneStepAndChangesNothing) {
  auto t = dp();
  const std::string straight = runControlled(2, t).hashes[0];
  for (bool async : {false, true}) {
    t.checkpoint.dir = tempDir(async ? "usr1_async" : "usr1");
    t.checkpoint.every_steps = 1000;
    t.checkpoint.async = async;
    auto o = runControlled(2, t, [](int r, long long s, TrainControl& c) {
      if (r == 1 && s == 6) c.requestCheckpoint(SIGUSR1);  // during step 7: offered after it, acted on after step 8
    });
    ASSERT_FALSE(o.errors[0] || o.errors[1]);
    EXPECT_EQ(o.hashes[0], straight);
    EXPECT_EQ(o.hashes[1], straight);
    EXPECT_EQ(files(t.checkpoint.dir), (std::vector<std::string>{"ckpt-0000000008.bin", "ckpt-0000000030.bin"}));
    EXPECT_TRUE(logged(o, fmt::format("SIGUSR1: checkpoint at step 8 {} {}", async ? "being written to" : "written to",
                                      checkpointPath(t.checkpoint.dir, 8))))
        << fmt::format("{}", fmt::join(o.log, "\n"));
  }
  // Without a checkpoint dir: said, and training goes on.
  t.checkpoint = {};
  auto o = runControlled(2, t, [](int r, long long s, TrainControl& c) {
    if (r == 0 && s == 3) c.requestCheckpoint(SIGUSR2);
  });
  ASSERT_FALSE(o.errors[0] || o.errors[1]);
  EXPECT_EQ(o.hashes[0], straight);
  EXPECT_TRUE(logged(o, "SIGUSR2: no checkpoint at step 5: /trainer/checkpoint/dir is not set"));
}

// A stop seen by one rank: every rank throws TrainingStopped at the same step, after the
// final checkpoint of that step is durable (no temporary file left); the next run resumes
// from it and ends bit-identical to one that was never stopped.
void stopAndResume(spec::TrainerSpec t, const std::string& name,
                   const std::function<std::vector<std::string>(long long)>& expectFiles) {
  const std::string straight = runControlled(2, t).hashes[0];
  t.checkpoint.dir = tempDir(name);
  t.checkpoint.every_steps = 4;
  auto o = runControlled(2, t, [](int r, long long s, TrainControl& c) {
    if (r == 1 && s == 9) c.stop = SIGTERM;  // during step 10: acted on after step 11
  });
  for (int r = 0; r < 2; ++r) {
    ASSERT_TRUE(o.errors[static_cast<size_t>(r)]) << "rank " << r << " was not stopped";
    try {
      std::rethrow_exception(o.errors[static_cast<size_t>(r)]);
    } catch (const TrainingStopped& e) {
      EXPECT_EQ(e.signal(), SIGTERM);
      EXPECT_EQ(e.step(), 11);
      // (the summary's checkpoint: a file a resume reads, the pipeline's manifest)
      if (r == 0) EXPECT_TRUE(std::filesystem::is_regular_file(e.checkpoint())) << e.checkpoint();
    } catch (const std::exception& e) {
      ADD_FAILURE() << "rank " << r << ": " << e.what();
    }
  }
  EXPECT_EQ(files(t.checkpoint.dir), expectFiles(11));
  EXPECT_TRUE(logged(o, "SIGTERM: stopping at step 11 of 30; final checkpoint written to"))
      << fmt::format("{}", fmt::join(o.log, "\n"));
  // The stop step's progress line and metrics row (log_every_steps is 50: not a step it logs).
  EXPECT_TRUE(logged(o, "epoch 1/1 step 11/30 loss ")) << fmt::format("{}", fmt::join(o.log, "\n"));
  auto resumed = runControlled(2, t);
  ASSERT_FALSE(resumed.errors[0] || resumed.errors[1]);
  EXPECT_EQ(resumed.hashes[0], straight);
}

TEST(Control, StopWritesAFinalCheckpointAndResumesBitIdentical) {
  for (bool async : {false, true}) {
    auto t = dp();
    t.checkpoint.async = async;
    stopAndResume(t, async ? "stop_async" : "stop", [](long long) {
      return std::vector<std::string>{"ckpt-0000000004.bin", "ckpt-0000000008.bin", "ckpt-0000000011.bin"};
    });
  }
}

TEST(Control, PipelineAgreesOverTheWorldToo) {
  auto t = pipeline();
  const std::string straight = runControlled(2, t).hashes[0];
  t.checkpoint.dir = tempDir("pipe_usr1");
  t.checkpoint.every_steps = 1000;
  auto o = runControlled(2, t, [](int r, long long s, TrainControl& c) {
    if (r == 1 && s == 4) c.requestCheckpoint(SIGUSR1);  // offered after step 5, acted on after step 6
  });
  ASSERT_FALSE(o.errors[0] || o.errors[1]);
  EXPECT_EQ(o.hashes[0], straight);
  EXPECT_EQ(
      files(t.checkpoint.dir),
      (std::vector<std::string>{"manifest.json", "stage-0-of-2/ckpt-0000000006.bin", "stage-0-of-2/ckpt-0000000030.bin",
                                "stage-1-of-2/ckpt-0000000006.bin", "stage-1-of-2/ckpt-0000000030.bin"}));
  EXPECT_TRUE(
      logged(o, "SIGUSR1: checkpoint at step 6 written to " + t.checkpoint.dir + "/stage-*-of-2/ckpt-0000000006.bin"));
  for (bool async : {false, true}) {
    auto p = pipeline();
    p.checkpoint.async = async;
    stopAndResume(p, async ? "pipe_stop_async" : "pipe_stop", [](long long) {
      return std::vector<std::string>{"manifest.json",
                                      "stage-0-of-2/ckpt-0000000004.bin",
                                      "stage-0-of-2/ckpt-0000000008.bin",
                                      "stage-0-of-2/ckpt-0000000011.bin",
                                      "stage-1-of-2/ckpt-0000000004.bin",
                                      "stage-1-of-2/ckpt-0000000008.bin",
                                      "stage-1-of-2/ckpt-0000000011.bin"};
    });
  }
}

// A checkpoint directory that cannot be written any more (here: gone, a file in its place;
// the e2e test fills a tmpfs) is a SpecError naming it, the OS error and the fix.
TEST(Control, ACheckpointThatCannotBeWrittenIsRefusedInput) {
  for (bool async : {false, true}) {
    auto t = dp();
    t.checkpoint.dir = tempDir(async ? "gone_async" : "gone");
    t.checkpoint.every_steps = 4;
    t.checkpoint.async = async;
    const std::string dir = t.checkpoint.dir;
    auto o = runControlled(2, t, [dir](int r, long long s, TrainControl& c) {
      if (r == 0 && s == 5) {
        while (c.writes.load() > 0) std::this_thread::sleep_for(std::chrono::milliseconds(1));  // step 4's, async
        fs::remove_all(dir);
        std::ofstream(dir) << "in the way";
      }
    });
    ASSERT_TRUE(o.errors[0]);
    try {
      std::rethrow_exception(o.errors[0]);
    } catch (const SpecError& e) {
      EXPECT_NE(
          std::string(e.what()).find(fmt::format("trainer: /trainer/checkpoint/dir: cannot write the checkpoint of "
                                                 "step 8 in {}: ",
                                                 dir)),
          std::string::npos)
          << e.what();
      EXPECT_NE(std::string(e.what()).find("or set another /trainer/checkpoint/dir"), std::string::npos) << e.what();
    } catch (const std::exception& e) {
      ADD_FAILURE() << "not a SpecError: " << e.what();
    }
    EXPECT_TRUE(o.errors[1]);  // rank 1 lost its peer
    fs::remove(dir);
  }
  EXPECT_EQ(
      checkpointWriteRefusal("/ck", 40,
                             "checkpoint: cannot write /ck/ckpt-0000000040.bin.tmp: No space left on device"),
      "trainer: /trainer/checkpoint/dir: cannot write the checkpoint of step 40 in /ck: No space left on device "
      "(cannot write /ck/ckpt-0000000040.bin.tmp); the checkpoints written there before are intact: free space on "
      "it (or make it writable again) and run the job again to resume from the newest, or set another "
      "/trainer/checkpoint/dir");
}

}  // namespace
}  // namespace dtrain::train
