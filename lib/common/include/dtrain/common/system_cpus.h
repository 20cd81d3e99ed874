#pragma once
// The CPUs this process may compute on: its affinity mask, and the CPU quota of the cgroup
// it is in (v1 cpu.cfs_quota_us / cpu.cfs_period_us, v2 cpu.max), as Linux tells them.
//
// Why the quota: `docker run --cpus 4` or a Kubernetes CPU limit leave the affinity mask at
// every CPU of the host, while the kernel lets the container run only 4 CPUs' worth of time
// per period and stops (throttles) all its threads for the rest of it. Sixty-four busy
// threads under a quota of four are throttled most of the time. (A Slurm job's CPUs are a
// cpuset: the affinity mask already.)
#include <string>

#include "dtrain/common/system_paths.h"

namespace dtrain {

struct CpuAvailability {
  int affinity = 1;  // CPUs in the affinity mask (the host's count when it cannot be read)
  // The tightest CPU quota, in CPUs, over this process's cgroup and its ancestors up to its
  // mount's root (quota / period); 0 when none is set. quota_dir is where it is set.
  double quota = 0;
  std::string quota_dir;
  // What to size thread and process counts by: the affinity, or the quota rounded down
  // when that is less (at least 1).
  int usable = 1;

  bool quotaBinds() const { return usable < affinity; }
  // For messages: "2 CPUs (affinity)" or "1 CPU (the CPU quota of 1.5 CPUs of this process's
  // cgroup /sys/fs/cgroup/job, of 64 in its affinity mask)".
  std::string describe() const;
};

// Reads the files each time (cheap: a few small files); safe from any thread.
CpuAvailability cpuAvailability(const SystemPaths& paths = {});

// cpuAvailability().usable.
int usableCpus();

}  // namespace dtrain
