#pragma once
// A directory laid out as /proc and /sys/fs/cgroup are (cgroup v1 and v2), for the readers
// of system_memory.h and system_cpus.h (SystemPaths).
#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>

#include "dtrain/common/system_paths.h"

namespace dtrain::testutil {

constexpr uint64_t kGiB = 1ull << 30;
constexpr uint64_t kMiB = 1ull << 20;

class FakeSystem {
 public:
  FakeSystem() {
    root_ = std::filesystem::temp_directory_path() /
            ("dtrain-fakesys-" + std::to_string(::getpid()) + "-" + std::to_string(next_++));
    std::filesystem::remove_all(root_);
    std::filesystem::create_directories(root_ / "proc/self");
    meminfo(16 * kGiB, 10 * kGiB);
    write("proc/vmstat", "pgfault 1\noom_kill 0\n");
  }
  ~FakeSystem() { std::filesystem::remove_all(root_); }

  void write(const std::string& rel, const std::string& text) {
    std::filesystem::create_directories((root_ / rel).parent_path());
    std::ofstream(root_ / rel) << text;
  }
  void meminfo(uint64_t total, uint64_t available) {
    write("proc/meminfo", "MemTotal:       " + std::to_string(total / 1024) +
                              " kB\nMemFree: 1 kB\nMemAvailable:   " + std::to_string(available / 1024) + " kB\n");
  }
  SystemPaths paths() const { return {(root_ / "proc").string(), root_.string()}; }
  std::string path(const std::string& rel) const { return (root_ / rel).string(); }

 private:
  static inline int next_ = 0;
  std::filesystem::path root_;
};

}  // namespace dtrain::testutil
