#include "dtrain/common/files.h"

#include <fcntl.h>
#include <sys/stat.h>

#include <cerrno>
#include <cstring>

#include <fmt/format.h>

#include "dtrain/common/errors.h"
#include "dtrain/common/fd.h"

namespace dtrain {

void writePrivateFile(const std::string& path, const std::string& text) {
  auto fail = [&](const char* what) {
    throw IoError(fmt::format("cannot {} {}: {}", what, path, std::strerror(errno)));
  };
  Fd fd{::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0600)};
  if (!fd) fail("create");
  if (::fchmod(fd.get(), 0600) != 0) fail("chmod");
  size_t done = 0;
  while (done < text.size()) {
    ssize_t n = ::write(fd.get(), text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) fail("write");
    done += static_cast<size_t>(n);
  }
  if (::close(fd.release()) != 0) fail("write");
}

}  // namespace dtrain
