// The CPUs a job may use: the affinity mask and the cgroup CPU quota (v1 cpu.cfs_quota_us /
// cpu.cfs_period_us, v2 cpu.max), read from a directory laid out as /proc and /sys/fs/cgroup
// are, and from this machine's own.
#include "dtrain/common/system_cpus.h"

#include <gtest/gtest.h>
#include <sched.h>

#include <algorithm>
#include <cmath>

#include "fake_system.h"

namespace dtrain {
namespace {

using testutil::FakeSystem;

int affinity() {
  cpu_set_t set;
  CPU_ZERO(&set);
  return ::sched_getaffinity(0, sizeof(set), &set) == 0 ? CPU_COUNT(&set) : 1;
}

// What usable must be for a quota of q CPUs on this machine.
int expectUsable(double q) { return std::clamp(static_cast<int>(std::floor(q)), 1, affinity()); }

TEST(SystemCpus, CgroupV2QuotaTightestOverTheLineage) {
  FakeSystem s;
  s.write("proc/self/cgroup", "0::/kubepods/pod1/ctr\n");
  s.write("proc/self/mountinfo",
          "22 1 0:20 / / rw - ext4 /dev/sda1 rw\n"
          "30 22 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n");
  s.write("sys/fs/cgroup/kubepods/cpu.max", "max 100000\n");
  s.write("sys/fs/cgroup/kubepods/pod1/cpu.max", "150000 100000\n");
  s.write("sys/fs/cgroup/kubepods/pod1/ctr/cpu.max", "400000 100000\n");
  const CpuAvailability c = cpuAvailability(s.paths());
  EXPECT_EQ(c.affinity, affinity());
  EXPECT_DOUBLE_EQ(c.quota, 1.5);
  EXPECT_EQ(c.quota_dir, s.path("sys/fs/cgroup/kubepods/pod1"));
  EXPECT_EQ(c.usable, 1);  // 1.5 CPUs: one whole
  EXPECT_EQ(c.quotaBinds(), affinity() > 1);
  if (c.quotaBinds())
    EXPECT_EQ(c.describe(), "1 CPU (the CPU quota of 1.5 CPUs of this process's cgroup " +
                                s.path("sys/fs/cgroup/kubepods/pod1") + ", of " + std::to_string(affinity()) +
                                " in its affinity mask)");
}

TEST(SystemCpus, CgroupV1QuotaOnACpuCpuacctMountInAContainer) {
  FakeSystem s;
  // A container in its own cgroup namespace: its cgroup is the mount's root.
  s.write("proc/self/cgroup", "9:memory:/docker/abc\n3:cpu,cpuacct:/docker/abc\n");
  s.write("proc/self/mountinfo",
          "40 30 0:35 /docker/abc /sys/fs/cgroup/memory ro - cgroup cgroup rw,memory\n"
          "41 30 0:36 /docker/abc /sys/fs/cgroup/cpu,cpuacct ro - cgroup cgroup rw,cpu,cpuacct\n");
  s.write("sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us", "200000\n");
  s.write("sys/fs/cgroup/cpu,cpuacct/cpu.cfs_period_us", "100000\n");
  const CpuAvailability c = cpuAvailability(s.paths());
  EXPECT_DOUBLE_EQ(c.quota, 2.0);
  EXPECT_EQ(c.quota_dir, s.path("sys/fs/cgroup/cpu,cpuacct"));
  EXPECT_EQ(c.usable, expectUsable(2.0));
}

TEST(SystemCpus, NoQuotaLeavesTheAffinity) {
  FakeSystem s;
  // v1: -1 is no quota; v2 files of another controller are not read as one.
  s.write("proc/self/cgroup", "1:cpu:/user.slice\n0::/user.slice\n");
  s.write("proc/self/mountinfo",
          "41 30 0:36 / /sys/fs/cgroup/cpu rw - cgroup cgroup rw,cpu\n"
          "42 30 0:37 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw\n");
  s.write("sys/fs/cgroup/cpu/user.slice/cpu.cfs_quota_us", "-1\n");
  s.write("sys/fs/cgroup/cpu/user.slice/cpu.cfs_period_us", "100000\n");
  s.write("sys/fs/cgroup/unified/user.slice/cpu.max", "100000 100000\n");  // the v1 hierarchy holds cpu here
  const CpuAvailability c = cpuAvailability(s.paths());
  EXPECT_EQ(c.quota, 0);
  EXPECT_EQ(c.usable, affinity());
  EXPECT_FALSE(c.quotaBinds());
  EXPECT_EQ(c.describe(), std::to_string(affinity()) + (affinity() == 1 ? " CPU" : " CPUs") + " (affinity)");
}

TEST(SystemCpus, BadOrMissingFilesAreNoQuota) {
  for (const char* text : {"", "max\n", "abc 100000\n", "100000 0\n", "-5 100000\n", "100000\n"}) {
    FakeSystem s;
    s.write("proc/self/cgroup", "0::/job\n");
    s.write("proc/self/mountinfo", "30 22 0:26 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n");
    s.write("sys/fs/cgroup/job/cpu.max", text);
    EXPECT_EQ(cpuAvailability(s.paths()).quota, 0) << text;
  }
  FakeSystem none;  // no cgroup file at all
  EXPECT_EQ(cpuAvailability(none.paths()).usable, affinity());
}

TEST(SystemCpus, AQuotaUnderOneCpuStillAllowsOne) {
  FakeSystem s;
  s.write("proc/self/cgroup", "0::/job\n");
  s.write("proc/self/mountinfo", "30 22 0:26 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n");
  s.write("sys/fs/cgroup/job/cpu.max", "50000 100000\n");
  const CpuAvailability c = cpuAvailability(s.paths());
  EXPECT_DOUBLE_EQ(c.quota, 0.5);
  EXPECT_EQ(c.usable, 1);
}

TEST(SystemCpus, ThisMachine) {
  const CpuAvailability c = cpuAvailability();
  EXPECT_GE(c.usable, 1);
  EXPECT_LE(c.usable, c.affinity);
  EXPECT_EQ(c.affinity, affinity());
  EXPECT_EQ(usableCpus(), c.usable);
}

}  // namespace
}  // namespace dtrain
