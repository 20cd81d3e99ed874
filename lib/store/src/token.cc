#include "dtrain/store/token.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fmt/format.h>

#include "dtrain/common/errors.h"
#include "dtrain/store/tcp_store.h"

namespace dtrain::store {

std::string newToken() {
  std::string raw = randomBytes(32), hex;
  for (unsigned char c : raw) hex += fmt::format("{:02x}", c);
  return hex;
}

std::string readTokenFile(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw SpecError(fmt::format("{}: cannot open token file; check the path", path));
  struct stat st {};
  ::fstat(fd, &st);
  if (st.st_mode & 077) {
    ::close(fd);
    throw SpecError(fmt::format("{}: token file is accessible by group or others; run chmod 600 {}", path, path));
  }
  std::string out;
  char buf[4096];
  ssize_t n;
  while ((n = ::read(fd, buf, sizeof(buf))) > 0 && out.size() < 65536) out.append(buf, static_cast<size_t>(n));
  ::close(fd);
  while (!out.empty() && (out.back() == '\n' || out.back() == '\r' || out.back() == ' ')) out.pop_back();
  if (out.empty()) throw SpecError(fmt::format("{}: token file is empty", path));
  return out;
}

std::string createTokenFile(const std::string& path) {
  std::string token = newToken();
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) throwErrno(fmt::format("create token file {}", path));
  std::string line = token + "\n";
  bool ok = ::write(fd, line.data(), line.size()) == static_cast<ssize_t>(line.size());
  ::close(fd);
  if (!ok) throwErrno(fmt::format("write token file {}", path));
  return token;
}

}  // namespace dtrain::store
