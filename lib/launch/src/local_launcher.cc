#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <ctime>
#include <filesystem>

#include <fmt/format.h>

#include "dtrain/common/errors.h"
#include "dtrain/common/strings.h"
#include "dtrain/launch/env.h"
#include "dtrain/launch/launcher.h"
#include "dtrain/launch/output.h"
#include "dtrain/spec/error_file.h"

namespace dtrain::launch {
namespace {

using Clock = std::chrono::steady_clock;

// Owning fd. Copies deleted.
class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  Fd(Fd&& o) noexcept : fd_(o.release()) {}
  Fd& operator=(Fd&& o) noexcept {
    if (this != &o) {
      reset();
      fd_ = o.release();
    }
    return *this;
  }
  ~Fd() { reset(); }
  int get() const { return fd_; }
  int release() {
    int f = fd_;
    fd_ = -1;
    return f;
  }
  void reset() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }
  explicit operator bool() const { return fd_ >= 0; }

 private:
  int fd_ = -1;
};

std::pair<Fd, Fd> makePipe() {
  int p[2];
  if (::pipe2(p, O_CLOEXEC) != 0) throwErrno("pipe");
  return {Fd(p[0]), Fd(p[1])};
}

// Self-pipe: signal handlers write the signal number; the event loop polls the read end.
int gSignalPipe[2] = {-1, -1};

void onSignal(int sig) {
  int saved = errno;
  unsigned char b = static_cast<unsigned char>(sig);
  ssize_t ignored = ::write(gSignalPipe[1], &b, 1);
  (void)ignored;
  errno = saved;
}

// Installs the handlers for the lifetime of a run and restores the old ones after.
class SignalScope {
 public:
  static constexpr int kSignals[] = {SIGINT, SIGTERM, SIGHUP, SIGCHLD};
  SignalScope() {
    if (::pipe2(gSignalPipe, O_CLOEXEC | O_NONBLOCK) != 0) throwErrno("pipe");
    struct sigaction sa {};
    sa.sa_handler = onSignal;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESTART | SA_NOCLDSTOP;
    for (size_t i = 0; i < std::size(kSignals); ++i) ::sigaction(kSignals[i], &sa, &old_[i]);
    struct sigaction ign {};
    ign.sa_handler = SIG_IGN;
    ::sigaction(SIGPIPE, &ign, &oldPipe_);
  }
  ~SignalScope() {
    for (size_t i = 0; i < std::size(kSignals); ++i) ::sigaction(kSignals[i], &old_[i], nullptr);
    ::sigaction(SIGPIPE, &oldPipe_, nullptr);
    ::close(gSignalPipe[0]);
    ::close(gSignalPipe[1]);
    gSignalPipe[0] = gSignalPipe[1] = -1;
  }
  SignalScope(const SignalScope&) = delete;
  SignalScope& operator=(const SignalScope&) = delete;
  int fd() const { return gSignalPipe[0]; }

 private:
  struct sigaction old_[std::size(kSignals)] {};
  struct sigaction oldPipe_ {};
};

std::string utcNow() {
  auto now = std::chrono::system_clock::now();
  std::time_t t = std::chrono::system_clock::to_time_t(now);
  auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(now.time_since_epoch()).count() % 1000;
  std::tm tm{};
  ::gmtime_r(&t, &tm);
  char buf[64];
  std::strftime(buf, sizeof(buf), "%Y-%m-%dT%H:%M:%S", &tm);
  return fmt::format("{}.{:03d}Z", buf, static_cast<int>(ms));
}

struct Stream {
  Fd fd;
  LineSplitter splitter;
  bool is_err = false;
};

struct Worker {
  WorkerSlot slot;
  pid_t pid = -1;
  bool running = false;
  Stream out, err;
  Fd log;
  TailBuffer tail{20};
  std::string error_file;
  WorkerExit exit;
};

class LocalLauncher final : public Launcher {
 public:
  RunResult run(const Plan& plan, const spec::JobSpec& spec) override;

 private:
  void spawn(Worker& w, const Plan& plan, const spec::JobSpec& spec, const EnvMap& base);
  void emitLine(Worker& w, bool isErr, std::string_view line);
  void signalAll(int sig);
  void reap();
  void startShutdown(int sig);

  const spec::JobSpec* spec_ = nullptr;
  std::vector<Worker> workers_;
  RunResult result_;
  bool stopping_ = false;
  Clock::time_point killDeadline_{};
  bool killed_ = false;
  bool consoleTty_ = false;
  std::string statusLine_;  // drawn at the bottom of a terminal; "" = none
};

