#include "dtrain/common/files.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/stat.h>

#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <utility>

#include <fmt/format.h>

#include "dtrain/common/errors.h"
#include "dtrain/common/fd.h"

namespace dtrain {

bool writeAllBlocking(int fd, std::string_view text) {
  size_t done = 0;
  while (done < text.size()) {
    ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      pollfd p{fd, POLLOUT, 0};
      if (::poll(&p, 1, -1) < 0 && errno != EINTR) return false;
      continue;
    }
    if (n < 0) return false;
    done += static_cast<size_t>(n);
  }
  return true;
}

int inheritedOutputFd(const std::string& path) {
  int fd = -1;
  if (path == "/dev/stdout") fd = STDOUT_FILENO;
  else if (path == "/dev/stderr") fd = STDERR_FILENO;
  for (const char* prefix : {"/dev/fd/", "/proc/self/fd/"}) {
    const std::string p(prefix);
    if (path.rfind(p, 0) != 0 || path.size() == p.size() || path.size() > p.size() + 9) continue;
    const std::string num = path.substr(p.size());
    if (num.find_first_not_of("0123456789") != std::string::npos) continue;
    fd = std::stoi(num);
  }
  return fd >= 0 && ::fcntl(fd, F_GETFD) != -1 ? fd : -1;
}

bool isSpecialOutput(const std::string& path) {
  if (inheritedOutputFd(path) >= 0) return true;
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && !S_ISREG(st.st_mode) && !S_ISDIR(st.st_mode);
}

void writeOutputFile(const std::string& path, const std::string& text) {
  auto fail = [&](const std::string& what, const std::string& file) {
    throw IoError(fmt::format("cannot {} {}: {}", what, file, std::strerror(errno)));
  };
  if (const int inherited = inheritedOutputFd(path); inherited >= 0) {
    if (!writeAllBlocking(inherited, text)) fail("write", path);
    return;
  }
  if (isSpecialOutput(path)) {
    Fd fd{::open(path.c_str(), O_WRONLY | O_CLOEXEC | O_NOCTTY)};
    if (!fd || !writeAllBlocking(fd.get(), text)) fail("write", path);
    return;
  }
  // The file a symlink (chain) points at, existing or not; else the path itself.
  std::error_code ec;
  std::filesystem::path target = std::filesystem::weakly_canonical(path, ec);
  if (ec) target = path;
  const std::string tmp = fmt::format("{}.tmp.{}", target.string(), ::getpid());
  Fd fd{::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0644)};
  if (!fd) fail("create", tmp);
  // A file replaced keeps its permissions (a summary someone made 0600 stays private).
  struct stat old {};
  if (::stat(target.c_str(), &old) == 0 && S_ISREG(old.st_mode)) (void)::fchmod(fd.get(), old.st_mode & 07777);
  if (!writeAllBlocking(fd.get(), text) || ::close(fd.release()) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    errno = err;
    fail("write", tmp);
  }
  if (::rename(tmp.c_str(), target.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    errno = err;
    fail("replace", target.string());
  }
}

namespace {

// The temp directory tempDirectory() would use, absolute, and the error that refuses it ("" when
// usable).
std::pair<std::string, std::string> checkTempDirectory() {
  std::string var, dir = "/tmp";
  for (const char* name : {"TMPDIR", "TMP", "TEMP", "TEMPDIR"}) {
    const char* v = std::getenv(name);
    if (v != nullptr && *v != '\0') {
      var = name;
      dir = v;
      break;
    }
  }
  std::error_code ec;
  std::filesystem::path abs = std::filesystem::absolute(dir, ec);
  if (ec) abs = dir;
  // Named as the user set it: "TMPDIR=reltmp (/home/u/reltmp)"; /tmp when nothing was set.
  const std::string where = var.empty() ? std::string("the temp directory /tmp (TMPDIR is not set)")
                            : abs.string() == dir ? fmt::format("{}={}", var, dir)
                                                  : fmt::format("{}={} ({})", var, dir, abs.string());
  const std::string fix = var.empty() ? std::string("set TMPDIR to a directory you can write")
                                      : fmt::format("create it, or unset {}", var);
  struct stat st {};
  if (::stat(abs.c_str(), &st) != 0) {
    const int err = errno;
    if (err == ENOENT)
      return {abs.string(), fmt::format("{}: the directory does not exist; {}", where, fix)};
    return {abs.string(), fmt::format("{}: {}; {}", where, std::strerror(err), fix)};
  }
  if (!S_ISDIR(st.st_mode))
    return {abs.string(), fmt::format("{}: not a directory; {}", where,
                                      var.empty() ? fix : fmt::format("point {} at a directory, or unset it", var))};
  if (::access(abs.c_str(), W_OK | X_OK) != 0) {
    const int err = errno;
    return {abs.string(), fmt::format("{}: cannot create files there: {}; {}", where, std::strerror(err),
                                      var.empty() ? fix
                                                  : fmt::format("make it writable, point {} at a directory you can "
                                                                "write, or unset it",
                                                                var))};
  }
  return {abs.lexically_normal().string(), ""};
}

}  // namespace

