#include "dtrain/store/token.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include <fmt/format.h>

#include "dtrain/common/errors.h"
#include "dtrain/store/tcp_store.h"

namespace dtrain::store {

std::string newToken() {
  std::string raw = randomBytes(32), hex;
  for (unsigned char c : raw) hex += fmt::format("{:02x}", c);
  return hex;
}

void checkTokenStrength(const std::string& token, const std::string& where, const std::string& fix) {
  if (token.size() >= kMinTokenLength) return;
  throw SpecError(fmt::format("{}: the token is {} character{}; a token must have at least {} (a short one can be "
                              "guessed); {}",
                              where, token.size(), token.size() == 1 ? "" : "s", kMinTokenLength, fix));
}

namespace {

// A token line is 64 hex characters; anything this large is the wrong file, and reading
// on (or truncating) would authenticate with a token nobody meant.
constexpr size_t kMaxTokenFile = 64 * 1024;

// Why `path` cannot be opened, as the fix the user needs.
std::string openProblem(const std::string& path, int err) {
  switch (err) {
    case ENOENT: return fmt::format("{}: no such token file; check the path", path);
    case ENOTDIR: return fmt::format("{}: a component of the path is not a directory; check the path", path);
    case EACCES:
    case EPERM: {
      // chmod is the fix only for the user's own regular file; a denied directory on the
      // way, or someone else's file, needs another fix than changing this path's mode.
      struct stat st {};
      if (::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode) && st.st_uid == ::geteuid())
        return fmt::format("{}: cannot read the token file (permission denied); run chmod 600 {}", path, path);
      return fmt::format("{}: cannot read the token file (permission denied); run dtrain as the user who owns it, "
                         "or check the permissions of its directories", path);
    }
    case ELOOP: return fmt::format("{}: too many symbolic links; give the token file itself", path);
    default: return fmt::format("{}: cannot open the token file: {}", path, std::strerror(err));
  }
}

}  // namespace

std::string readTokenFile(const std::string& path) {
  if (path.empty()) throw SpecError("token file path is empty; give the path of the token file");
  // O_NONBLOCK: a FIFO given by mistake must not block the open; it is refused below.
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) throw SpecError(openProblem(path, errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    int err = errno;
    ::close(fd);
    throw SpecError(fmt::format("{}: cannot stat the token file: {}", path, std::strerror(err)));
  }
  // The kind of file is checked before its mode: advising chmod 600 on a directory or on
  // a device such as /dev/null would be wrong, and for /tmp dangerous.
  if (S_ISDIR(st.st_mode)) {
    ::close(fd);
    throw SpecError(fmt::format("{}: is a directory; give the token file", path));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    throw SpecError(fmt::format("{}: is not a regular file; give the token file", path));
  }
  if (st.st_mode & 077) {
    ::close(fd);
    throw SpecError(fmt::format("{}: token file is accessible by group or others; run chmod 600 {}", path, path));
  }
  std::string out;
  char buf[4096];
  ssize_t n = 0;
  while (out.size() <= kMaxTokenFile && ((n = ::read(fd, buf, sizeof(buf))) > 0 || (n < 0 && errno == EINTR)))
    if (n > 0) out.append(buf, static_cast<size_t>(n));
  int err = errno;
  ::close(fd);
  if (n < 0) throw SpecError(fmt::format("{}: cannot read the token file: {}", path, std::strerror(err)));
  if (out.size() > kMaxTokenFile)
    throw SpecError(fmt::format("{}: token file is larger than {} KiB; give the file that holds the job token",
                                path, kMaxTokenFile / 1024));
  while (!out.empty() && (out.back() == '\n' || out.back() == '\r' || out.back() == ' ')) out.pop_back();
  if (out.empty()) throw SpecError(fmt::format("{}: token file is empty; write the job token into it", path));
  checkTokenStrength(out, path, fmt::format("write a new one: openssl rand -hex 32 > {}", path));
  return out;
}

std::string createTokenFile(const std::string& path) {
  if (path.empty()) throw SpecError("token file path is empty; give the path of the token file");
  std::string token = newToken();
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) {
    int err = errno;
    // A path that cannot be created is a bad --token-file, not a failure of the machine.
    switch (err) {
      case ENOENT:
        throw SpecError(fmt::format("{}: cannot create the token file: its directory does not exist; check the path",
                                    path));
      case ENOTDIR:
        throw SpecError(fmt::format("{}: cannot create the token file: a component of the path is not a directory; "
                                    "check the path", path));
      case EACCES:
      case EPERM:
      case EROFS:
        throw SpecError(fmt::format("{}: cannot create the token file: {}; choose a directory you can write",
                                    path, std::strerror(err)));
      case EEXIST:
      case EISDIR:
        throw SpecError(fmt::format("{}: cannot create the token file: the path exists but is not a readable file "
                                    "(a broken symbolic link?); give another path", path));
      default: throwErrno(fmt::format("create token file {}", path));
    }
  }
  std::string line = token + "\n";
  bool ok = ::write(fd, line.data(), line.size()) == static_cast<ssize_t>(line.size());
  int err = errno;
  ::close(fd);
  if (!ok) {
    ::unlink(path.c_str());  // a half-written token file would be read back as a wrong token
    errno = err;
    throwErrno(fmt::format("write token file {}", path));
  }
  return token;
}

}  // namespace dtrain::store
