#pragma once
// Reading /proc and cgroup files (v1 and v2) for system_memory.cc and system_cpus.cc.
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "dtrain/common/system_paths.h"

namespace dtrain::detail {

// A cgroup v1 "no limit" is LONG_MAX rounded down to a page; anything this large is none.
constexpr uint64_t kNoLimit = 1ull << 62;

std::optional<std::string> readFirstLine(const std::filesystem::path& p);
// A number, or kNoLimit for "max" (v2's no limit); nullopt when unreadable or negative.
std::optional<uint64_t> readNumber(const std::filesystem::path& p);
// The value of `key` in a file of "key value" lines (meminfo, vmstat, memory.stat,
// memory.events, memory.oom_control); meminfo's "kB" is applied by the caller.
std::optional<uint64_t> readKeyed(const std::filesystem::path& p, const std::string& key);

struct Cgroup {
  std::filesystem::path dir;    // this process's cgroup
  std::filesystem::path mount;  // the hierarchy's mount point: the walk up stops there
  bool v2 = false;
};

// This process's cgroup for `controller` ("memory", "cpu"): its path from /proc/self/cgroup
// ("0::/path" for v2, "4:memory:/path" or "3:cpu,cpuacct:/path" for v1) under the mount of that
// hierarchy. A v1 hierarchy with the controller wins over v2 (a hybrid host has both, and the
// controller is then v1's). A path outside the mount's root (a container without its own
// cgroup namespace sees the host's path) is the mount itself, as is a path that does not
// exist there.
std::optional<Cgroup> findCgroup(const SystemPaths& p, const std::string& controller);

// Each cgroup from c.dir up to its mount point, the innermost first.
std::vector<std::filesystem::path> lineage(const Cgroup& c);

}  // namespace dtrain::detail