std::string tempDirectory() {
  auto [dir, problem] = checkTempDirectory();
  if (!problem.empty()) throw SpecError(problem);
  return dir;
}

std::string tempDirectoryProblem(std::string* dir) {
  auto [path, problem] = checkTempDirectory();
  if (dir) *dir = path;
  return problem;
}

void writePrivateFile(const std::string& path, const std::string& text) {
  auto fail = [&](const char* what) {
    throw IoError(fmt::format("cannot {} {}: {}", what, path, std::strerror(errno)));
  };
  Fd fd{::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0600)};
  if (!fd) fail("create");
  if (::fchmod(fd.get(), 0600) != 0) fail("chmod");
  if (!writeAllBlocking(fd.get(), text) || ::close(fd.release()) != 0) fail("write");
}

std::string makePrivateDirectory(const std::string& prefix) {
  std::string tmpl = (std::filesystem::path(tempDirectory()) / (prefix + "XXXXXX")).string();
  if (!::mkdtemp(tmpl.data())) throw IoError(fmt::format("cannot make a directory {}: {}", tmpl, std::strerror(errno)));
  return tmpl;
}

namespace {

std::string readPidPlace() {
  std::string boot;
  if (std::ifstream f("/proc/sys/kernel/random/boot_id"); f) {
    std::string line;
    std::getline(f, line);
    for (char c : line)
      if (std::isxdigit(static_cast<unsigned char>(c)) && boot.size() < 12) boot.push_back(static_cast<char>(std::tolower(c)));
  }
  char buf[64] = {0};
  const ssize_t n = ::readlink("/proc/self/ns/pid", buf, sizeof(buf) - 1);  // "pid:[4026531836]"
  std::string ns;
  for (ssize_t i = 0; i < n; ++i)
    if (buf[i] >= '0' && buf[i] <= '9') ns.push_back(buf[i]);
  return (boot.empty() ? "0" : boot) + "." + (ns.empty() ? "0" : ns);
}

}  // namespace

const std::string& pidPlace() {
  static const std::string place = readPidPlace();
  return place;
}

std::string ownedFilePrefix(std::string_view stem, std::string_view runId) {
  return fmt::format("{}{}-{}-{}-", stem, runId, pidPlace(), ::getpid());
}

long ownedFilePid(std::string_view name, std::string_view stem) {
  auto eat = [&](std::string_view p) {
    if (name.substr(0, p.size()) != p) return false;
    name.remove_prefix(p.size());
    return true;
  };
  if (!eat(stem)) return -1;
  for (int i = 0; i < 12; ++i) {  // the run id (newRunId)
    if (name.empty() || !((name[0] >= '0' && name[0] <= '9') || (name[0] >= 'a' && name[0] <= 'f'))) return -1;
    name.remove_prefix(1);
  }
  if (!eat("-") || !eat(pidPlace()) || !eat("-")) return -1;
  long pid = 0;
  size_t digits = 0;
  while (digits < name.size() && digits < 10 && name[digits] >= '0' && name[digits] <= '9')
    pid = pid * 10 + (name[digits++] - '0');
  name.remove_prefix(digits);
  const bool dir = name.size() == 7 && name[0] == '-';
  return digits > 0 && digits < 10 && (name == ".json" || dir) ? pid : -1;
}

