#pragma once
// The memory this process may still take, and the kernel's out-of-memory kills, as Linux
// tells them: /proc/meminfo and the memory cgroup this process is in (v1 or v2).
//
// Why the cgroup: in a container (Docker, Kubernetes, a Slurm job with cgroup limits) the
// host's MemAvailable is the whole machine's, while the kernel kills the container's largest
// process as soon as the container's own limit is reached.
#include <cstdint>
#include <string>

#include "dtrain/common/system_paths.h"

namespace dtrain {

struct MemoryAvailability {
  // What a new process could take now without swapping or being killed: the least of the
  // host's MemAvailable and, for every memory cgroup from this process's up to its mount's
  // root, its limit less what it uses (page cache that can be dropped not counted as used).
  // 0: unknown.
  uint64_t bytes = 0;
  uint64_t host_available = 0;  // MemAvailable; 0 unknown
  // The tightest cgroup memory limit over those cgroups (memory.max, memory.limit_in_bytes),
  // 0 when none is set below the host's memory; cgroup_dir is where it is set.
  uint64_t cgroup_limit = 0;
  std::string cgroup_dir;
  // bytes is a cgroup's remainder, not MemAvailable.
  bool cgroup_bound = false;

  // For messages: "available (MemAvailable)" or "available under the memory limit of 4.0 GiB
  // of this process's cgroup (/sys/fs/cgroup/job)".
  std::string describe() const;
};

MemoryAvailability memoryAvailability(const SystemPaths& paths = {});

// How many processes the kernel's OOM killer has killed: on the host (/proc/vmstat oom_kill,
// Linux 4.13+) and in this process's memory cgroup and its descendants (v2 memory.events,
// v1 memory.oom_control). A counter that cannot be read is -1. Read before and after a
// process dies of SIGKILL, a rise says the OOM killer is the likely killer.
struct OomKillCounts {
  int64_t host = -1;
  int64_t cgroup = -1;
  uint64_t cgroup_limit = 0;  // as MemoryAvailability::cgroup_limit, for the message
  uint64_t host_total = 0;    // MemTotal
};

OomKillCounts oomKillCounts(const SystemPaths& paths = {});

// "" when `after` shows no OOM kill since `before`; else why a process of this cgroup that
// died of SIGKILL in between did: "the kernel's OOM killer: dtrain's cgroup reached its
// memory limit of 4.0 GiB" (a kill counted in this cgroup), "likely the kernel's OOM killer:
// it killed a process on this host since this attempt started (memory 23.5 GiB)" (counted on the host only).
std::string oomKillReason(const OomKillCounts& before, const OomKillCounts& after);

}  // namespace dtrain
