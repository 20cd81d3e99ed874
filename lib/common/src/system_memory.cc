#include "dtrain/common/system_memory.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <vector>

#include <fmt/format.h>

#include "dtrain/common/strings.h"

namespace dtrain {
namespace {

namespace fs = std::filesystem;

// A cgroup v1 "no limit" is LONG_MAX rounded down to a page; anything this large is none.
constexpr uint64_t kNoLimit = 1ull << 62;

std::optional<std::string> readFirstLine(const fs::path& p) {
  std::ifstream f(p);
  std::string line;
  if (!f || !std::getline(f, line)) return std::nullopt;
  return trim(line);
}

// A number, or kNoLimit for "max" (v2's no limit); nullopt when unreadable.
std::optional<uint64_t> readNumber(const fs::path& p) {
  auto line = readFirstLine(p);
  if (!line || line->empty()) return std::nullopt;
  if (*line == "max") return kNoLimit;
  try {
    size_t used = 0;
    const unsigned long long v = std::stoull(*line, &used);
    if (used != line->size()) return std::nullopt;
    return static_cast<uint64_t>(v);
  } catch (const std::exception&) {
    return std::nullopt;
  }
}

// The value of `key` in a file of "key value" lines (meminfo, vmstat, memory.stat,
// memory.events, memory.oom_control); meminfo's "kB" is applied by the caller.
std::optional<uint64_t> readKeyed(const fs::path& p, const std::string& key) {
  std::ifstream f(p);
  std::string line;
  while (std::getline(f, line)) {
    std::istringstream in(line);
    std::string k;
    uint64_t v = 0;
    if (!(in >> k)) continue;
    if (!k.empty() && k.back() == ':') k.pop_back();
    if (k != key) continue;
    if (in >> v) return v;
    return std::nullopt;
  }
  return std::nullopt;
}

struct MemoryCgroup {
  fs::path dir;    // this process's cgroup
  fs::path mount;  // the hierarchy's mount point: the walk up stops there
  bool v2 = false;
};

// Mount points, per /proc/self/mountinfo: "36 25 0:31 /root /mount opts... - cgroup cgroup rw,memory".
struct Mount {
  std::string root, point, type, super;
};

std::vector<Mount> readMounts(const SystemMemoryPaths& p) {
  std::vector<Mount> out;
  std::ifstream f(fs::path(p.proc) / "self/mountinfo");
  std::string line;
  while (std::getline(f, line)) {
    const auto dash = line.find(" - ");
    if (dash == std::string::npos) continue;
    std::istringstream pre(line.substr(0, dash)), post(line.substr(dash + 3));
    std::string id, parent, dev;
    Mount m;
    if (!(pre >> id >> parent >> dev >> m.root >> m.point)) continue;
    std::string source;
    if (!(post >> m.type >> source >> m.super)) continue;
    out.push_back(std::move(m));
  }
  return out;
}

bool hasOption(const std::string& options, const std::string& name) {
  for (const auto& o : split(options, ','))
    if (o == name) return true;
  return false;
}

// This process's memory cgroup: its path from /proc/self/cgroup ("0::/path" for v2,
// "4:memory:/path" for v1) under the mount of that hierarchy. A path outside the mount's root
// (a container without its own cgroup namespace sees the host's path) is the mount itself,
// as is a path that does not exist there.
std::optional<MemoryCgroup> findMemoryCgroup(const SystemMemoryPaths& p) {
  std::ifstream f(fs::path(p.proc) / "self/cgroup");
  std::string line, v1Path, v2Path;
  bool haveV1 = false, haveV2 = false;
  while (std::getline(f, line)) {
    const auto a = line.find(':');
    const auto b = a == std::string::npos ? a : line.find(':', a + 1);
    if (b == std::string::npos) continue;
    const std::string controllers = line.substr(a + 1, b - a - 1), path = line.substr(b + 1);
    if (line.substr(0, a) == "0" && controllers.empty()) {
      haveV2 = true;
      v2Path = path;
    } else if (hasOption(controllers, "memory")) {
      haveV1 = true;
      v1Path = path;
    }
  }
  const auto mounts = readMounts(p);
  auto place = [&](const Mount& m, const std::string& path, bool v2) -> std::optional<MemoryCgroup> {
    MemoryCgroup c;
    c.v2 = v2;
    c.mount = fs::path(p.root + m.point);
    c.dir = c.mount;
    std::string rel;
    if (m.root == "/") rel = path;
    else if (path.rfind(m.root, 0) == 0 && (path.size() == m.root.size() || path[m.root.size()] == '/'))
      rel = path.substr(m.root.size());
    while (!rel.empty() && rel.front() == '/') rel.erase(0, 1);
    if (!rel.empty() && fs::is_directory(c.mount / rel)) c.dir = c.mount / rel;
    return c;
  };
  // v1's memory controller where it is mounted (a hybrid host has both: v1 holds memory then).
  if (haveV1)
    for (const auto& m : mounts)
      if (m.type == "cgroup" && hasOption(m.super, "memory")) return place(m, v1Path, false);
  if (haveV2)
    for (const auto& m : mounts)
      if (m.type == "cgroup2") return place(m, v2Path, true);  // (no memory controller: no memory.* files)
  return std::nullopt;
}

// Each cgroup from c.dir up to its mount point, the innermost first.
std::vector<fs::path> lineage(const MemoryCgroup& c) {
  std::vector<fs::path> out;
  fs::path d = c.dir;
  const std::string mount = c.mount.lexically_normal().string();
  for (int i = 0; i < 64; ++i) {
    out.push_back(d);
    if (d.lexically_normal().string() == mount || !d.has_parent_path() || d.parent_path() == d) break;
    d = d.parent_path();
  }
  return out;
}

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
MemInfo readMemInfo(const SystemMemoryPaths& p) {
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

MemoryAvailability memoryAvailability(const SystemMemoryPaths& p) {
  MemoryAvailability out;
  const MemInfo mem = readMemInfo(p);
  out.host_available = mem.available;
  out.bytes = out.host_available;
  const auto cg = findMemoryCgroup(p);
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

OomKillCounts oomKillCounts(const SystemMemoryPaths& p) {
  OomKillCounts out;
  if (auto v = readKeyed(fs::path(p.proc) / "vmstat", "oom_kill")) out.host = static_cast<int64_t>(*v);
  out.host_total = readMemInfo(p).total;
  const auto cg = findMemoryCgroup(p);
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
