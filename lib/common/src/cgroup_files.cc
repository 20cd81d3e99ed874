#include "cgroup_files.h"

#include <fstream>
#include <sstream>

#include "dtrain/common/strings.h"

namespace dtrain::detail {
namespace {

namespace fs = std::filesystem;

// Mount points, per /proc/self/mountinfo: "36 25 0:31 /root /mount opts... - cgroup cgroup rw,memory".
struct Mount {
  std::string root, point, type, super;
};

std::vector<Mount> readMounts(const SystemPaths& p) {
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

}  // namespace

std::optional<std::string> readFirstLine(const fs::path& p) {
  std::ifstream f(p);
  std::string line;
  if (!f || !std::getline(f, line)) return std::nullopt;
  return trim(line);
}

std::optional<uint64_t> readNumber(const fs::path& p) {
  auto line = readFirstLine(p);
  if (!line || line->empty() || line->front() == '-') return std::nullopt;
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

std::optional<Cgroup> findCgroup(const SystemPaths& p, const std::string& controller) {
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
    } else if (hasOption(controllers, controller)) {
      haveV1 = true;
      v1Path = path;
    }
  }
  const auto mounts = readMounts(p);
  auto place = [&](const Mount& m, const std::string& path, bool v2) {
    Cgroup c;
    c.v2 = v2;
    c.mount = fs::path(p.root + m.point);
    c.dir = c.mount;
    std::string rel;
    if (m.root == "/")
      rel = path;
    else if (path.rfind(m.root, 0) == 0 && (path.size() == m.root.size() || path[m.root.size()] == '/'))
      rel = path.substr(m.root.size());
    while (!rel.empty() && rel.front() == '/') rel.erase(0, 1);
    if (!rel.empty() && fs::is_directory(c.mount / rel)) c.dir = c.mount / rel;
    return c;
  };
  if (haveV1)
    for (const auto& m : mounts)
      if (m.type == "cgroup" && hasOption(m.super, controller)) return place(m, v1Path, false);
  if (haveV2)
    for (const auto& m : mounts)
      if (m.type == "cgroup2") return place(m, v2Path, true);  // (controller not enabled: no files of it)
  return std::nullopt;
}

std::vector<fs::path> lineage(const Cgroup& c) {
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

}  // namespace dtrain::detail
