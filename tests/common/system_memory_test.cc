// The memory a job may take and the OOM killer's counts, read from a directory laid out as
// /proc and /sys/fs/cgroup are (cgroup v1 and v2), and from this machine's own.
#include "dtrain/common/system_memory.h"

#include <gtest/gtest.h>

#include "fake_system.h"

namespace dtrain {
namespace {

using testutil::FakeSystem;
using testutil::kGiB;
using testutil::kMiB;

TEST(SystemMemory, CgroupV2LimitBindsWithItsUseLessDroppableCache) {
  FakeSystem s;
  s.write("proc/self/cgroup", "0::/job/inner\n");
  s.write("proc/self/mountinfo",
          "22 1 0:20 / / rw - ext4 /dev/sda1 rw\n"
          "30 22 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n");
  s.write("sys/fs/cgroup/job/memory.max", std::to_string(4 * kGiB) + "\n");
  s.write("sys/fs/cgroup/job/memory.current", std::to_string(1 * kGiB) + "\n");
  s.write("sys/fs/cgroup/job/memory.stat", "anon 1\nfile 2\ninactive_file " + std::to_string(256 * kMiB) + "\n");
  s.write("sys/fs/cgroup/job/inner/memory.max", "max\n");
  s.write("sys/fs/cgroup/job/inner/memory.current", std::to_string(900 * kMiB) + "\n");
  const MemoryAvailability a = memoryAvailability(s.paths());
  EXPECT_EQ(a.host_available, 10 * kGiB);
  EXPECT_EQ(a.bytes, 4 * kGiB - (1 * kGiB - 256 * kMiB));
  EXPECT_TRUE(a.cgroup_bound);
  EXPECT_EQ(a.cgroup_limit, 4 * kGiB);
  EXPECT_EQ(a.cgroup_dir, s.path("sys/fs/cgroup/job"));
  EXPECT_EQ(a.describe(), "available under the memory limit of 4.0 GiB of this process's cgroup (" +
                              s.path("sys/fs/cgroup/job") + ")");
}

TEST(SystemMemory, NoLimitOrALimitAboveWhatTheHostHasLeavesMemAvailable) {
  FakeSystem s;
  s.write("proc/self/cgroup", "4:memory:/user.slice\n3:cpu,cpuacct:/user.slice\n0::/user.slice\n");
  s.write("proc/self/mountinfo",
          "34 30 0:31 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n"
          "35 30 0:32 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw\n");
  s.write("sys/fs/cgroup/memory/user.slice/memory.limit_in_bytes", "9223372036854771712\n");
  s.write("sys/fs/cgroup/memory/user.slice/memory.usage_in_bytes", "1000\n");
  MemoryAvailability a = memoryAvailability(s.paths());
  EXPECT_EQ(a.bytes, 10 * kGiB);
  EXPECT_FALSE(a.cgroup_bound);
  EXPECT_EQ(a.cgroup_limit, 0u);
  EXPECT_EQ(a.describe(), "available (MemAvailable)");

  // 12 GiB of limit with little used: the host's 10 GiB available binds (the limit is kept).
  s.write("sys/fs/cgroup/memory/user.slice/memory.limit_in_bytes", std::to_string(12 * kGiB) + "\n");
  s.write("sys/fs/cgroup/memory/user.slice/memory.stat", "cache 5\ntotal_inactive_file 0\n");
  a = memoryAvailability(s.paths());
  EXPECT_EQ(a.bytes, 10 * kGiB);
  EXPECT_FALSE(a.cgroup_bound);
  EXPECT_EQ(a.cgroup_limit, 12 * kGiB);
}

TEST(SystemMemory, CgroupV1InAContainerSeesItsOwnCgroupAtTheMount) {
  FakeSystem s;
  // Without a cgroup namespace a container reads the host's path; its mount's root is that path.
  s.write("proc/self/cgroup", "9:memory:/docker/abc123\n");
  s.write("proc/self/mountinfo", "40 30 0:35 /docker/abc123 /sys/fs/cgroup/memory ro - cgroup cgroup rw,memory\n");
  s.write("sys/fs/cgroup/memory/memory.limit_in_bytes", std::to_string(2 * kGiB) + "\n");
  s.write("sys/fs/cgroup/memory/memory.usage_in_bytes", std::to_string(600 * kMiB) + "\n");
  s.write("sys/fs/cgroup/memory/memory.stat", "inactive_file 999\ntotal_inactive_file " + std::to_string(100 * kMiB) + "\n");
  s.write("sys/fs/cgroup/memory/memory.oom_control", "oom_kill_disable 0\nunder_oom 0\noom_kill 0\n");
  const MemoryAvailability a = memoryAvailability(s.paths());
  EXPECT_TRUE(a.cgroup_bound);
  EXPECT_EQ(a.bytes, 2 * kGiB - 500 * kMiB);
  EXPECT_EQ(a.cgroup_dir, s.path("sys/fs/cgroup/memory"));

  const OomKillCounts before = oomKillCounts(s.paths());
  EXPECT_EQ(before.cgroup, 0);
  EXPECT_EQ(before.host, 0);
  EXPECT_EQ(before.cgroup_limit, 2 * kGiB);
  EXPECT_EQ(oomKillReason(before, oomKillCounts(s.paths())), "") << "nothing killed";
  s.write("sys/fs/cgroup/memory/memory.oom_control", "oom_kill_disable 0\nunder_oom 0\noom_kill 1\n");
  s.write("proc/vmstat", "pgfault 1\noom_kill 1\n");
  EXPECT_EQ(oomKillReason(before, oomKillCounts(s.paths())),
            "the kernel's OOM killer: dtrain's cgroup reached its memory limit of 2.0 GiB");
}

TEST(SystemMemory, AnOomKillOnTheHostOnlyIsALikelyCause) {
  FakeSystem s;  // no cgroup files at all: the host's counts alone
  const OomKillCounts before = oomKillCounts(s.paths());
  EXPECT_EQ(before.cgroup, -1);
  s.write("proc/vmstat", "pgfault 1\noom_kill 3\n");
  EXPECT_EQ(oomKillReason(before, oomKillCounts(s.paths())),
            "likely the kernel's OOM killer: it killed a process on this host since this attempt started (memory 16.0 GiB)");
  EXPECT_EQ(memoryAvailability(s.paths()).bytes, 10 * kGiB);
  // Unreadable counts say nothing.
  EXPECT_EQ(oomKillReason(OomKillCounts{}, OomKillCounts{}), "");
}

TEST(SystemMemory, ThisMachine) {
  const MemoryAvailability a = memoryAvailability();
  EXPECT_GT(a.host_available, 0u) << "MemAvailable in /proc/meminfo";
  EXPECT_GT(a.bytes, 0u);
  EXPECT_LE(a.bytes, a.host_available);
}

}  // namespace
}  // namespace dtrain
