#include "dtrain/common/errors.h"

#include <sys/resource.h>

#include <cerrno>
#include <cstring>
#include <string>

#include <fmt/format.h>

namespace dtrain {

void throwErrno(const std::string& what) {
  int err = errno;
  if (err == EMFILE) {
    // (the limit, and where it is set: the fix is the user's or the admin's)
    rlimit lim{};
    if (::getrlimit(RLIMIT_NOFILE, &lim) == 0)
      throw IoError(fmt::format("{}: {} (this process may have {} open, ulimit -n; hard limit {}): raise the limit "
                                "(nofile in /etc/security/limits.conf, LimitNOFILE for a service) and start again",
                                what, std::strerror(err), static_cast<unsigned long long>(lim.rlim_cur),
                                lim.rlim_max == RLIM_INFINITY ? std::string("unlimited")
                                                              : std::to_string(static_cast<unsigned long long>(lim.rlim_max))));
  }
  throw IoError(fmt::format("{}: {}", what, std::strerror(err)));
}

void checkFailed(const char* expr, const char* file, int line) {
  throw InternalError(fmt::format("internal error: check '{}' failed at {}:{}", expr, file, line));
}

}  // namespace dtrain
