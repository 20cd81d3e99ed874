#include "dtrain/common/errors.h"

#include <cerrno>
#include <cstring>

#include <fmt/format.h>

namespace dtrain {

void throwErrno(const std::string& what) {
  int err = errno;
  throw IoError(fmt::format("{}: {}", what, std::strerror(err)));
}

void checkFailed(const char* expr, const char* file, int line) {
  throw InternalError(fmt::format("internal error: check '{}' failed at {}:{}", expr, file, line));
}

}  // namespace dtrain