void LocalLauncher::spawn(Worker& w, const Plan& plan, const spec::JobSpec& spec, const EnvMap& base) {
  auto [outR, outW] = makePipe();
  auto [errR, errW] = makePipe();
  EnvOptions eo;
  eo.error_file = w.error_file;
  EnvMap env = workerEnv(base, spec, plan, w.slot, eo);
  // Everything the child needs is built before fork(): only async-signal-safe calls after.
  std::vector<std::string> envStrings;
  for (const auto& [k, v] : env) envStrings.push_back(k + "=" + v);
  std::vector<char*> envp, argv;
  for (auto& s : envStrings) envp.push_back(s.data());
  envp.push_back(nullptr);
  std::vector<std::string> args = spec.command;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  std::string execError = fmt::format("dtrain: error: cannot run '{}': ", spec.command[0]);
  const char* cwd = spec.cwd.empty() ? nullptr : spec.cwd.c_str();
  pid_t parent = ::getpid();

  sigset_t all, old;
  sigfillset(&all);
  ::sigprocmask(SIG_BLOCK, &all, &old);  // no handler of ours may run in the child
  pid_t pid = ::fork();
  if (pid < 0) {
    ::sigprocmask(SIG_SETMASK, &old, nullptr);
    throwErrno("fork");
  }
  if (pid == 0) {
    for (int sig : {SIGINT, SIGTERM, SIGHUP, SIGCHLD, SIGPIPE}) ::signal(sig, SIG_DFL);
    ::sigprocmask(SIG_SETMASK, &old, nullptr);
    ::setpgid(0, 0);
    // The worker dies with dtrain; the getppid check closes the race where dtrain died
    // before prctl ran.
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) ::_exit(1);
    ::dup2(outW.get(), STDOUT_FILENO);
    ::dup2(errW.get(), STDERR_FILENO);
    int devnull = ::open("/dev/null", O_RDONLY);
    if (devnull >= 0) ::dup2(devnull, STDIN_FILENO);
    if (cwd && ::chdir(cwd) != 0) {
      const char* e = std::strerror(errno);
      (void)!::write(STDERR_FILENO, "dtrain: error: cannot chdir to cwd: ", 36);
      (void)!::write(STDERR_FILENO, e, std::strlen(e));
      (void)!::write(STDERR_FILENO, "\n", 1);
      ::_exit(126);
    }
    ::execvpe(argv[0], argv.data(), envp.data());
    int code = errno == ENOENT ? 127 : 126;
    const char* e = std::strerror(errno);
    (void)!::write(STDERR_FILENO, execError.data(), execError.size());
    (void)!::write(STDERR_FILENO, e, std::strlen(e));
    (void)!::write(STDERR_FILENO, "\n", 1);
    ::_exit(code);
  }
  ::setpgid(pid, pid);  // both sides set it, so it holds whichever runs first
  ::sigprocmask(SIG_SETMASK, &old, nullptr);
  w.pid = pid;
  w.running = true;
  w.out.fd = std::move(outR);
  w.err.fd = std::move(errR);
  w.err.is_err = true;
  w.exit.global_rank = w.slot.global_rank;
  w.exit.local_rank = w.slot.local_rank;
  w.exit.host = w.slot.host;
  w.exit.pid = pid;
}

void LocalLauncher::emitLine(Worker& w, bool isErr, std::string_view line) {
  // A status line (kStatusPrefix) is drawn in place on a terminal, and replaced by the next
  // one; it never reaches log files or the stderr tail.
  if (!isErr && line.substr(0, kStatusPrefix.size()) == kStatusPrefix) {
    if (!consoleTty_) return;
    std::string text(line.substr(kStatusPrefix.size()));
    statusLine_ = (spec_->prefix_output ? fmt::format("[rank {}] ", w.slot.global_rank) : std::string()) + text;
    writeAll(STDOUT_FILENO, "\r\x1b[2K" + statusLine_);
    return;
  }
  if (isErr) w.tail.push(line);
  if (w.log) {
    std::string rec;
    rec.reserve(line.size() + 1);
    rec.append(line);
    rec.push_back('\n');
    writeAll(w.log.get(), rec);
  }
  const auto& filter = spec_->console_ranks;
  if (!filter.empty() && std::find(filter.begin(), filter.end(), w.slot.local_rank) == filter.end()) return;
  std::string rec;
  if (spec_->prefix_output) rec = fmt::format("[rank {}] ", w.slot.global_rank);
  rec.append(line);
  rec.push_back('\n');
  // Lift the status line out of the way, print, and draw it again below.
  if (!statusLine_.empty()) writeAll(STDOUT_FILENO, "\r\x1b[2K");
  writeAll(isErr ? STDERR_FILENO : STDOUT_FILENO, rec);
  if (!statusLine_.empty()) writeAll(STDOUT_FILENO, statusLine_);
}

