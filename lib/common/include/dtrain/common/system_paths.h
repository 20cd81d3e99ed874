#pragma once
#include <string>

namespace dtrain {

// Where the system's files are read: "/proc" and mount points as /proc/self/mountinfo names
// them (under `root`, "" for the real ones). Tests give a directory laid out like the real
// ones (system_memory.h, system_cpus.h).
struct SystemPaths {
  std::string proc = "/proc";
  std::string root;
};

}  // namespace dtrain