void removeStaleOwnedFiles(const std::filesystem::path& dir, std::initializer_list<std::string_view> stems) {
  std::error_code ec;
  for (std::filesystem::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    long pid = -1;
    for (std::string_view stem : stems)
      if ((pid = ownedFilePid(name, stem)) > 0) break;
    struct stat st {};
    if (pid <= 1 || pid == ::getpid() || ::lstat(it->path().c_str(), &st) != 0 ||
        !(S_ISREG(st.st_mode) || S_ISDIR(st.st_mode)) || st.st_uid != ::geteuid())
      continue;
    if (::kill(static_cast<pid_t>(pid), 0) == 0 || errno != ESRCH) continue;
    std::error_code rmEc;
    std::filesystem::remove_all(it->path(), rmEc);  // (a symbolic link inside is removed, not followed)
  }
}

PathHold pathStillNames(const Fd& held, const std::string& path) {
  struct stat h {};
  struct stat now {};
  if (!held || ::fstat(held.get(), &h) != 0) return PathHold::kSame;
  if (::stat(path.c_str(), &now) != 0) {
    if (errno != ENOENT && h.st_nlink > 0) return PathHold::kSame;
    return h.st_nlink == 0 ? PathHold::kRemoved : PathHold::kMovedAway;
  }
  if (now.st_dev == h.st_dev && now.st_ino == h.st_ino) return PathHold::kSame;
  return h.st_nlink == 0 ? PathHold::kReplaced : PathHold::kOther;
}

DirectoryLock tryLockDirectory(const std::string& dir, const std::string& name) {
  DirectoryLock out;
  const std::string path = (std::filesystem::path(dir) / name).string();
  // Never through a symbolic link, nor on a FIFO (a directory its users share: another one's
  // link would have this process truncate a file of their choosing); and the holder line is
  // rewritten only in a file of this user's own with no other name.
  constexpr int kSafe = O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK;
  Fd lock(::open(path.c_str(), O_RDWR | O_CREAT | kSafe, 0666));
  if (!lock) lock = Fd(::open(path.c_str(), O_RDONLY | kSafe));
  struct stat st {};
  if (lock && (::fstat(lock.get(), &st) != 0 || !S_ISREG(st.st_mode))) {
    lock.reset();
    errno = EINVAL;
  }
  if (!lock) {
    out.unsupported = fmt::format("cannot open {}: {}", path,
                                  errno == ELOOP    ? "it is a symbolic link; remove it"
                                  : errno == EINVAL ? "it is not a regular file; remove it"
                                                    : std::strerror(errno));
    out.open_failed = true;
    return out;
  }
  const bool writable = (::fcntl(lock.get(), F_GETFL) & O_ACCMODE) == O_RDWR && st.st_uid == ::geteuid() &&
                        st.st_nlink == 1;
  int rc;
  while ((rc = ::flock(lock.get(), LOCK_EX | LOCK_NB)) != 0 && errno == EINTR) {
  }
  if (rc != 0) {
    if (errno != EWOULDBLOCK) {
      out.unsupported = fmt::format("cannot lock {}: {}", path, std::strerror(errno));
      return out;
    }
    out.busy = true;
    char buf[256];
    const ssize_t n = ::pread(lock.get(), buf, sizeof(buf) - 1, 0);
    if (n > 0) out.holder.assign(buf, static_cast<size_t>(n));
    while (!out.holder.empty() && (out.holder.back() == '\n' || out.holder.back() == '\0')) out.holder.pop_back();
    return out;
  }
  if (writable) {
    char host[256] = {0};
    ::gethostname(host, sizeof(host) - 1);
    const std::string me = fmt::format("pid {} on {}\n", ::getpid(), host);
    if (::ftruncate(lock.get(), 0) == 0) (void)!::pwrite(lock.get(), me.data(), me.size(), 0);
  }
  out.fd = std::move(lock);
  return out;
}

}  // namespace dtrain
