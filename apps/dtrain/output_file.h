#pragma once
// Output files named on the command line (--summary-json, bench --json) are checked before a
// job starts, so a typo in a path is exit 2 at once, not a failure after the work is done.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <string>

#include <fmt/format.h>

#include "dtrain/common/errors.h"
#include "dtrain/common/files.h"

namespace dtrain::app {

// An output file of dtrain's own: a run summary, a bench's JSON.
struct OutputKind {
  const char* name;                       // "a dtrain run summary"
  bool (*is)(const std::string& text);  // recognises one
};

// Whether an output of kind `ours` may be written at `path`: true for a pipe, /dev/stdout or
// an inherited descriptor (written in place, never replaced), and when the regular file there
// (a symlink's target) is absent, empty (mktemp's) or such an output (an earlier run's).
// Anything else is someone's data: the job spec itself given as the summary (`dtrain run
// job.json --summary-json job.json`, or `dtrain run --summary-json job.json` with the
// output's name forgotten) was replaced by the summary.
inline bool replaceableOutput(const std::string& path, OutputKind ours) {
  if (isSpecialOutput(path)) return true;
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode) || st.st_size == 0) return true;
  constexpr off_t kLargest = 256 << 20;  // (an output of dtrain's this large is not likely)
  if (st.st_size > kLargest) return false;
  std::string text(static_cast<size_t>(st.st_size), '\0');
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOCTTY | O_NONBLOCK);
  if (fd < 0) return true;  // (unreadable: whether it can be written is said next)
  size_t got = 0;
  while (got < text.size()) {
    const ssize_t n = ::read(fd, text.data() + got, text.size() - got);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    got += static_cast<size_t>(n);
  }
  ::close(fd);
  text.resize(got);
  return text.empty() || ours.is(text);
}

// `path` can be written by this process as writeOutputFile writes it (created, or replaced
// if it exists and holds an output of kind `ours` or nothing; a pipe or /dev/stdout written
// in place); throws SpecError naming `flag` otherwise. Leaves nothing behind.
inline void checkOutputFile(const std::string& path, const char* flag, OutputKind ours) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (fs::is_directory(path, ec)) throw SpecError(fmt::format("{}: \"{}\" is a directory; give a file path", flag, path));
  if (const int fd = inheritedOutputFd(path); fd >= 0) {
    const int mode = ::fcntl(fd, F_GETFL) & O_ACCMODE;
    if (mode != O_WRONLY && mode != O_RDWR)
      throw SpecError(fmt::format("{}: \"{}\" (descriptor {}) is not open for writing; give another path", flag, path, fd));
    return;
  }
  if (isSpecialOutput(path)) {
    if (::access(path.c_str(), W_OK) != 0)
      throw SpecError(fmt::format("{}: cannot write \"{}\": {}; give another path", flag, path, std::strerror(errno)));
    return;
  }
  if (!replaceableOutput(path, ours))
    throw SpecError(fmt::format("{}: \"{}\" exists and is not {}, which would replace it; give another path, or "
                                "remove the file first",
                                flag, path, ours.name));
  // The file writeOutputFile replaces, found as it finds it: a symlink's target, else the path
  // as given (relative stays relative: with a working directory longer than PATH_MAX, its
  // absolute form is one no call takes, while the relative path works).
  fs::path target = fs::weakly_canonical(path, ec);
  if (ec) target = path;
  const fs::path parent = target.has_parent_path() ? target.parent_path() : fs::path(".");
  // The OS's own reason when the directory cannot be looked at (ENAMETOOLONG, EACCES on the
  // way, ELOOP), not "does not exist" for every failure.
  struct stat st {};
  if (::stat(parent.c_str(), &st) != 0) {
    const int err = errno;
    if (err == ENOENT)
      throw SpecError(fmt::format("{}: \"{}\": directory {} does not exist; create it or give another path", flag, path,
                                  parent.string()));
    throw SpecError(fmt::format("{}: \"{}\": cannot use directory {}: {}; give another path", flag, path,
                                parent.string(), std::strerror(err)));
  }
  if (!S_ISDIR(st.st_mode))
    throw SpecError(fmt::format("{}: \"{}\": {} is not a directory; give a path in a directory", flag, path,
                                parent.string()));
  if (::access(parent.c_str(), W_OK | X_OK) != 0)
    throw SpecError(fmt::format("{}: \"{}\": cannot write in {}: {}; give a path in a directory you can write", flag, path,
                                parent.string(), std::strerror(errno)));
  // access() says yes to root everywhere, and to anyone on a read-only mount or in /proc: the
  // temporary file writeOutputFile makes beside the target is tried once, and removed.
  const std::string probe = fmt::format("{}.tmp.{}", target.string(), ::getpid());
  const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0600);
  if (fd < 0)
    throw SpecError(fmt::format("{}: \"{}\": cannot create a file in {}: {}; give a path in a directory you can write",
                                flag, path, parent.string(), std::strerror(errno)));
  ::close(fd);
  ::unlink(probe.c_str());
}

}  // namespace dtrain::app
