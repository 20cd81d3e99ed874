// The data image (data.h): the launcher's parse in a sealed memfd that workers map.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "dtrain/common/errors.h"
#include "dtrain/train/data.h"
#include "dtrain/train/memory_estimate.h"

namespace dtrain::train {
namespace {

#define EXPECT_HAS(text, part) EXPECT_NE(std::string(text).find(part), std::string::npos) << (text)

class DataImage : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = ::testing::TempDir() + "/dtrain_image_" + std::to_string(::getpid());
    std::filesystem::create_directories(dir_);
    writeCsv(dir_ + "/train.csv", 50, 0);
    writeCsv(dir_ + "/eval.csv", 7, 1000);
    t_.device = "cpu";
    t_.model.layers = {3, 8, 4};
    t_.data.type = "csv";
    t_.data.path = dir_ + "/train.csv";
    t_.data.label_column = "label";
    ::unsetenv(kDataImageEnv);
  }
  void TearDown() override {
    ::unsetenv(kDataImageEnv);
    ::unsetenv("DTRAIN_DATA_SHARE");
    std::filesystem::remove_all(dir_);
  }
  static void writeCsv(const std::string& path, int rows, int offset) {
    std::ofstream f(path);
    f << "a,label,b,c\n";
    for (int r = 0; r < rows; ++r) f << (r + offset) * 0.5 << "," << r % 4 << "," << -r << "," << r * r + offset << "\n";
  }
  // Every sample of both sets, as floats (inputs then the label).
  static std::vector<float> all(const Datasets& d) {
    std::vector<float> out;
    for (const Dataset* s : {d.train.get(), d.eval.get()})
      for (uint64_t i = 0; i < s->size(); ++i) {
        float x[3];
        int label = -1;
        s->sample(i, x, &label, nullptr);
        out.insert(out.end(), x, x + 3);
        out.push_back(static_cast<float>(label));
      }
    return out;
  }
  void setFd(int fd) { ::setenv(kDataImageEnv, std::to_string(fd).c_str(), 1); }

  std::string dir_;
  spec::TrainerSpec t_;
};

TEST_F(DataImage, TheLaunchersViewsAndTheWorkersMapHoldTheParse) {
  for (bool evalFile : {false, true}) {
    t_.data.eval_path = evalFile ? dir_ + "/eval.csv" : "";
    const std::vector<float> parsed = all(openSharedDatasets(t_, {}, false).sets);
    SharedDatasets s = openSharedDatasets(t_);
    ASSERT_TRUE(s.image.fd) << s.image.problem;
    EXPECT_TRUE(s.sets.shared);
    EXPECT_GT(s.image.bytes, (50u + (evalFile ? 7u : 0u)) * 4u * sizeof(float));
    EXPECT_EQ(all(s.sets), parsed);
    EXPECT_EQ(s.sets.train->size(), evalFile ? 50u : 45u);  // without an eval file the last 10% are held out
    // The image is sealed: nobody can change what the workers read.
    EXPECT_EQ(::ftruncate(s.image.fd.get(), 0), -1);
    EXPECT_EQ(::write(s.image.fd.get(), "x", 1), -1);
    setFd(s.image.fd.get());
    ::fcntl(s.image.fd.get(), F_SETFD, 0);  // (as a worker inherits it)
    Datasets w = openDatasets(t_);
    EXPECT_TRUE(w.shared);
    EXPECT_HAS(w.note, "mapped from this host's data image");
    EXPECT_EQ(all(w), parsed);
    // (a worker keeps it out of the processes it starts)
    EXPECT_EQ(::fcntl(s.image.fd.get(), F_GETFD) & FD_CLOEXEC, FD_CLOEXEC);
  }
}

TEST_F(DataImage, AFileChangedSinceTheLaunchIsParsedAgain) {
  SharedDatasets s = openSharedDatasets(t_);
  ASSERT_TRUE(s.image.fd);
  writeCsv(dir_ + "/train.csv", 60, 5);  // rewritten: another size and modification time
  setFd(s.image.fd.get());
  Datasets w = openDatasets(t_);
  EXPECT_FALSE(w.shared);
  EXPECT_HAS(w.note, "parsed from the files: this host's data image could not be used (it was made from other data");
  EXPECT_EQ(w.train->size() + w.eval->size(), 60u);
  // So is a spec whose data fields differ (another label column).
  writeCsv(dir_ + "/train.csv", 50, 0);
  s = openSharedDatasets(t_);
  t_.data.label_column = "1";
  setFd(s.image.fd.get());
  EXPECT_FALSE(openDatasets(t_).shared);
}