void LocalLauncher::signalAll(int sig) {
  for (auto& w : workers_)
    if (w.running) ::kill(-w.pid, sig);
}

void LocalLauncher::startShutdown(int sig) {
  if (stopping_) return;
  stopping_ = true;
  signalAll(sig);
  killDeadline_ = Clock::now() + std::chrono::milliseconds(static_cast<long>(spec_->shutdown_timeout_s * 1000));
}

void LocalLauncher::reap() {
  while (true) {
    int status = 0;
    pid_t pid = ::waitpid(-1, &status, WNOHANG);
    if (pid <= 0) return;
    for (size_t i = 0; i < workers_.size(); ++i) {
      Worker& w = workers_[i];
      if (w.pid != pid || !w.running) continue;
      w.running = false;
      w.exit.when = utcNow();
      if (WIFSIGNALED(status)) {
        w.exit.signal = WTERMSIG(status);
      } else {
        w.exit.exit_code = WEXITSTATUS(status);
      }
      bool failed = w.exit.signal != 0 || w.exit.exit_code != 0;
      if (failed && stopping_) w.exit.stopped_by_dtrain = true;
      if (failed && !stopping_ && result_.first_failure < 0) {
        result_.first_failure = static_cast<int>(i);
        startShutdown(SIGTERM);
      }
      // Whatever is left in the process group (grandchildren) goes with the worker.
      ::kill(-pid, SIGKILL);
    }
  }
}

