#include <gtest/gtest.h>

#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <thread>
#include <vector>

#include "checkpoint_writer.h"  // lib/train/src: the trainer's own
#include "dtrain/common/errors.h"
#include "dtrain/common/fd.h"

namespace dtrain::train::detail {
namespace {

using namespace std::chrono_literals;

TEST(CheckpointWriter, AsyncReturnsAtOnceAndWaitGivesThePath) {
  CheckpointWriter w(true, {}, {});
  std::atomic<bool> done{false};
  const auto t0 = std::chrono::steady_clock::now();
  w.start([&](int, const auto&, const auto&) {
    std::this_thread::sleep_for(300ms);
    done = true;
    return std::string("dir/ckpt-1.bin");
  });
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 200ms);
  EXPECT_FALSE(done.load());
  EXPECT_EQ(w.wait(), "dir/ckpt-1.bin");
  EXPECT_TRUE(done.load());
  EXPECT_EQ(w.wait(), "");  // nothing started since
}

TEST(CheckpointWriter, InlineWritesBeforeStartReturns) {
  int beats = 0;
  CheckpointWriter w(false, [&] { ++beats; }, {});
  bool done = false;
  w.start([&](int, const auto& progress, const auto&) {
    progress();  // the owner's heartbeat itself, on the owner's thread
    done = true;
    return std::string("p");
  });
  EXPECT_TRUE(done);
  EXPECT_EQ(beats, 1);
  EXPECT_EQ(w.wait(), "p");
}

// A background write's failure (a full disk) is the owner's: it surfaces at the next wait,
// as the exception the write threw, and does not stick to later writes.
TEST(CheckpointWriter, ABackgroundFailureSurfacesAtTheNextWait) {
  CheckpointWriter w(true, {}, {});
  w.start([](int, const auto&, const auto&) -> std::string { throw IoError("checkpoint: cannot write x.tmp: No space left"); });
  EXPECT_THROW(w.wait(), IoError);
  w.start([](int, const auto&, const auto&) { return std::string("ok"); });
  EXPECT_EQ(w.wait(), "ok");
  // ... also when the next write is what waits for it.
  w.start([](int, const auto&, const auto&) -> std::string { throw IoError("boom"); });
  EXPECT_THROW(w.start([](int, const auto&, const auto&) { return std::string("never"); }), IoError);
}

// Warnings and heartbeats run on the owner's thread only (the trainer's log and watchdog
// hooks are not thread-safe); the watchdog is fed while a write progresses, not while it
// stalls.
TEST(CheckpointWriter, WarningsAndHeartbeatsStayOnTheOwnersThread) {
  const auto owner = std::this_thread::get_id();
  std::atomic<int> beats{0}, foreign{0};
  std::vector<std::string> warnings;
  CheckpointWriter w(
      true,
      [&] {
        ++beats;
        if (std::this_thread::get_id() != owner) ++foreign;
      },
      [&](const std::string& m) {
        warnings.push_back(m);
        if (std::this_thread::get_id() != owner) ++foreign;
      });
  w.start([](int, const auto& progress, const auto& warn) {
    warn("junk file left alone");
    for (int i = 0; i < 8; ++i) {
      std::this_thread::sleep_for(100ms);
      progress();
    }
    return std::string("p");
  });
  EXPECT_EQ(w.wait(), "p");
  EXPECT_EQ(warnings, std::vector<std::string>{"junk file left alone"});
  EXPECT_GE(beats.load(), 2);
  EXPECT_EQ(foreign.load(), 0);

  beats = 0;
  w.start([](int, const auto&, const auto&) {
    std::this_thread::sleep_for(700ms);  // stalled: no progress
    return std::string("q");
  });
  EXPECT_EQ(w.wait(), "q");
  EXPECT_EQ(beats.load(), 0);
}

// Unwinding the trainer (a lost peer) still completes the checkpoint in flight.
TEST(CheckpointWriter, TheDestructorWaitsForTheWriteInFlight) {
  std::atomic<bool> done{false};
  {
    CheckpointWriter w(true, {}, {});
    w.start([&](int, const auto&, const auto&) {
      std::this_thread::sleep_for(200ms);
      done = true;
      return std::string("p");
    });
  }
  EXPECT_TRUE(done.load());
}

// The job writes through the root the writer holds: a directory swapped in under the root's
// name after the check before the write (a second job's, a user's) gets none of its files;
// they go to the held directory, where it is now. (Seen in CI: a swap between the check and
// the write left a checkpoint in the new directory.)
TEST(CheckpointWriter, AJobWritesThroughTheHeldRootNotItsNameNow) {
  namespace fs = std::filesystem;
  const fs::path base = fs::temp_directory_path() / ("dtrain-cw-" + std::to_string(::getpid()));
  fs::remove_all(base);
  const std::string root = (base / "ck").string();
  fs::create_directories(root);
  Fd rootFd(::open(root.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  ASSERT_TRUE(rootFd);
  fs::rename(root, base / "moved");
  fs::create_directories(root);
  const std::vector<float> params(10, 1.f), momentum(10, 0.f);
  const CheckpointView view{1, 7, 0, 0, 1, params, momentum, {}, std::nullopt, 0};
  const auto job = checkpointJob(root, "", view, {}, nullptr);
  EXPECT_EQ(job(rootFd.get(), {}, {}), root + "/ckpt-0000000007.bin");  // (named as the job knows it)
  const auto stageJob = checkpointJob(root, "stage-1-of-2", view, {}, nullptr);
  EXPECT_EQ(stageJob(rootFd.get(), {}, {}), root + "/stage-1-of-2/ckpt-0000000007.bin");
  EXPECT_TRUE(fs::is_empty(root));
  EXPECT_TRUE(fs::exists(base / "moved" / "ckpt-0000000007.bin"));
  EXPECT_TRUE(fs::exists(base / "moved" / "stage-1-of-2" / "ckpt-0000000007.bin"));
  // A pipeline's stage directory may be a symbolic link (another disk): followed, as by name.
  fs::create_directories(base / "elsewhere");
  fs::create_directory_symlink(base / "elsewhere", base / "moved" / "stage-0-of-2");
  EXPECT_EQ(checkpointJob(root, "stage-0-of-2", view, {}, nullptr)(rootFd.get(), {}, {}),
            root + "/stage-0-of-2/ckpt-0000000007.bin");
  EXPECT_TRUE(fs::exists(base / "elsewhere" / "ckpt-0000000007.bin"));
  // Without a held root (none was there when the writer was made) it goes by the name.
  EXPECT_EQ(job(-1, {}, {}), root + "/ckpt-0000000007.bin");
  EXPECT_TRUE(fs::exists(root + "/ckpt-0000000007.bin"));
  fs::remove_all(base);
}

// A write that completes after its root was moved away landed where the directory went, not
// at the path it returns: the writer says so (the job's final checkpoint would otherwise be
// reported written where it is not), inline and in the background.
TEST(CheckpointWriter, AWriteDoneAfterItsRootMovedIsRefused) {
  namespace fs = std::filesystem;
  const fs::path base = fs::temp_directory_path() / ("dtrain-cw2-" + std::to_string(::getpid()));
  fs::remove_all(base);
  const std::string root = (base / "ck").string();
  fs::create_directories(root);
  for (const bool async : {false, true}) {
    CheckpointWriter w(async, {}, {}, root);
    w.start([&](int, const auto&, const auto&) { return root + "/ckpt-1.bin"; });
    EXPECT_EQ(w.wait(), root + "/ckpt-1.bin");
    try {
      w.start([&](int, const auto&, const auto&) {
        fs::rename(root, base / "moved");  // (while it writes)
        return root + "/ckpt-2.bin";
      });
      w.wait();
      FAIL() << "a write into a moved directory passed";
    } catch (const SpecError& e) {
      EXPECT_NE(std::string(e.what()).find(root + " was removed while this job ran"), std::string::npos) << e.what();
    }
    fs::rename(base / "moved", root);
  }
  fs::remove_all(base);
}

}  // namespace
}  // namespace dtrain::train::detail