// Before a restart the launcher (or agent) makes the image again for files that changed: the
// restarted workers map what the files hold now instead of each parsing them.
TEST_F(DataImage, ARestartGetsAnImageOfTheFilesAsTheyAreNow) {
  SharedDatasets s = openSharedDatasets(t_);
  ASSERT_TRUE(s.image.fd);
  ::dtrain::train::DataImage image = std::move(s.image);
  s.sets = {};
  EXPECT_EQ(refreshDataImage(t_, image), "");  // nothing changed: the same image
  const int before = image.fd.get();
  EXPECT_EQ(image.fd.get(), before);
  writeCsv(dir_ + "/train.csv", 60, 5);
  const std::string said = refreshDataImage(t_, image);
  EXPECT_HAS(said, dir_ + "/train.csv changed since the data image was made; made it again");
  ASSERT_TRUE(image.fd) << image.problem;
  setFd(image.fd.get());
  Datasets w = openDatasets(t_);
  EXPECT_TRUE(w.shared) << w.note;
  EXPECT_EQ(w.train->size() + w.eval->size(), 60u);
  EXPECT_EQ(refreshDataImage(t_, image), "");
  // A file that no longer parses leaves no image: the workers parse it and say what is wrong.
  { std::ofstream(dir_ + "/train.csv") << "a,label,b,c\n1,2,x,4\n"; }
  EXPECT_HAS(refreshDataImage(t_, image), "changed since the data image was made; the workers read the files (");
  EXPECT_FALSE(image.fd);
  EXPECT_EQ(refreshDataImage(t_, image), "");  // (no image: nothing to refresh)
  // A file gone.
  writeCsv(dir_ + "/train.csv", 50, 0);
  s = openSharedDatasets(t_);
  image = std::move(s.image);
  s.sets = {};
  std::filesystem::remove(dir_ + "/train.csv");
  EXPECT_HAS(refreshDataImage(t_, image), "train.csv is gone since the data image was made; the workers read the files");
}

// A rewrite of the same size whose modification time is put back (cp -p, rsync -t): only the
// change time tells it.
TEST_F(DataImage, ASameSizeRewriteWithItsOldModificationTimeIsParsedAgain) {
  const std::string path = dir_ + "/train.csv";
  struct stat before {};
  ASSERT_EQ(::stat(path.c_str(), &before), 0);
  SharedDatasets s = openSharedDatasets(t_);
  ASSERT_TRUE(s.image.fd);
  ::usleep(20000);  // (a later change time, on any file system's clock granularity)
  {
    Fd f(::open(path.c_str(), O_WRONLY));
    ASSERT_TRUE(f);
    ASSERT_EQ(::pwrite(f.get(), "9", 1, 12), 1);  // row 0's 'a': 0 -> 9, same size
  }
  const struct timespec times[2] = {before.st_atim, before.st_mtim};
  ASSERT_EQ(::utimensat(AT_FDCWD, path.c_str(), times, 0), 0);
  struct stat after {};
  ASSERT_EQ(::stat(path.c_str(), &after), 0);
  ASSERT_EQ(after.st_size, before.st_size);
  ASSERT_EQ(after.st_mtim.tv_nsec, before.st_mtim.tv_nsec);
  setFd(s.image.fd.get());
  Datasets w = openDatasets(t_);
  EXPECT_FALSE(w.shared);
  EXPECT_HAS(w.note, "it was made from other data");
  float x[3];
  int label = -1;
  w.train->sample(0, x, &label, nullptr);
  EXPECT_EQ(x[0], 9.0f);  // what the file holds now
}

// A table over many pages, moved into the image piece by piece with the parse's pages given
// back as it goes: every value arrives, the last page's too.
TEST_F(DataImage, AManyPageTableArrivesWhole) {
  writeCsv(dir_ + "/train.csv", 40000, 3);  // 40000 x 3 floats: about 120 pages of x
  const std::vector<float> parsed = all(openSharedDatasets(t_, {}, false).sets);
  SharedDatasets s = openSharedDatasets(t_);
  ASSERT_TRUE(s.image.fd) << s.image.problem;
  EXPECT_EQ(all(s.sets), parsed);
  setFd(s.image.fd.get());
  ::fcntl(s.image.fd.get(), F_SETFD, 0);
  Datasets w = openDatasets(t_);
  EXPECT_TRUE(w.shared);
  EXPECT_EQ(all(w), parsed);
}

