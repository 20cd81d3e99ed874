#pragma once
#include <string>

namespace dtrain {

// Writes `text` to `path` (created or truncated), readable and writable by the owner only,
// also when the file existed: for files that carry a job's environment, which may hold
// secrets from an env_file. A symlink at `path` is refused. Throws IoError naming the path.
void writePrivateFile(const std::string& path, const std::string& text);

}  // namespace dtrain