RunResult LocalLauncher::run(const Plan& plan, const spec::JobSpec& spec) {
  spec_ = &spec;
  result_ = {};
  stopping_ = killed_ = false;
  SignalScope signals;
  EnvMap base = currentEnvironment();
  consoleTty_ = ::isatty(STDOUT_FILENO) == 1;
  statusLine_.clear();
  // Workers learn whether a live status line can be shown (the trainer's progress bar).
  if (consoleTty_) base["DTRAIN_CONSOLE_TTY"] = "1";

  // Error files live under log_dir when there is one (kept), else in a private temp dir.
  std::filesystem::path errRoot;
  bool tempErrRoot = spec.log_dir.empty();
  if (!tempErrRoot) {
    std::filesystem::create_directories(spec.log_dir);
    errRoot = std::filesystem::path(spec.log_dir) / plan.run_id;
  } else {
    std::string tmpl = (std::filesystem::temp_directory_path() / "dtrain-XXXXXX").string();
    if (!::mkdtemp(tmpl.data())) throwErrno("mkdtemp");
    errRoot = tmpl;
  }

  workers_.clear();
  workers_.resize(plan.workers.size());
  for (size_t i = 0; i < plan.workers.size(); ++i) {
    Worker& w = workers_[i];
    w.slot = plan.workers[i];
    auto dir = errRoot / "attempt_0" / std::to_string(w.slot.global_rank);
    std::filesystem::create_directories(dir);
    w.error_file = (dir / "error.json").string();
    if (!spec.log_dir.empty()) {
      auto logPath = std::filesystem::path(spec.log_dir) / fmt::format("rank_{}.log", w.slot.global_rank);
      int fd = ::open(logPath.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
      if (fd < 0) throwErrno("open " + logPath.string());
      w.log = Fd(fd);
    }
  }
  if (setsOmpThreads(base, spec))
    writeAll(STDERR_FILENO,
             fmt::format("dtrain: setting OMP_NUM_THREADS=1 for each of the {} workers to avoid overloading the "
                         "machine; set it in the spec's env or with --env to tune\n",
                         spec.nproc_per_node));

  for (auto& w : workers_) {
    if (stopping_) break;
    spawn(w, plan, spec, base);
  }

  std::vector<char> buf(65536);
  while (true) {
    std::vector<pollfd> fds;
    std::vector<std::pair<Worker*, Stream*>> owners;
    fds.push_back({signals.fd(), POLLIN, 0});
    owners.push_back({nullptr, nullptr});
    bool anyRunning = false;
    for (auto& w : workers_) {
      anyRunning |= w.running;
      for (Stream* s : {&w.out, &w.err}) {
        if (!s->fd) continue;
        fds.push_back({s->fd.get(), POLLIN, 0});
        owners.push_back({&w, s});
      }
    }
    if (!anyRunning && fds.size() == 1) break;
    int timeoutMs = -1;
    if (stopping_ && !killed_) {
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(killDeadline_ - Clock::now()).count();
      timeoutMs = static_cast<int>(std::max<long>(0, left));
    }
    // With every worker gone, a grandchild that kept a pipe open must not hold dtrain up.
    if (!anyRunning) timeoutMs = 200;
    int n = ::poll(fds.data(), fds.size(), timeoutMs);
    if (n < 0 && errno != EINTR) throwErrno("poll");
    if (n == 0 && !anyRunning) break;
    if (stopping_ && !killed_ && Clock::now() >= killDeadline_) {
      killed_ = true;
      signalAll(SIGKILL);
    }
    if (n <= 0) continue;
    if (fds[0].revents & POLLIN) {
      unsigned char sigs[64];
      ssize_t got;
      while ((got = ::read(signals.fd(), sigs, sizeof(sigs))) > 0) {
        for (ssize_t i = 0; i < got; ++i) {
          int sig = sigs[i];
          if (sig == SIGCHLD) continue;
          if (!result_.received_signal) result_.received_signal = sig;
          if (stopping_ && sig == SIGINT && !killed_) {
            // A second Ctrl-C means "now".
            killed_ = true;
            signalAll(SIGKILL);
          }
          startShutdown(sig);
        }
      }
      reap();
    }
    for (size_t i = 1; i < fds.size(); ++i) {
      if (!(fds[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
      auto [w, s] = owners[i];
      ssize_t got = ::read(s->fd.get(), buf.data(), buf.size());
      if (got < 0 && errno == EINTR) continue;
      bool isErr = s->is_err;
      if (got <= 0) {
        s->splitter.finish([&](std::string_view l) { emitLine(*w, isErr, l); });
        s->fd.reset();
        continue;
      }
      s->splitter.feed(std::string_view(buf.data(), static_cast<size_t>(got)),
                       [&](std::string_view l) { emitLine(*w, isErr, l); });
    }
    reap();
  }
  for (auto& w : workers_) {
    for (Stream* s : {&w.out, &w.err}) {
      bool isErr = s->is_err;
      s->splitter.finish([&](std::string_view l) { emitLine(w, isErr, l); });
    }
    w.exit.stderr_tail.assign(w.tail.lines().begin(), w.tail.lines().end());
    if (auto e = spec::readWorkerErrorFile(w.error_file)) {
      w.exit.error_message = e->message;
      w.exit.error_traceback = e->traceback;
    }
    result_.workers.push_back(w.exit);
  }
  if (!statusLine_.empty()) writeAll(STDOUT_FILENO, "\n");
  if (tempErrRoot) {
    std::error_code ec;
    std::filesystem::remove_all(errRoot, ec);
  }
  if (result_.received_signal) {
    result_.exit_code = 128 + result_.received_signal;
  } else if (result_.first_failure >= 0) {
    const auto& f = result_.workers[result_.first_failure];
    result_.exit_code = f.signal ? 128 + f.signal : f.exit_code;
  }
  return result_;
}

}  // namespace

std::unique_ptr<Launcher> makeLocalLauncher() { return std::make_unique<LocalLauncher>(); }

std::string formatFailure(const RunResult& result, const spec::JobSpec& spec) {
  if (result.first_failure < 0) return {};
  const auto& f = result.workers[result.first_failure];
  int failed = 0, stopped = 0;
  for (const auto& w : result.workers) {
    if (w.stopped_by_dtrain)
      ++stopped;
    else if (w.signal || w.exit_code) ++failed;
  }
  std::string how = f.signal ? fmt::format("killed by {}", signalName(f.signal)) : fmt::format("exited with code {}", f.exit_code);
  std::string out = fmt::format("dtrain: job '{}' failed: rank {} {}", spec.name, f.global_rank, how);
  if (stopped) out += fmt::format("; {} other worker(s) ended during teardown", stopped);
  out += "\n";
  out += "  first failure:\n";
  out += fmt::format("    rank:       {} (local rank {})\n", f.global_rank, f.local_rank);
  out += fmt::format("    host:       {}\n", f.host);
  out += fmt::format("    pid:        {}\n", f.pid);
  out += fmt::format("    exit:       {}\n", f.signal ? signalName(f.signal) : fmt::format("code {}", f.exit_code));
  out += fmt::format("    time:       {}\n", f.when);
  if (!f.error_message.empty()) out += fmt::format("    error:      {}\n", f.error_message);
  if (!f.error_traceback.empty()) {
    out += "    traceback:\n";
    for (const auto& l : split(f.error_traceback, '\n'))
      if (!l.empty()) out += "      " + l + "\n";
  }
  if (!f.stderr_tail.empty()) {
    out += "    last stderr lines:\n";
    for (const auto& l : f.stderr_tail) out += "      | " + l + "\n";
  }
  if (failed > 1) out += fmt::format("  {} workers failed in all; see the log for the others\n", failed);
  return out;
}

}  // namespace dtrain::launch
