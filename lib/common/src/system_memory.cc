#include "dtrain/common/system_memory.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <vector>

#include <fmt/format.h>

#include "cgroup_files.h"
#include "dtrain/common/strings.h"

namespace dtrain {
namespace {

namespace fs = std::filesystem;
using detail::kNoLimit;
using detail::lineage;
using detail::readKeyed;
using detail::readNumber;

// A cgroup's memory limit (memory.max, memory.limit_in_bytes), 0 when none is set below
// `total`, the host's memory (v1's "no limit" is a huge number).
uint64_t limitAt(const fs::path& d, bool v2, uint64_t total) {
  const auto limit = readNumber(d / (v2 ? "memory.max" : "memory.limit_in_bytes"));
  return limit && *limit < kNoLimit && *limit < total ? *limit : 0;
}

// MemTotal and MemAvailable from one read of meminfo, in bytes; 0 when unknown.
struct MemInfo {
  uint64_t total = 0, available = 0;
};
MemInfo readMemInfo(const SystemPaths& p) {
  MemInfo m;
  std::ifstream f(fs::path(p.proc) / "meminfo");
  std::string key;
  uint64_t kb = 0;
  std::string line;
  while (std::getline(f, line)) {
    std::istringstream in(line);
    if (!(in >> key >> kb)) continue;
    if (key == "MemTotal:") m.total = kb * 1024;
    if (key == "MemAvailable:") m.available = kb * 1024;
  }
  return m;
}

}  // namespace

std::string MemoryAvailability::describe() const {
  if (cgroup_bound)
    return fmt::format("available under the memory limit of {} of this process's cgroup ({})",
                       formatBytes(cgroup_limit), cgroup_dir);
  return "available (MemAvailable)";
}

MemoryAvailability memoryAvailability(const SystemPaths& p) {
  MemoryAvailability out;
  const MemInfo mem = readMemInfo(p);
  out.host_available = mem.available;
  out.bytes = out.host_available;
  const auto cg = detail::findCgroup(p, "memory");
  if (!cg) return out;
  for (const auto& d : lineage(*cg)) {
    const uint64_t limit = limitAt(d, cg->v2, mem.total ? mem.total : kNoLimit);
    if (!limit) continue;
    const auto usage = readNumber(d / (cg->v2 ? "memory.current" : "memory.usage_in_bytes"));
    if (!usage) continue;
    // Page cache the kernel drops before it kills (what `docker stats` leaves out too).
    auto inactive = readKeyed(d / "memory.stat", cg->v2 ? "inactive_file" : "total_inactive_file");
    if (!inactive && !cg->v2) inactive = readKeyed(d / "memory.stat", "inactive_file");
    const uint64_t used = *usage - std::min(*usage, inactive.value_or(0));
    const uint64_t left = limit - std::min(limit, used);
    if (left < out.bytes || out.bytes == 0) {
      out.bytes = left;
      out.cgroup_bound = true;
      out.cgroup_limit = limit;
      out.cgroup_dir = d.string();
    } else if (!out.cgroup_bound && (!out.cgroup_limit || limit < out.cgroup_limit)) {
      out.cgroup_limit = limit;
      out.cgroup_dir = d.string();
    }
  }
  return out;
}

OomKillCounts oomKillCounts(const SystemPaths& p) {
  OomKillCounts out;
  if (auto v = readKeyed(fs::path(p.proc) / "vmstat", "oom_kill")) out.host = static_cast<int64_t>(*v);
  out.host_total = readMemInfo(p).total;
  const auto cg = detail::findCgroup(p, "memory");
  if (!cg) return out;
  // v2's memory.events counts this cgroup and those under it; v1's oom_control this one.
  if (auto v = readKeyed(cg->dir / (cg->v2 ? "memory.events" : "memory.oom_control"), "oom_kill"))
    out.cgroup = static_cast<int64_t>(*v);
  for (const auto& d : lineage(*cg)) {
    const uint64_t limit = limitAt(d, cg->v2, out.host_total ? out.host_total : kNoLimit);
    if (limit && (!out.cgroup_limit || limit < out.cgroup_limit)) out.cgroup_limit = limit;
  }
  return out;
}

std::string oomKillReason(const OomKillCounts& before, const OomKillCounts& after) {
  const bool inCgroup = before.cgroup >= 0 && after.cgroup > before.cgroup;
  const bool onHost = before.host >= 0 && after.host > before.host;
  if (!inCgroup && !onHost) return "";
  if (inCgroup && after.cgroup_limit)
    return fmt::format("the kernel's OOM killer: dtrain's cgroup reached its memory limit of {}",
                       formatBytes(after.cgroup_limit));
  if (inCgroup) return "the kernel's OOM killer: this host's memory ran out";
  return fmt::format("likely the kernel's OOM killer: it killed a process on this host since this attempt started (memory {})",
                     formatBytes(after.host_total));
}

}  // namespace dtrain