TEST_F(DataImage, WhatIsNotASealedImageIsNotTrusted) {
  SharedDatasets s = openSharedDatasets(t_);
  ASSERT_TRUE(s.image.fd);
  const size_t n = s.image.bytes;
  std::vector<char> bytes(n);
  ASSERT_EQ(::pread(s.image.fd.get(), bytes.data(), n, 0), static_cast<ssize_t>(n));
  auto memfd = [&](const std::vector<char>& b, bool seal) {
    Fd fd(static_cast<int>(::syscall(SYS_memfd_create, "test", MFD_CLOEXEC | MFD_ALLOW_SEALING)));
    EXPECT_EQ(::write(fd.get(), b.data(), b.size()), static_cast<ssize_t>(b.size()));
    if (seal) EXPECT_EQ(::fcntl(fd.get(), F_ADD_SEALS, F_SEAL_SEAL | F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE), 0);
    return fd;
  };
  auto note = [&](int fd) {
    setFd(fd);
    Datasets w = openDatasets(t_);
    EXPECT_FALSE(w.shared);
    EXPECT_EQ(w.train->size(), 45u);  // parsed from the file instead
    return w.note;
  };
  // The same bytes, unsealed (someone could change them under the workers).
  Fd unsealed = memfd(bytes, false);
  EXPECT_HAS(note(unsealed.get()), "is not a sealed data image");
  // A table whose rows run past the end.
  std::vector<char> bad = bytes;
  const uint64_t huge = uint64_t{1} << 60;
  std::memcpy(bad.data() + 32 + 8, &huge, 8);  // ImageTable[0].rows
  Fd malformed = memfd(bad, true);
  EXPECT_HAS(note(malformed.get()), "table 0 of the data image is malformed");
  // Not an image at all; no descriptor; not a number.
  Fd other = memfd(std::vector<char>(4096, 'x'), true);
  EXPECT_HAS(note(other.get()), "does not hold a data image of this dtrain's format");
  const int closed = ::dup(0);
  ::close(closed);
  EXPECT_HAS(note(closed), "Bad file descriptor");
  ::setenv(kDataImageEnv, "7x", 1);
  EXPECT_HAS(openDatasets(t_).note, "DTRAIN_DATA_FD=\"7x\" is not a descriptor");
}

TEST_F(DataImage, SyntheticDataHasNone) {
  t_.data.type = "synthetic";
  SharedDatasets s = openSharedDatasets(t_);
  EXPECT_FALSE(s.image.fd);
  EXPECT_EQ(s.image.problem, "");
  EXPECT_FALSE(s.sets.shared);
}

TEST_F(DataImage, TheSwitch) {
  EXPECT_TRUE(dataShareEnabled());
  ::setenv("DTRAIN_DATA_SHARE", "off", 1);
  EXPECT_FALSE(dataShareEnabled());
  ::setenv("DTRAIN_DATA_SHARE", "maybe", 1);
  EXPECT_THROW(dataShareEnabled(), SpecError);
}

// A host's workers hold a shared image once: the estimate counts it once, and no worker reads
// the files (no idx loading buffer).
TEST_F(DataImage, TheEstimateCountsASharedImageOnce) {
  t_.data.type = "idx";
  t_.model.layers = {784, 64, 10};
  t_.batch_size = 32;
  MemoryLayout l;
  l.world = l.workers = 4;
  l.data_rows = 70000;
  const MemoryEstimate apart = estimateMemory(t_, l);
  l.data_shared = true;
  const MemoryEstimate shared = estimateMemory(t_, l);
  const uint64_t data = 70000ull * 785 * sizeof(float);
  EXPECT_EQ(apart.workers[0].data, data);
  EXPECT_EQ(shared.workers[0].data_shared, data);
  EXPECT_EQ(shared.workers[0].loading, 0u);
  // Apart: 4 copies and each worker's idx bytes (the largest of loading and a batch).
  EXPECT_EQ(apart.host - shared.host, 3 * data + 4 * (apart.workers[0].loading - apart.workers[0].batch));
}

// A host that cannot hold the data: with a shared image the fix is a smaller file, never
// fewer workers (they share one copy).
TEST_F(DataImage, TooMuchDataForTheHostNamesTheFixThatHelps) {
  t_.data.type = "idx";
  t_.model.layers = {784, 64, 10};
  t_.batch_size = 32;
  MemoryLayout l;
  l.world = l.workers = 4;
  l.data_rows = 10000000;  // 31 GiB of floats
  MemoryAvailability host;
  host.bytes = host.host_available = 8ull << 30;
  auto refusal = [&] {
    try {
      checkHostMemory(t_, l, host, "job.json");
    } catch (const SpecError& e) {
      return std::string(e.what());
    }
    return std::string("not refused");
  };
  const std::string apart = refusal();
  EXPECT_HAS(apart, "job.json: /trainer/data/path: this job needs about");
  EXPECT_HAS(apart, "every worker holds the whole data set: use a smaller data file or fewer workers per host (nproc_per_node 4)");
  l.data_shared = true;
  const std::string shared = refusal();
  EXPECT_HAS(shared, "job.json: /trainer/data/path: this job needs about");
  EXPECT_HAS(shared, "data set (one copy for the host's workers) 29.2 GiB");
  EXPECT_HAS(shared, "; this host's workers share one copy of the data set (the data image): use a smaller data file");
  EXPECT_EQ(shared.find("fewer workers"), std::string::npos) << shared;
}

}  // namespace
}  // namespace dtrain::train
