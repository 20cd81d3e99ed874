#include "dtrain/launch/output.h"

#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <cstdlib>

#include <fmt/format.h>

#include "dtrain/common/errors.h"
#include "dtrain/common/signal_mask.h"
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

void addConsoleSize(std::map<std::string, std::string>& env, const std::map<std::string, std::string>& given,
                    size_t prefixWidth) {
  winsize ws{};
  if (!consoleCanRedraw() || ::ioctl(STDOUT_FILENO, TIOCGWINSZ, &ws) != 0 || ws.ws_col == 0) return;
  if (!env.count("COLUMNS") && !given.count("COLUMNS"))
    env["COLUMNS"] = std::to_string(std::max<long>(20, static_cast<long>(ws.ws_col) - static_cast<long>(prefixWidth)));
  if (ws.ws_row > 0 && !env.count("LINES") && !given.count("LINES")) env["LINES"] = std::to_string(ws.ws_row);
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

namespace {

// Writes all of `text` to fd, blocking as long as it takes: a non-blocking descriptor is
// waited on for POLLOUT. An error drops the rest.
// 0, or the errno of the write that failed (what is left of `text` then dropped).
int writeWaiting(int fd, std::string_view text) {
  while (!text.empty()) {
    const ssize_t n = ::write(fd, text.data(), text.size());
    if (n >= 0) {
      text.remove_prefix(static_cast<size_t>(n));
      continue;
    }
    if (errno == EINTR) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK) return errno;
    pollfd p{fd, POLLOUT, 0};
    if (::poll(&p, 1, -1) < 0 && errno != EINTR) return errno;
  }
  return 0;
}

// Queued text for the same descriptor is joined up to this, for fewer, larger writes.
constexpr size_t kChunkMax = 64 * 1024;

}  // namespace

Console::Console(Options opts) : opts_(opts) {
  int p[2];
  if (::pipe2(p, O_CLOEXEC | O_NONBLOCK) != 0) throwErrno("pipe");
  wakeR_ = Fd(p[0]);
  wakeW_ = Fd(p[1]);
}

Console::~Console() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  work_.notify_all();
  for (Lane& l : lanes_)
    if (l.thread.joinable()) l.thread.join();
}

int Console::laneOf(int fd) {
  if (fd != STDERR_FILENO) return 0;
  if (errLane_ < 0) errLane_ = sameOpenFile(STDOUT_FILENO, STDERR_FILENO) ? 0 : 1;
  return errLane_;
}

void Console::write(int fd, std::string_view text) {
  if (text.empty()) return;
  {
    std::lock_guard<std::mutex> lk(mu_);
    const int lane = laneOf(fd);
    std::deque<Chunk>& q = lanes_[lane].q;
    if (!q.empty() && q.back().fd == fd && q.back().text.size() < kChunkMax)
      q.back().text.append(text);
    else
      q.push_back({fd, std::string(text)});
    pending_ += text.size();
    if (pending_ >= opts_.backlog_max) held_ = true;
    if (!lanes_[lane].thread.joinable()) {
      // Born with every signal blocked (it inherits this thread's mask): blocked only once it
      // runs, it could take a stop signal meant for the thread that handles them, in between.
      AllSignalsBlocked blocked;
      lanes_[lane].thread = std::thread([this, lane] { writer(lane); });
    }
  }
  work_.notify_all();  // (the lane's writer among at most two)
}

size_t Console::pending() const {
  std::lock_guard<std::mutex> lk(mu_);
  return pending_;
}

bool Console::backlogged() const {
  std::lock_guard<std::mutex> lk(mu_);
  return held_;
}

void Console::clearWake() {
  char buf[64];
  while (::read(wakeR_.get(), buf, sizeof(buf)) > 0) {
  }
}

bool Console::flush(const std::function<bool()>& giveUp) {
  std::unique_lock<std::mutex> lk(mu_);
  while (pending_ > 0) {
    if (giveUp) {
      lk.unlock();  // (giveUp may write to this console: a line saying why it gives up)
      const bool stop = giveUp();
      lk.lock();
      if (stop) return false;
      if (pending_ == 0) break;
    }
    idle_.wait_for(lk, std::chrono::milliseconds(50));
  }
  return true;
}

void Console::writer(int lane) {
  // Signals are for the thread that handles them (the event loop's self-pipe, or main's
  // blocked set after a run), never this one, which may sit in a write for a long time.
  sigset_t all;
  sigfillset(&all);
  ::pthread_sigmask(SIG_SETMASK, &all, nullptr);
  std::deque<Chunk>& q = lanes_[lane].q;
  std::unique_lock<std::mutex> lk(mu_);
  while (true) {
    work_.wait(lk, [&] { return !q.empty() || stop_; });
    if (q.empty()) return;  // stopped, with everything written
    Chunk c = std::move(q.front());
    q.pop_front();
    lk.unlock();
    const int err = writeWaiting(c.fd, c.text);
    lk.lock();
    if (err && c.fd >= 0 && c.fd < 3 && errors_[c.fd] == 0) errors_[c.fd] = err;
    pending_ -= c.text.size();
    if (held_ && pending_ <= opts_.backlog_max / 2) {
      held_ = false;
      const char b = 1;
      (void)!::write(wakeW_.get(), &b, 1);  // (a full wake pipe is already readable)
    }
    if (pending_ == 0) idle_.notify_all();
  }
}

int Console::firstError(int fd) const {
  std::lock_guard<std::mutex> lk(mu_);
  return fd >= 0 && fd < 3 ? errors_[fd] : 0;
}

Console& console() {
  static Console* c = new Console();  // never destroyed: see the declaration
  return *c;
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
