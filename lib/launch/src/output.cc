#include "dtrain/launch/output.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <cstdlib>

#include <fmt/format.h>

#include "dtrain/common/errors.h"
#include "dtrain/common/time.h"

namespace dtrain::launch {

bool sameOpenFile(int a, int b) {
  struct stat sa {}, sb {};
  if (::fstat(a, &sa) != 0 || ::fstat(b, &sb) != 0) return false;
  return sa.st_dev == sb.st_dev && sa.st_ino == sb.st_ino;
}

bool consoleCanRedraw() {
  const char* term = std::getenv("TERM");
  return ::isatty(STDOUT_FILENO) == 1 && !(term && std::string_view(term) == "dumb");
}

bool writeAll(int fd, std::string_view data) {
  while (!data.empty()) {
    ssize_t n = ::write(fd, data.data(), data.size());
    if (n < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    data.remove_prefix(static_cast<size_t>(n));
  }
  return true;
}

std::string logWriteWarning(const std::string& path, const std::string& what, int err) {
  return fmt::format("dtrain: warning: cannot write {}: {}; {}'s output from here on is not in it (it still reaches "
                     "the console); free space there or use another log_dir\n",
                     path, std::strerror(err), what);
}

int openRankLog(const std::string& path, std::string_view run_id, int attempt) {
  // Never through a symbolic link (in a shared directory, another user's link would have this
  // run append its output to a file of their choosing), and never blocking on a FIFO (open
  // would wait for a reader forever, signals and all): a regular file, or an error.
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK, 0644);
  if (fd < 0) {
    if (errno == ELOOP)
      throw IoError(fmt::format("log_dir (--log-dir): {} is a symbolic link; rank logs are written to regular files "
                                "only: remove it, or use another log_dir",
                                path));
    throwErrno("open " + path);
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    throw IoError(fmt::format("log_dir (--log-dir): {} is not a regular file; remove it, or use another log_dir", path));
  }
  ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK);  // (a regular file: writes as before)
  writeAll(fd, fmt::format("==== dtrain run {} attempt {} {} ====\n", run_id, attempt, utcNow()));
  return fd;
}

}  // namespace dtrain::launch
