#include "dtrain/launch/output.h"

#include <unistd.h>

#include <cerrno>

namespace dtrain::launch {

void writeAll(int fd, std::string_view data) {
  while (!data.empty()) {
    ssize_t n = ::write(fd, data.data(), data.size());
    if (n < 0) {
      if (errno == EINTR) continue;
      return;
    }
    data.remove_prefix(static_cast<size_t>(n));
  }
}

}  // namespace dtrain::launch
