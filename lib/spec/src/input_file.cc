#include "input_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include <fmt/format.h>

#include "dtrain/common/errors.h"
#include "dtrain/common/fd.h"

namespace dtrain::spec::detail {

InputFile readInputFile(const std::string& path, size_t maxBytes) {
  InputFile out;
  auto failed = [&](InputFile::Status s, std::string why) {
    out.status = s;
    out.reason = std::move(why);
    out.text.clear();
    return out;
  };
  int raw;
  do raw = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  while (raw < 0 && errno == EINTR);
  if (raw < 0) {
    const int e = errno;
    if (e == ENOENT || e == ENOTDIR) return failed(InputFile::Status::kMissing, "no such file");
    if (e == EACCES || e == EPERM) return failed(InputFile::Status::kDenied, "permission denied");
    return failed(InputFile::Status::kReadError, std::strerror(e));
  }
  Fd fd(raw);
  struct stat st {};
  if (::fstat(fd.get(), &st) == 0) {
    if (S_ISDIR(st.st_mode)) return failed(InputFile::Status::kDirectory, "is a directory");
    if (S_ISREG(st.st_mode) && static_cast<unsigned long long>(st.st_size) > maxBytes)
      return failed(InputFile::Status::kTooLarge, fmt::format("{} bytes, more than the {} MiB limit",
                                                              static_cast<unsigned long long>(st.st_size), maxBytes >> 20));
  }
  char buf[65536];
  for (;;) {
    const ssize_t n = ::read(fd.get(), buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return failed(errno == EISDIR ? InputFile::Status::kDirectory : InputFile::Status::kReadError,
                             std::strerror(errno));
    if (n == 0) break;
    if (out.text.size() + static_cast<size_t>(n) > maxBytes)
      return failed(InputFile::Status::kTooLarge, fmt::format("more than the {} MiB limit", maxBytes >> 20));
    out.text.append(buf, static_cast<size_t>(n));
  }
  return out;
}

std::string readInputOrThrow(const std::string& path, const char* what, const char* give) {
  using S = InputFile::Status;
  InputFile f = readInputFile(path);
  switch (f.status) {
    case S::kOk: return std::move(f.text);
    case S::kDirectory: throw SpecError(fmt::format("{}: is a directory; {}", path, give));
    case S::kTooLarge: throw SpecError(fmt::format("{}: too large for a {} ({}); {}", path, what, f.reason, give));
    case S::kMissing:
    case S::kDenied:
      throw SpecError(fmt::format("{}: cannot open {}: {}; check the path (relative to the directory dtrain runs in)",
                                  path, what, f.reason));
    case S::kReadError: break;
  }
  throw SpecError(fmt::format("{}: cannot read {}: {}; check the path", path, what, f.reason));
}

}  // namespace dtrain::spec::detail
