#include "dtrain/common/system_cpus.h"

#include <fmt/format.h>
#include <sched.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <thread>

#include "cgroup_files.h"
#include "dtrain/common/strings.h"

namespace dtrain {
namespace {

namespace fs = std::filesystem;

int affinityCount() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (::sched_getaffinity(0, sizeof(set), &set) == 0 && CPU_COUNT(&set) > 0) return CPU_COUNT(&set);
  return static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
}

// "a b" with a and b positive integers, a possibly "max" (none) or, in v1's quota file, -1.
std::optional<double> ratio(const std::string& quota, const std::string& period) {
  try {
    size_t u1 = 0, u2 = 0;
    const long long q = std::stoll(quota, &u1), per = std::stoll(period, &u2);
    if (u1 != quota.size() || u2 != period.size() || q <= 0 || per <= 0) return std::nullopt;
    return static_cast<double>(q) / static_cast<double>(per);
  } catch (const std::exception&) {
    return std::nullopt;
  }
}

// A cgroup's CPU quota in CPUs; nullopt when none is set (or the files are not there: v2
// without the cpu controller enabled for it).
std::optional<double> quotaAt(const fs::path& d, bool v2) {
  if (v2) {
    const auto line = detail::readFirstLine(d / "cpu.max");
    if (!line) return std::nullopt;
    const auto parts = split(*line, ' ');
    if (parts.size() != 2 || parts[0] == "max") return std::nullopt;
    return ratio(parts[0], parts[1]);
  }
  const auto q = detail::readFirstLine(d / "cpu.cfs_quota_us"), per = detail::readFirstLine(d / "cpu.cfs_period_us");
  if (!q || !per) return std::nullopt;
  return ratio(*q, *per);
}

}  // namespace

std::string CpuAvailability::describe() const {
  auto cpus = [](int n) { return fmt::format("{} CPU{}", n, n == 1 ? "" : "s"); };
  if (!quotaBinds()) return fmt::format("{} (affinity)", cpus(usable));
  return fmt::format("{} (the CPU quota of {:.3g} CPU{} of this process's cgroup {}, of {} in its affinity mask)",
                     cpus(usable), quota, quota == 1 ? "" : "s", quota_dir, affinity);
}

CpuAvailability cpuAvailability(const SystemPaths& p) {
  CpuAvailability out;
  out.affinity = affinityCount();
  out.usable = out.affinity;
  if (const auto cg = detail::findCgroup(p, "cpu")) {
    for (const auto& d : detail::lineage(*cg)) {
      const auto q = quotaAt(d, cg->v2);
      if (q && (out.quota == 0 || *q < out.quota)) {
        out.quota = *q;
        out.quota_dir = d.string();
      }
    }
  }
  // A hair under a whole number (a period that does not divide) still counts as it.
  if (out.quota > 0) out.usable = std::clamp(static_cast<int>(std::floor(out.quota + 1e-6)), 1, out.affinity);
  return out;
}

int usableCpus() { return cpuAvailability().usable; }

}  // namespace dtrain
