#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <optional>
#include <charconv>
#include <bitset>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <set>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "dtrain/common/errors.h"
#include "dtrain/common/fd.h"
#include "dtrain/common/files.h"
#include "dtrain/common/strings.h"
#include "dtrain/common/system_memory.h"
#include "dtrain/launch/env.h"
#include "dtrain/launch/launcher.h"
#include "dtrain/launch/orphan_guard.h"
#include "dtrain/launch/output.h"
#include "dtrain/launch/process.h"
#include "signal_scope.h"
#include "dtrain/spec/error_file.h"

namespace dtrain::launch {
namespace {

// A launch's error files when there is no log_dir: $TMPDIR/kErrDirStem<run id>-<place>-<pid>-XXXXXX.
constexpr const char* kErrDirStem = "dtrain-err-";

using detail::SignalScope;
using detail::utcNow;

using Clock = std::chrono::steady_clock;

// A worker silent this long in mid-line ("loading...", a progress bar off a terminal) has
// its unfinished line written out as a line, to the console and its log.
constexpr auto kPartialLineIdle = std::chrono::seconds(1);
// On a terminal, a rank's unfinished line is drawn in place once it has been unfinished
// this long: Python's unbuffered print() writes the text and its newline separately, and
// drawing every such line as a status first would flicker.
constexpr auto kPartialShowDelay = std::chrono::milliseconds(100);
// An update of a line already drawn in place is drawn this long after it came, with what
// came meanwhile: the newline that completes it, written separately (print(" done")), would
// otherwise have the line drawn once more unfinished, just before it is printed whole. A bar
// updated faster is drawn this often.
constexpr auto kPartialRedrawDelay = std::chrono::milliseconds(20);
// A rank's unfinished line drawn in place is given up to another rank's after this long
// without an update.
constexpr auto kPartialOwnerIdle = std::chrono::seconds(1);
// With every worker gone and the console backlogged, the pipes are read up to this much
// more (what the workers left there is far less; a grandchild that kept a pipe open and
// writes on is cut off), then given up.
constexpr size_t kLeftoverMax = 16u << 20;
// With every worker gone, their pipes are read for at most this long: what the workers left
// there takes microseconds; a process one of them left running (a monitor started with `&`, an
// upload) that writes on would otherwise hold dtrain up for good.
constexpr auto kLeftoverWindow = std::chrono::seconds(2);
// A teardown after a worker failure still waiting this long says what it waits for.
constexpr auto kTeardownNoticeAfter = std::chrono::seconds(2);
// How often a lingering process group (see Worker::lingering) is looked at, should no
// SIGCHLD say that one of its processes ended.
constexpr int kLingerPollMs = 50;
// How long a lingering group SIGKILLed (at the end of the grace period, or a worker reaped
// after it) is waited for to be gone (a process in uninterruptible sleep dies only when it
// wakes) before dtrain moves on.
constexpr auto kKilledGroupWait = std::chrono::seconds(1);

// Whether process group pgid still has a process in it. (A pgid is not reused while its
// group has a member, so after its leader has been reaped this still asks about that group.)
bool groupAlive(pid_t pgid) { return ::kill(-pgid, 0) == 0; }

// Makes the calling process its descendants' reaper while a run lasts (PR_SET_CHILD_SUBREAPER):
// a worker's orphans (a wrapper script's python, once the script is gone) become dtrain's
// children rather than init's, and reap() reaps them as they exit. A lingering process group
// then empties when its last process exits, not when init gets round to reaping it: a
// container's PID 1 may never reap (zombies stay members of their group). Restored after.
class SubreaperScope {
 public:
  SubreaperScope() {
    int was = 0;
    if (::prctl(PR_GET_CHILD_SUBREAPER, &was) == 0 && !was) set_ = ::prctl(PR_SET_CHILD_SUBREAPER, 1) == 0;
  }
  ~SubreaperScope() {
    if (set_) ::prctl(PR_SET_CHILD_SUBREAPER, 0);
  }
  SubreaperScope(const SubreaperScope&) = delete;
  SubreaperScope& operator=(const SubreaperScope&) = delete;

 private:
  bool set_ = false;
};

// Whether an unfinished line may be the start of a status line (kStatusPrefix).
bool maybeStatus(std::string_view pending) {
  size_t n = std::min(pending.size(), kStatusPrefix.size());
  return pending.substr(0, n) == kStatusPrefix.substr(0, n);
}

// Whether a worker's pipe is at least half full, unread. While dtrain's console holds the
// workers' output back (Console::backlogged), such a worker is likely blocked in a write:
// silent by dtrain's doing, not hung.
bool pipeFilling(const Fd& fd) {
  int unread = 0;
  if (!fd || ::ioctl(fd.get(), FIONREAD, &unread) != 0) return false;
  const int cap = ::fcntl(fd.get(), F_GETPIPE_SZ);
  return cap > 0 && unread >= cap / 2;
}

// Whether process pid is stopped (SIGSTOP, a debugger): state T or t in /proc/PID/stat.
bool processStopped(pid_t pid) {
  std::string stat;
  int fd = ::open(fmt::format("/proc/{}/stat", pid).c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  char buf[512];
  ssize_t n = ::read(fd, buf, sizeof(buf));
  ::close(fd);
  if (n <= 0) return false;
  stat.assign(buf, static_cast<size_t>(n));
  size_t paren = stat.rfind(')');  // comm may hold spaces and parentheses
  if (paren == std::string::npos || paren + 2 >= stat.size()) return false;
  return stat[paren + 2] == 'T' || stat[paren + 2] == 't';
}

// Whether child pid has exited and waits to be reaped. One system call, not a read of /proc:
// this runs between a teardown's signals to the workers, and the time between those is the
// time a shell wrapper's fork can slip in (a group signal that comes while it forks misses
// the new child, and the shell, which catches SIGINT, waits for that child).
bool exitedUnreaped(pid_t pid) {
  siginfo_t info{};
  return ::waitid(P_PID, static_cast<id_t>(pid), &info, WEXITED | WNOHANG | WNOWAIT) == 0 && info.si_pid == pid;
}


struct Stream {
  Fd fd;
  LineSplitter splitter;
  bool is_err = false;
  Clock::time_point last_data{};     // of the latest read
  Clock::time_point partial_since{};  // when its unfinished line began; {} = none
  Clock::time_point redraw_at{};      // when an update of its line drawn in place is drawn; {} = none due
};

struct Worker {
  WorkerSlot slot;
  pid_t pid = -1;
  bool running = false;
  Stream out, err;
  Fd log;
  std::string log_path;
  bool log_failed = false;  // a write to it failed: said once
  // The stream whose line the log file's last line is, not yet ended (a piece that does not
  // end its line: LineSplitter::cut); null when the file ends with a newline.
  const Stream* log_open = nullptr;
  TailBuffer tail{20};
  std::string error_file;
  std::string watchdog_file;  // DTRAIN_WATCHDOG_FILE; armed once the worker first touches it
  // The signals dtrain sent it during teardown: it was stopped by dtrain only if one of
  // these ended it.
  std::bitset<NSIG> sent;
  // The first stop signal of a teardown that reached it alive (not one sent to a process
  // that had already exited, unreaped): a failure after it is reported as following it.
  int stopReachedAlive = 0;
  WorkerExit exit;
  // Reaped during a teardown while its process group still had members: a wrapper script
  // (bash dies of the SIGTERM at once) whose python is still saving a checkpoint. The group
  // keeps its grace period: it is waited for until it is empty, or SIGKILLed at the kill
  // deadline, and stays guarded (orphan guard) meanwhile. Its exit (the wrapper's) is
  // reported (on_exit) once the group is gone.
  bool lingering = false;
  Clock::time_point lingerKilled{};  // when the lingering group was SIGKILLed; {} = not yet
  // When dtrain's console last held its output back with its pipe filling (pipeFilling): its
  // watchdog counts its silence from then at the earliest.
  Clock::time_point heldAt{};
  // The watchdog file's last mtime seen, and when (steady clock) it was touched as far as
  // the checks can tell: silence is measured on the steady clock, so that a step of the wall
  // clock (NTP, a VM resumed) neither kills a healthy worker as hung nor blinds the watchdog.
  std::optional<std::filesystem::file_time_type> seenMtime;
  Clock::time_point touchedAt{};
  Clock::time_point watchCheckedAt{};
  Clock::time_point spawnedAt{};
};

class LocalLauncher final : public Launcher {
 public:
  explicit LocalLauncher(LocalRunOptions opts) : opts_(std::move(opts)) {}
  RunResult run(const Plan& plan, const spec::JobSpec& spec) override;

 private:
  void spawn(Worker& w, const Plan& plan, const spec::JobSpec& spec, const EnvMap& base);
  void emitLine(Worker& w, bool isErr, std::string_view line);
  // Ends the log file's unfinished line (Worker::log_open), if any.
  void endLogLine(Worker& w);
  bool onConsole(const Worker& w) const;
  // On a terminal: shows a worker's unfinished stdout line (its latest '\r' segment) in
  // place as the status line, until the line is complete.
  bool livePartial(const Worker& w, const Stream& s) const;
  std::string prefix(const Worker& w) const {  // "[rank N] " on console lines, unless --no-prefix
    return spec_->prefix_output ? fmt::format("[rank {}] ", w.slot.global_rank) : std::string();
  }
  bool showPartial(Worker& w);  // false: nothing to show (drawn nothing)
  bool mayTakeStatusLine(const Worker& w) const;
  // Takes a worker's unfinished line off the status line (it is complete, or gone): another
  // worker's takes its place, else the progress bar's.
  // `done`: whose unfinished line just became a line; its splitter still holds it while the
  // line is emitted, so it must not be shown again as unfinished.
  void dropPartial(const Worker* done);
  // Off a terminal: writes out unfinished lines idle for kPartialLineIdle; returns the poll
  // timeout (ms, -1 none) until the next one is due.
  int flushIdlePartials();
  // Writes `text` to `fd` above the status line (lifted out of the way and drawn again below).
  void writeAboveStatus(int fd, const std::string& text);
  void signalAll(int sig);
  void reap();
  // Lets go of lingering groups that are gone (or SIGKILLed kKilledGroupWait ago).
  void checkLingering();
  // A reaped worker is done with: its group no longer guarded, its exit reported.
  void release(Worker& w);
  void drain(Worker& w);
  void checkWatchdogs();
  void fillExit(Worker& w);
  void startShutdown(int sig, double graceS);
  // A passedOn() signal (SIGUSR1/2) for the workers.
  void passOn(int sig);

  LocalRunOptions opts_;
  const spec::JobSpec* spec_ = nullptr;
  std::vector<Worker> workers_;
  RunResult result_;
  bool stopping_ = false;
  Clock::time_point killDeadline_{};
  bool killed_ = false;
  bool watchdogFired_ = false;
  Clock::time_point stopStarted_{};
  bool teardownNoticed_ = false;  // one worker per attempt is killed as hung; teardown follows
  bool controlClosed_ = false;
  bool consoleTty_ = false;
  // The console is backlogged: the workers' pipes are left unread this turn of the loop
  // (backpressure), and lastHeld_ is when that was last so. Unfinished lines are not taken
  // for idle (kPartialLineIdle) while their rest may wait in a pipe.
  bool held_ = false;
  Clock::time_point lastHeld_{};
  // dtrain's stdout and stderr are one file (a terminal, 2>&1): each worker gets one pipe
  // for both, so that its lines keep the order it wrote them in; all of them go to stdout.
  bool merged_ = false;
  std::string statusLine_;  // drawn at the bottom of a terminal; "" = none
  OrphanGuard* guard_ = nullptr;  // run()'s, while it runs
  std::string barLine_;     // the latest kStatusPrefix bar, shown when no partial line is
  Worker* partialOwner_ = nullptr;  // whose unfinished line statusLine_ shows, if any
  // The OOM killer's counts when this attempt started: a worker SIGKILLed by no one dtrain
  // knows of, after they rose, is said to have run out of memory (fillExit).
  OomKillCounts oomBefore_;
  // This node's CPUs, read once an attempt (the OMP_NUM_THREADS default).
  CpuAvailability cpus_;
};

void LocalLauncher::spawn(Worker& w, const Plan& plan, const spec::JobSpec& spec, const EnvMap& base) {
  EnvOptions eo;
  eo.error_file = w.error_file;
  eo.restart_count = opts_.restart_count;
  eo.cpus = cpus_;
  EnvMap env = workerEnv(base, spec, plan, w.slot, eo);
  if (!w.watchdog_file.empty()) env["DTRAIN_WATCHDOG_FILE"] = w.watchdog_file;
  SpawnOptions so;
  for (const auto& [name, fd] : opts_.inherit_fds) {
    env[name] = std::to_string(fd);
    so.keep_fds.push_back(fd);
  }
  so.argv = spec.command;
  for (const auto& [k, v] : env) so.env.push_back(k + "=" + v);
  so.cwd = spec.cwd;
  so.merge_stderr = merged_;
  so.announce_fd = guard_ ? guard_->announceFd() : -1;
  // The built-in trainer takes SIGUSR1/SIGUSR2 as checkpoint requests once its handlers are
  // in: one passed on before then (a Slurm --signal landing on a round's start) waits for
  // them, rather than killing the worker by its default action and spending a restart.
  if (spec.trainer) so.blocked_signals = {SIGUSR1, SIGUSR2};
  w.spawnedAt = Clock::now();
  Spawned child = spawnProcess(so);
  w.pid = child.pid;
  w.running = true;
  w.out.fd = std::move(child.out);
  w.err.fd = std::move(child.err);
  w.err.is_err = true;
  w.exit.global_rank = w.slot.global_rank;
  w.exit.local_rank = w.slot.local_rank;
  w.exit.host = w.slot.host;
  w.exit.pid = child.pid;
  w.exit.start_failed = child.start_failed;
}

void LocalLauncher::emitLine(Worker& w, bool isErr, std::string_view line) {
  if (opts_.line_sink) {
    // (an agent's launcher merges when the launcher's console does: the tail is then of both)
    if (isErr || merged_) w.tail.push(line);
    opts_.line_sink(w.slot, isErr, line);
    return;
  }
  // A status line (kStatusPrefix) is drawn in place on a terminal, and replaced by the next
  // one; it never reaches log files or the stderr tail.
  if (!isErr && line.substr(0, kStatusPrefix.size()) == kStatusPrefix) {
    if (!consoleTty_) return;
    std::string text(line.substr(kStatusPrefix.size()));
    // An empty status ends the bar: nothing is drawn again below later lines.
    barLine_ = text.empty() ? std::string() : prefix(w) + text;
    if (partialOwner_ == &w) partialOwner_ = nullptr;  // the bar was its unfinished line
    if (partialOwner_) return;  // shown once that line is complete
    statusLine_ = barLine_;
    console().write(STDOUT_FILENO, "\r\x1b[2K" + statusLine_);
    return;
  }
  if (partialOwner_ == &w && !isErr) dropPartial(&w);  // its line is complete: printed below
  if (isErr || merged_) w.tail.push(line);
  if (w.log) {
    // A piece that does not end its line (cut at the maximum, or an unfinished line shown
    // after a pause) goes on in the rank's own file, where no other rank's line comes between;
    // a line of its other stream ends it first.
    const Stream& s = isErr ? w.err : w.out;
    if (w.log_open && (w.log_open != &s || !s.splitter.continues())) endLogLine(w);
    std::string rec;
    rec.reserve(line.size() + 1);
    rec.append(line);
    if (s.splitter.cut()) {
      w.log_open = &s;
    } else {
      rec.push_back('\n');
      w.log_open = nullptr;
    }
    if (!writeAll(w.log.get(), rec) && !w.log_failed) {
      const int err = errno;
      w.log_failed = true;
      writeAboveStatus(STDERR_FILENO, logWriteWarning(w.log_path, fmt::format("rank {}", w.slot.global_rank), err));
    }
  }
  if (!onConsole(w)) return;
  std::string rec = prefix(w);
  rec.append(line);
  rec.push_back('\n');
  writeAboveStatus(isErr ? STDERR_FILENO : STDOUT_FILENO, rec);
}

void LocalLauncher::endLogLine(Worker& w) {
  if (w.log_open && w.log && !w.log_failed) writeAll(w.log.get(), "\n");
  w.log_open = nullptr;
}

bool LocalLauncher::onConsole(const Worker& w) const {
  const auto& filter = spec_->console_ranks;
  return filter.empty() || std::find(filter.begin(), filter.end(), w.slot.local_rank) != filter.end();
}

bool LocalLauncher::livePartial(const Worker& w, const Stream& s) const {
  return consoleTty_ && !opts_.line_sink && !s.is_err && onConsole(w);
}

bool LocalLauncher::mayTakeStatusLine(const Worker& w) const {
  // The line drawn in place stays with the rank drawing it while that rank keeps updating
  // it: two ranks' progress bars taking turns made it flicker between them on every
  // update. Another rank's unfinished line is shown once the owner's is complete, or idle.
  return !partialOwner_ || partialOwner_ == &w || Clock::now() - partialOwner_->out.last_data >= kPartialOwnerIdle;
}

bool LocalLauncher::showPartial(Worker& w) {
  std::string_view p = w.out.splitter.pending();
  if (p.empty() || maybeStatus(p)) return false;
  std::string text = prefix(w);
  text.append(p);
  // One terminal row, or "\r\x1b[2K" would not erase all of it; not cut inside a UTF-8
  // character.
  winsize ws{};
  size_t cols = ::ioctl(STDOUT_FILENO, TIOCGWINSZ, &ws) == 0 && ws.ws_col > 1 ? ws.ws_col : 80;
  text.resize(utf8PrefixLength(text, cols - 1));
  partialOwner_ = &w;
  if (text == statusLine_) return true;
  statusLine_ = std::move(text);
  console().write(STDOUT_FILENO, "\r\x1b[2K" + statusLine_);
  return true;
}

void LocalLauncher::dropPartial(const Worker* done) {
  partialOwner_ = nullptr;
  statusLine_ = barLine_;
  const auto now = Clock::now();
  for (auto& o : workers_) {
    if (&o == done || o.out.splitter.pending().empty() || !livePartial(o, o.out) || now - o.out.partial_since < kPartialShowDelay)
      continue;
    if (showPartial(o)) return;
  }
  console().write(STDOUT_FILENO, "\r\x1b[2K" + statusLine_);
}

int LocalLauncher::flushIdlePartials() {
  const auto now = Clock::now();
  long nextMs = -1;
  for (auto& w : workers_) {
    for (Stream* s : {&w.out, &w.err}) {
      std::string_view p = s->splitter.pending();
      if (p.empty() || maybeStatus(p)) continue;
      if (livePartial(w, *s)) {  // drawn in place once it has waited kPartialShowDelay
        if (partialOwner_ == &w) {  // drawn: an update is due at redraw_at
          if (s->redraw_at == Clock::time_point{}) continue;
          if (s->redraw_at <= now) {
            s->redraw_at = {};
            showPartial(w);
            continue;
          }
          long ms = std::chrono::duration_cast<std::chrono::milliseconds>(s->redraw_at - now).count() + 1;
          if (nextMs < 0 || ms < nextMs) nextMs = ms;
          continue;
        }
        auto show = s->partial_since + kPartialShowDelay;
        if (show <= now && !mayTakeStatusLine(w)) {
          show = partialOwner_->out.last_data + kPartialOwnerIdle;  // looked at again then
        } else if (show <= now) {
          showPartial(w);
          continue;
        }
        long ms = std::chrono::duration_cast<std::chrono::milliseconds>(show - now).count() + 1;
        if (nextMs < 0 || ms < nextMs) nextMs = ms;
        continue;
      }
      auto due = std::max(s->last_data, lastHeld_) + kPartialLineIdle;
      if (due <= now) {
        bool isErr = s->is_err;
        s->splitter.flushPending([&](std::string_view l) { emitLine(w, isErr, l); });
        s->partial_since = s->redraw_at = {};
        continue;
      }
      long ms = std::chrono::duration_cast<std::chrono::milliseconds>(due - now).count() + 1;
      if (nextMs < 0 || ms < nextMs) nextMs = ms;
    }
  }
  return static_cast<int>(nextMs);
}

void LocalLauncher::writeAboveStatus(int fd, const std::string& text) {
  if (!statusLine_.empty()) console().write(STDOUT_FILENO, "\r\x1b[2K");
  console().write(fd, text);
  if (!statusLine_.empty()) console().write(STDOUT_FILENO, statusLine_);
}

void LocalLauncher::signalAll(int sig) {
  for (auto& w : workers_) {
    if (w.lingering) {  // its process is gone (its exit stays its own): only the group is left
      ::kill(-w.pid, sig);
      if (sig != SIGKILL && sig != SIGCONT) ::kill(-w.pid, SIGCONT);
      if (sig == SIGKILL && w.lingerKilled == Clock::time_point{}) w.lingerKilled = Clock::now();
      continue;
    }
    if (!w.running) continue;
    if (!w.stopReachedAlive && sig != SIGKILL && sig != SIGCONT && !exitedUnreaped(w.pid)) w.stopReachedAlive = sig;
    ::kill(-w.pid, sig);
    // A stopped worker (SIGSTOP, Ctrl-Z, a debugger) must run to act on it: its SIGTERM
    // handler would otherwise wait out the whole grace period before the SIGKILL.
    if (sig != SIGKILL && sig != SIGCONT) ::kill(-w.pid, SIGCONT);
    w.sent.set(static_cast<size_t>(sig));
  }
}

void LocalLauncher::passOn(int sig) {
  // To each worker's own process, not its group (as mpirun does): a DataLoader's processes
  // would die of a signal only the script handles. Not during a teardown: the workers are
  // going anyway, and a SIGUSR1 without a handler would read as a failure of their own.
  size_t n = 0;
  if (!stopping_)
    for (auto& w : workers_)
      if (w.running && ::kill(w.pid, sig) == 0) ++n;
  if (!opts_.line_sink)  // an agent's launcher: the user's console (and its notice) is elsewhere
    writeAboveStatus(STDERR_FILENO, n ? fmt::format("dtrain: {}: passed on to {} worker{}\n", signalName(sig), n, n == 1 ? "" : "s")
                                      : fmt::format("dtrain: {}: no worker runs{}; not passed on\n", signalName(sig),
                                                    stopping_ ? " (stopping)" : ""));
}

void LocalLauncher::startShutdown(int sig, double graceS) {
  auto deadline = Clock::now() + std::chrono::milliseconds(static_cast<long>(graceS * 1000));
  if (stopping_) {
    // A later, more urgent request may only shorten the grace period.
    if (deadline < killDeadline_) killDeadline_ = deadline;
    return;
  }
  stopping_ = true;
  stopStarted_ = Clock::now();
  signalAll(sig);
  killDeadline_ = deadline;
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
      const bool teardown = stopping_;  // under way before this exit (whose failure may start one)
      w.exit.when = utcNow();
      if (WIFSIGNALED(status)) {
        w.exit.signal = WTERMSIG(status);
      } else {
        w.exit.exit_code = WEXITSTATUS(status);
      }
      bool failed = w.exit.signal != 0 || w.exit.exit_code != 0;
      // Ended by dtrain's teardown only if it died of a signal dtrain sent it (or exited
      // 128+that signal, as a shell does): a worker that failed on its own at the same time
      // (every rank exiting 127) is a failure too.
      const int endedBy = endedBySignal(w.exit);
      if (failed && endedBy && w.sent.test(static_cast<size_t>(endedBy)) && !w.exit.hung)  // (endedBy < NSIG)
        w.exit.stopped_by_dtrain = true;
      // Failed in another way after the teardown's signal reached it (its handler exited 1, or
      // saving a checkpoint on SIGTERM failed): still its failure, but said as following it.
      else if (failed && !w.exit.hung && w.stopReachedAlive)
        w.exit.after_stop = w.stopReachedAlive;
      // The built-in trainer exits 2 only for input it refuses (docs/errors.md): no attempt
      // would get further.
      if (spec_->trainer && !w.exit.signal && w.exit.exit_code == kExitUsage && !w.exit.hung) w.exit.refused_input = true;
      if (failed && !stopping_ && result_.first_failure < 0) {
        result_.first_failure = static_cast<int>(i);
        result_.first_failure_at = Clock::now();
        startShutdown(SIGTERM, spec_->shutdown_timeout_s);
      }
      // Whatever is left in the process group (grandchildren: a DataLoader's processes) goes
      // with a worker that failed or was stopped. A worker that failed on its own takes it
      // along at once. In a teardown the grace period is the group's, not only the worker's
      // own: a wrapper script dies of the SIGTERM at once while the python it runs (which got
      // the SIGTERM too) saves a checkpoint; the group lingers until it is empty or the kill
      // deadline (signalAll(SIGKILL)). A worker that finished its work (exit 0, no teardown
      // under way) may have left work of its own running on purpose (an upload started with
      // Popen): that is left alone, as torchrun does, and no longer guarded.
      if (teardown && groupAlive(pid)) {
        w.lingering = true;
        if (killed_) {  // past the grace period: SIGKILLed now, and waited for (kKilledGroupWait)
          ::kill(-pid, SIGKILL);
          w.lingerKilled = Clock::now();
        }
        continue;
      }
      if (failed || stopping_) ::kill(-pid, SIGKILL);
      release(w);
    }
  }
}

void LocalLauncher::release(Worker& w) {
  w.lingering = false;
  guard_->unwatch(w.pid);
  if (opts_.on_exit) {
    // Reported now, not at the end: a remote launcher must learn of the first failure
    // before this node's teardown (and other nodes' knock-on failures) play out. (A
    // lingering group's worker once its group is gone: the launcher's teardown notice
    // names it while it lingers.)
    drain(w);
    fillExit(w);
    opts_.on_exit(w.exit);
  }
}

void LocalLauncher::checkLingering() {
  const auto now = Clock::now();
  for (auto& w : workers_) {
    if (!w.lingering) continue;
    const bool givenUp = w.lingerKilled != Clock::time_point{} && now - w.lingerKilled >= kKilledGroupWait;
    if (!givenUp && groupAlive(w.pid)) continue;
    release(w);
  }
}

// Silences closer than this (two ranks' last touches) do not tell the hung rank from a peer
// waiting for it: the ranks of a step touch within milliseconds of each other, and the file's
// mtime and the check's 0.1 s period blur the rest.
constexpr double kTellHungApartS = 0.5;

void LocalLauncher::checkWatchdogs() {
  if (watchdogFired_) return;
  auto now = std::filesystem::file_time_type::clock::now();
  struct Armed {
    Worker* w;
    double silent;
  };
  std::vector<Armed> armed;
  bool tripped = false;
  const auto steadyNow = Clock::now();
  for (auto& w : workers_) {
    if (!w.running || w.watchdog_file.empty()) continue;
    std::error_code ec;
    auto touched = std::filesystem::last_write_time(w.watchdog_file, ec);
    if (ec) continue;  // not armed: the worker never touched it
    if (!w.seenMtime || *w.seenMtime != touched) {
      // Touched since the last check: when, within the time since that check, the wall
      // clock says (a touch is never placed before the last check, nor in the future).
      // (first seen: touched at most since the worker started)
      const auto sinceCheck = steadyNow - (w.seenMtime ? w.watchCheckedAt : w.spawnedAt);
      const auto ago = std::chrono::duration_cast<Clock::duration>(now - touched);
      w.touchedAt = steadyNow - std::clamp(ago, Clock::duration::zero(), sinceCheck);
      w.seenMtime = touched;
    }
    w.watchCheckedAt = steadyNow;
    // A worker blocked writing to a pipe dtrain does not read (its console backlogged) is
    // held up by dtrain: its silence counts from when that ended.
    if (held_ && (pipeFilling(w.out.fd) || pipeFilling(w.err.fd))) w.heldAt = steadyNow;
    double silent = std::chrono::duration<double>(steadyNow - w.touchedAt).count();
    if (w.heldAt != Clock::time_point{})
      silent = std::min(silent, std::chrono::duration<double>(steadyNow - w.heldAt).count());
    armed.push_back({&w, silent});
    tripped |= armed.back().silent > spec_->worker_timeout_s;
  }
  if (!tripped) return;
  // The first to trip need not be the hung one: peers blocked in a collective waiting for it
  // go silent too, from about the same moment. A stopped worker (SIGSTOP, a debugger) is
  // blamed first, else the one silent longest.
  const Armed* pick = nullptr;
  bool stopped = false;
  for (const auto& a : armed) {
    bool st = processStopped(a.w->pid);
    if (!pick || (st && !stopped) || (st == stopped && a.silent > pick->silent)) {
      pick = &a;
      stopped = st;
    }
  }
  // Across nodes the culprit may be on another host (its peers here merely wait for it):
  // only a stopped worker is sure to be the one; another waits out the deferral, by which
  // time the culprit's agent has killed it and the job's teardown stops these.
  if (!stopped && opts_.other_nodes && pick->silent <= spec_->worker_timeout_s + watchdogDeferS(spec_->worker_timeout_s))
    return;
  std::string others;
  double runnerUp = -1;  // the longest silence of the others
  for (const auto& a : armed)
    if (&a != pick && a.silent > spec_->worker_timeout_s / 2) {
      others += fmt::format("{}rank {} {:.1f} s", others.empty() ? "" : ", ", a.w->slot.global_rank, a.silent);
      runnerUp = std::max(runnerUp, a.silent);
    }
  // Hung (stopped, deadlocked): killed and counted as this worker's failure.
  Worker& w = *pick->w;
  watchdogFired_ = true;
  w.exit.hung = true;
  w.exit.error_message = fmt::format("no heartbeat for {:.1f} s (worker_timeout_s {}{}); killed as hung", pick->silent,
                                     spec_->worker_timeout_s,
                                     !stopped && opts_.other_nodes
                                         ? fmt::format(", + {:g} s across nodes", watchdogDeferS(spec_->worker_timeout_s))
                                         : std::string());
  if (stopped) w.exit.error_message += " (it was stopped: state T)";
  // A rank that hangs mid-step and its peers, which then wait for it in the step's
  // collective, last touched the file at the end of the same step: silences that close say
  // nothing of which one hung, and the message does not pretend they do.
  const double margin = pick->silent - runnerUp;
  if (!others.empty())
    w.exit.error_message += fmt::format(
        "; also silent: {} (peers blocked in a collective with a hung rank go silent too; blamed: {})", others,
        stopped             ? std::string("the stopped one")
        : margin >= kTellHungApartS ? fmt::format("the one silent longest, by {:.1f} s", margin)
                            : fmt::format("the one silent longest, by {:.2f} s: too close to tell which one hung", margin));
  ::kill(-w.pid, SIGKILL);
  ::kill(-w.pid, SIGCONT);  // a stopped process group must run to die
}

void LocalLauncher::drain(Worker& w) {
  // The worker is gone, so what it wrote is all in the pipes; bounded in case a
  // grandchild keeps writing.
  char buf[65536];
  for (Stream* s : {&w.out, &w.err}) {
    bool isErr = s->is_err;
    for (int i = 0; i < 16 && s->fd; ++i) {
      pollfd p{s->fd.get(), POLLIN, 0};
      if (::poll(&p, 1, 0) <= 0) break;
      ssize_t got = ::read(s->fd.get(), buf, sizeof(buf));
      if (got <= 0) {
        s->splitter.finish([&](std::string_view l) { emitLine(w, isErr, l); });
        s->fd.reset();
        break;
      }
      s->splitter.feed(std::string_view(buf, static_cast<size_t>(got)), [&](std::string_view l) { emitLine(w, isErr, l); });
    }
  }
}

void LocalLauncher::fillExit(Worker& w) {
  w.exit.stderr_tail.assign(w.tail.lines().begin(), w.tail.lines().end());
  if (w.exit.hung) return;  // the watchdog's message says what happened
  if (auto e = spec::readWorkerErrorFile(w.error_file)) {
    w.exit.error_message = e->message;
    w.exit.error_traceback = e->traceback;
  }
  // A SIGKILL no one here sent, while the OOM killer's count rose: "killed by SIGKILL" alone
  // leaves a user guessing, and the next attempt would likely run out the same way.
  if (w.exit.signal == SIGKILL && !w.exit.stopped_by_dtrain && w.exit.error_message.empty())
    w.exit.error_message = oomKillReason(oomBefore_, oomKillCounts());
}

RunResult LocalLauncher::run(const Plan& plan, const spec::JobSpec& spec) {
  spec_ = &spec;
  result_ = {};
  oomBefore_ = oomKillCounts();
  stopping_ = killed_ = controlClosed_ = watchdogFired_ = teardownNoticed_ = false;
  SignalScope signals;
  EnvMap base = currentEnvironment();
  consoleTty_ = consoleCanRedraw();
  // An agent merges when its launcher's console is one file (merge_output); else its lines
  // keep their stream, printed on the launcher's console.
  merged_ = opts_.line_sink ? opts_.merge_output : sameOpenFile(STDOUT_FILENO, STDERR_FILENO);
  result_.merged_output = merged_;
  statusLine_.clear();
  barLine_.clear();
  partialOwner_ = nullptr;
  // Workers learn whether a live status line can be shown (the trainer's progress bar).
  if (consoleTty_) base["DTRAIN_CONSOLE_TTY"] = "1";
  // ... and its size, less the widest "[rank N] " (an agent's workers get the launcher's, in
  // the shipped spec's env).
  if (consoleTty_ && !opts_.line_sink)
    addConsoleSize(base, spec.env,
                   spec.prefix_output ? fmt::format("[rank {}] ", std::max(0, plan.world_size - 1)).size() : 0);

  // Error files live under log_dir when there is one (kept), else in a private temp dir. An
  // agent's always go to a temp dir on its host: log_dir is the launching host's (the path
  // may not exist elsewhere), and what they say comes back in the exit record.
  std::filesystem::path errRoot;
  bool tempErrRoot = spec.log_dir.empty() || static_cast<bool>(opts_.line_sink);
  if (!tempErrRoot) {
    std::filesystem::create_directories(spec.log_dir);
    errRoot = std::filesystem::path(spec.log_dir) / plan.run_id;
  } else {
    // (absolute: a relative TMPDIR would hand workers that start in the spec's cwd error
    // file paths that lead nowhere) Named with this process's pid (ownedFilePrefix): the
    // guard below removes it if the launcher is killed, and the next launch sweeps one that
    // was left when the guard died too (a cgroup's kill).
    const std::string tmp = tempDirectory();
    if (opts_.restart_count == 0) removeStaleOwnedFiles(tmp, {kErrDirStem});  // (once a job: a restart has nothing new to sweep)
    std::string tmpl = (std::filesystem::path(tmp) / (ownedFilePrefix(kErrDirStem, plan.run_id) + "XXXXXX")).string();
    if (!::mkdtemp(tmpl.data())) throwErrno(fmt::format("cannot create a directory in {} (the temp directory, TMPDIR)", tmp));
    errRoot = tmpl;
  }

  workers_.clear();
  workers_.resize(plan.workers.size());
  for (size_t i = 0; i < plan.workers.size(); ++i) {
    Worker& w = workers_[i];
    w.slot = plan.workers[i];
    auto dir = errRoot / fmt::format("attempt_{}", opts_.restart_count) / std::to_string(w.slot.global_rank);
    std::filesystem::create_directories(dir);
    w.error_file = (dir / "error.json").string();
    if (spec.worker_timeout_s > 0) {
      w.watchdog_file = (dir / "watchdog").string();
      std::filesystem::remove(w.watchdog_file);
    }
    if (!spec.log_dir.empty() && !opts_.line_sink) {
      auto logPath = std::filesystem::path(spec.log_dir) / fmt::format("rank_{}.log", w.slot.global_rank);
      // Appended to, after a header line: earlier runs and attempts stay.
      w.log = Fd(openRankLog(logPath.string(), plan.run_id, opts_.restart_count));
      w.log_path = logPath.string();
    }
  }
  cpus_ = cpuAvailability();
  const std::string omp = defaultOmpThreads(base, spec, cpus_);
  // (a later attempt says it again when it changed: a CPU quota changed in between)
  const bool changed = opts_.restart_count > 0 && opts_.omp_said && *opts_.omp_said != omp;
  if (changed && !opts_.line_sink) {
    console().write(STDERR_FILENO,
                    omp.empty() ? fmt::format("dtrain: restart {}: OMP_NUM_THREADS is no longer set for the worker (it "
                                              "was {}): this process may use {}\n",
                                              opts_.restart_count, *opts_.omp_said, cpus_.describe())
                                : fmt::format("dtrain: restart {}: setting OMP_NUM_THREADS={} for the worker (it was {}): "
                                              "this process may use {}\n",
                                              opts_.restart_count, omp, opts_.omp_said->empty() ? "unset" : *opts_.omp_said,
                                              cpus_.describe()));
  }
  if (opts_.omp_said) *opts_.omp_said = omp;
  if (!omp.empty() && !opts_.line_sink && opts_.restart_count == 0) {  // an agent's launcher says it once for all nodes
    if (spec.nproc_per_node > 1)
      console().write(STDERR_FILENO,
                      fmt::format("dtrain: setting OMP_NUM_THREADS=1 for each of the {} workers to avoid overloading the "
                                  "machine; set it in the spec's env or with --env to tune\n",
                                  spec.nproc_per_node));
    else
      console().write(STDERR_FILENO,
                      fmt::format("dtrain: setting OMP_NUM_THREADS={} for the worker: this process may use {}; set it in "
                                  "the spec's env or with --env to tune\n",
                                  omp, cpus_.describe()));
  }

  SubreaperScope subreaper;
  OrphanGuard guard;
  guard_ = &guard;
  for (const auto& f : opts_.remove_if_killed) guard.removeIfKilled(f);
  if (tempErrRoot) guard.removeIfKilled(errRoot.string());
  for (auto& w : workers_) {
    if (stopping_) break;
    spawn(w, plan, spec, base);
    guard.watchAnnounced(w.pid);
  }

  std::vector<char> buf(65536);
  Console& con = console();
  held_ = false;
  lastHeld_ = {};
  // Read from the pipes with every worker gone, and since when they are.
  size_t leftover = 0;
  std::optional<Clock::time_point> allGoneAt;
  while (true) {
    std::vector<pollfd> fds;
    std::vector<std::pair<Worker*, Stream*>> owners;
    fds.push_back({signals.fd(), POLLIN, 0});
    owners.push_back({nullptr, nullptr});
    fds.push_back({controlClosed_ ? -1 : opts_.control_fd, POLLIN, 0});  // poll ignores a negative fd
    owners.push_back({nullptr, nullptr});
    // Running: a worker's process, or a lingering group of one (waited for the same way).
    bool anyRunning = false, anyLingering = false;
    for (auto& w : workers_) {
      anyRunning |= w.running || w.lingering;
      anyLingering |= w.lingering;
    }
    // Backpressure: while the console (dtrain's stdout and stderr, or an agent's channel to
    // its launcher) takes nothing more, the workers' pipes are left unread, and a worker
    // blocks on its writes as it would on a stalled terminal of its own; everything else in
    // this loop (signals, control, reaping, deadlines, watchdogs) goes on. Read on once the
    // console's wake descriptor says the backlog has gone down. With every worker gone, what
    // is left in the pipes is read regardless: the pipes bound it, unless a grandchild that
    // kept one open writes on, cut off after kLeftoverWindow or kLeftoverMax, as after 200 ms
    // of silence below.
    held_ = con.backlogged() && anyRunning;
    if (held_) {
      lastHeld_ = Clock::now();
      fds.push_back({con.wakeFd(), POLLIN, 0});
      owners.push_back({nullptr, nullptr});
    }
    const size_t firstStream = fds.size();
    bool anyStreams = false;
    for (auto& w : workers_) {
      for (Stream* s : {&w.out, &w.err}) {
        if (!s->fd) continue;
        anyStreams = true;
        if (held_) continue;
        fds.push_back({s->fd.get(), POLLIN, 0});
        owners.push_back({&w, s});
      }
    }
    if (anyRunning) allGoneAt.reset();
    else if (!allGoneAt) allGoneAt = Clock::now();
    if (!anyRunning && anyStreams && (leftover >= kLeftoverMax || Clock::now() - *allGoneAt >= kLeftoverWindow)) {
      // (a process a worker left running writes on: said, as its output is lost from now on)
      // (the ranks whose pipes still get data: a pipe merely held open says nothing)
      std::vector<std::string> ranks;
      for (const auto& w : workers_)
        if ((w.out.fd && w.out.last_data >= *allGoneAt) || (w.err.fd && w.err.last_data >= *allGoneAt))
          ranks.push_back(std::to_string(w.slot.global_rank));
      if (ranks.empty())
        for (const auto& w : workers_)
          if (w.out.fd || w.err.fd) ranks.push_back(std::to_string(w.slot.global_rank));
      const bool one = ranks.size() == 1;
      writeAboveStatus(STDERR_FILENO,
                       fmt::format("{}{} {} exited, but {} left running still {} to {} output; not read any more "
                                   "({} EPIPE or SIGPIPE): redirect {} output to keep it\n",
                                   opts_.line_sink ? "" : "dtrain: ", one ? "rank" : "ranks", fmt::join(ranks, ", "),
                                   one ? "a process it" : "processes they", one ? "writes" : "write", one ? "its" : "their",
                                   one ? "that process gets" : "those processes get", one ? "its" : "their"));
      break;
    }
    if (!anyRunning && !anyStreams) break;
    int timeoutMs = -1;
    if (stopping_ && !killed_) {
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(killDeadline_ - Clock::now()).count();
      timeoutMs = static_cast<int>(std::max<long>(0, left));
      // A teardown after a failure that takes a while (a worker slow to honour SIGTERM, or
      // ignoring it) says what it waits for, once: it would otherwise look like a hang.
      if (anyRunning && !teardownNoticed_ && result_.first_failure >= 0 && !result_.received_signal && !opts_.line_sink) {
        const auto at = stopStarted_ + kTeardownNoticeAfter;
        if (Clock::now() >= at) {
          teardownNoticed_ = true;
          std::vector<std::string> ranks;
          for (const auto& w : workers_)
            if (w.running || w.lingering) ranks.push_back(std::to_string(w.slot.global_rank));
          writeAboveStatus(STDERR_FILENO,
                           fmt::format("dtrain: rank {} failed; waiting up to {:.0f} s more for rank(s) {} to exit after "
                                       "SIGTERM, then SIGKILL (shutdown_timeout_s, --shutdown-timeout)\n",
                                       workers_[static_cast<size_t>(result_.first_failure)].slot.global_rank,
                                       std::max(0.0, std::chrono::duration<double>(killDeadline_ - Clock::now()).count()),
                                       fmt::join(ranks, ", ")));
        } else {
          timeoutMs = std::min<int>(timeoutMs, static_cast<int>(std::chrono::duration_cast<std::chrono::milliseconds>(
                                                                    at - Clock::now()).count()) + 1);
        }
      }
    }
    // With every worker gone, a grandchild that kept a pipe open must not hold dtrain up.
    // (kLeftoverWindow is looked at above, at the next turn)
    if (!anyRunning) timeoutMs = 200;
    if (spec.worker_timeout_s > 0 && anyRunning && (timeoutMs < 0 || timeoutMs > 250)) timeoutMs = 250;
    if (anyLingering && (timeoutMs < 0 || timeoutMs > kLingerPollMs)) timeoutMs = kLingerPollMs;
    const int partialMs = flushIdlePartials();
    if (anyRunning && partialMs >= 0 && (timeoutMs < 0 || partialMs < timeoutMs)) timeoutMs = partialMs;
    int n = ::poll(fds.data(), fds.size(), timeoutMs);
    if (n < 0 && errno != EINTR) throwErrno("poll");
    if (n == 0 && !anyRunning) break;
    if (anyLingering) {
      reap();  // (orphans of a lingering group, this process being their reaper: see SubreaperScope)
      checkLingering();
    }
    if (spec.worker_timeout_s > 0 && !stopping_) checkWatchdogs();
    if (stopping_ && !killed_ && Clock::now() >= killDeadline_) {
      killed_ = true;
      signalAll(SIGKILL);
    }
    if (n <= 0) continue;
    if (fds[0].revents & POLLIN) {
      signals.drain([&](int sig) {
        // dtrain's own share of a scheduler's stop, whose signal killed a worker a moment ago:
        // the same stop, not a second signal after a failure (job.cc).
        const bool sameStop = !result_.received_signal && result_.first_failure >= 0 &&
                              outsideStopSignal(workers_[static_cast<size_t>(result_.first_failure)].exit) &&
                              Clock::now() - result_.first_failure_at <= kOutsideStopWindow;
        if (sameStop) result_.outside_stop = true;
        if (!result_.received_signal) result_.received_signal = sig;
        const bool ownConsole = !opts_.line_sink;  // an agent's launcher: the user's console is elsewhere
        if (stopping_ && sig == SIGINT && !killed_ && !sameStop) {
          // A second Ctrl-C means "now".
          killed_ = true;
          result_.killed_now = true;
          signalAll(SIGKILL);
          if (ownConsole) console().write(STDERR_FILENO, "dtrain: killing the workers now (SIGKILL)\n");
        }
        if (!stopping_ && ownConsole) {
          const size_t running = static_cast<size_t>(
              std::count_if(workers_.begin(), workers_.end(), [](const Worker& w) { return w.running; }));
          writeAboveStatus(STDERR_FILENO, detail::shutdownNotice(signalName(sig), running, "worker", signalName(sig),
                                                                 spec_->shutdown_timeout_s, sig == SIGINT));
        }
        startShutdown(sig, spec_->shutdown_timeout_s);
      }, [&](int sig) { passOn(sig); });
      reap();
    }
    if (opts_.control_fd >= 0 && (fds[1].revents & (POLLIN | POLLHUP | POLLERR))) {
      ControlAction a = opts_.on_control ? opts_.on_control() : ControlAction::kNone;
      if (const int sig = stopActionSignal(a)) startShutdown(sig, spec.shutdown_timeout_s);
      if (a == ControlAction::kKill) startShutdown(SIGKILL, 0);  // or, already stopping, SIGKILL now
      if (a == ControlAction::kPassOnUsr1) passOn(SIGUSR1);
      if (a == ControlAction::kPassOnUsr2) passOn(SIGUSR2);
      if (a == ControlAction::kLost) {
        controlClosed_ = true;  // the controller is gone: nothing more to read
        startShutdown(SIGTERM, std::min(spec.shutdown_timeout_s, kLostControllerGraceS));
      }
    }
    if (held_ && (fds[firstStream - 1].revents & POLLIN)) con.clearWake();  // read on at the next turn
    for (size_t i = firstStream; i < fds.size(); ++i) {
      if (!(fds[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
      auto [w, s] = owners[i];
      ssize_t got = ::read(s->fd.get(), buf.data(), buf.size());
      if (got < 0 && errno == EINTR) continue;
      if (got > 0 && !anyRunning) leftover += static_cast<size_t>(got);
      bool isErr = s->is_err;
      if (got <= 0) {
        s->splitter.finish([&](std::string_view l) { emitLine(*w, isErr, l); });
        s->fd.reset();
        continue;
      }
      s->last_data = Clock::now();
      s->splitter.feed(std::string_view(buf.data(), static_cast<size_t>(got)),
                       [&](std::string_view l) { emitLine(*w, isErr, l); });
      if (s->splitter.pending().empty())
        s->partial_since = s->redraw_at = {};
      else if (s->partial_since == Clock::time_point{})
        s->partial_since = s->last_data;
      if (livePartial(*w, *s) && s->last_data - s->partial_since >= kPartialShowDelay && mayTakeStatusLine(*w)) {
        if (partialOwner_ != w) showPartial(*w);
        else if (s->redraw_at == Clock::time_point{}) s->redraw_at = s->last_data + kPartialRedrawDelay;
      }
    }
    reap();
  }
  for (auto& w : workers_) {
    for (Stream* s : {&w.out, &w.err}) {
      bool isErr = s->is_err;
      s->splitter.finish([&](std::string_view l) { emitLine(w, isErr, l); });
    }
    endLogLine(w);  // (a piece whose worker wrote no more: the next attempt's header starts a line)
    fillExit(w);
    result_.workers.push_back(w.exit);
  }
  if (!statusLine_.empty()) console().write(STDOUT_FILENO, "\n");
  std::error_code ec;
  if (tempErrRoot) {
    std::filesystem::remove_all(errRoot, ec);
  } else {
    // Kept error files stay; the directories of ranks that wrote none go (remove() leaves a
    // directory that is not empty alone).
    for (auto& w : workers_) {
      if (!w.watchdog_file.empty()) std::filesystem::remove(w.watchdog_file, ec);
      std::filesystem::remove(std::filesystem::path(w.error_file).parent_path(), ec);
    }
    std::filesystem::remove(errRoot / fmt::format("attempt_{}", opts_.restart_count), ec);
    std::filesystem::remove(errRoot, ec);
  }
  // Reaped first is not always first to fail: a rank that only lost its peer names it.
  result_.first_failure = rootCause(result_.workers, result_.first_failure);
  if (result_.received_signal) {
    result_.exit_code = 128 + result_.received_signal;
  } else if (result_.first_failure >= 0) {
    const auto& f = result_.workers[result_.first_failure];
    result_.exit_code = f.signal ? 128 + f.signal : f.exit_code;
  }
  guard_ = nullptr;
  return result_;
}

}  // namespace

ControlAction stopAction(int sig) {
  return sig == SIGINT    ? ControlAction::kStopSigint
         : sig == SIGHUP  ? ControlAction::kStopSighup
         : sig == SIGQUIT ? ControlAction::kStopSigquit
                          : ControlAction::kStop;
}

int stopActionSignal(ControlAction a) {
  switch (a) {
    case ControlAction::kStop: return SIGTERM;
    case ControlAction::kStopSigint: return SIGINT;
    case ControlAction::kStopSighup: return SIGHUP;
    case ControlAction::kStopSigquit: return SIGQUIT;
    default: return 0;
  }
}

std::unique_ptr<Launcher> makeLocalLauncher(LocalRunOptions opts) {
  return std::make_unique<LocalLauncher>(std::move(opts));
}

int rootCause(const std::vector<WorkerExit>& workers, int first) {
  // The peer a rank says it lost: the communicator's "<op> on rank R: lost rank K" (R its own).
  auto lostPeer = [](const WorkerExit& w) -> int {
    auto find = [&](std::string_view text) -> int {
      const std::string own = fmt::format(" on rank {}: lost rank ", w.global_rank);
      const size_t at = text.find(own);
      if (at == std::string_view::npos) return -1;
      int k = -1;
      const char* b = text.data() + at + own.size();
      auto [end, ec] = std::from_chars(b, text.data() + text.size(), k);
      return ec == std::errc() && end != b ? k : -1;
    };
    if (int k = find(w.error_message); k >= 0) return k;
    for (auto it = w.stderr_tail.rbegin(); it != w.stderr_tail.rend(); ++it)
      if (int k = find(*it); k >= 0) return k;
    return -1;
  };
  auto failedOnItsOwn = [](const WorkerExit& w) {
    return (w.signal != 0 || w.exit_code != 0) && !w.stopped_by_dtrain && !w.lost;
  };
  int cause = first;
  std::vector<bool> seen(workers.size(), false);
  while (cause >= 0) {
    seen[static_cast<size_t>(cause)] = true;
    const int k = lostPeer(workers[static_cast<size_t>(cause)]);
    if (k < 0) break;
    auto it = std::find_if(workers.begin(), workers.end(), [&](const WorkerExit& w) { return w.global_rank == k; });
    if (it == workers.end() || !failedOnItsOwn(*it)) break;
    const int next = static_cast<int>(it - workers.begin());
    if (seen[static_cast<size_t>(next)]) return first;  // ranks that say they lost each other: no telling
    cause = next;
  }
  return cause;
}

int endedBySignal(const WorkerExit& w) {
  const int sig = w.signal ? w.signal : w.exit_code > 128 ? w.exit_code - 128 : 0;
  return sig > 0 && sig < NSIG ? sig : 0;
}

int outsideStopSignal(const WorkerExit& w) {
  if (w.stopped_by_dtrain || w.hung || w.lost) return 0;
  const int sig = endedBySignal(w);
  return sig == SIGTERM || sig == SIGINT || sig == SIGHUP ? sig : 0;
}

std::string exitReason(const WorkerExit& w) {
  if (w.hung) return "hung";  // its message is the watchdog's, said by the worker_hung event
  std::string out = w.signal ? "killed by " + signalName(w.signal) : fmt::format("exited with code {}", w.exit_code);
  // One line whatever the worker wrote: the first non-blank one, tabs and a CRLF's '\r' as
  // spaces, other control characters and bytes that are no UTF-8 in \xNN form, as the
  // summary's lines show them (visible() below).
  std::string msg;
  for (const auto& l : split(w.error_message, '\n')) {
    msg = l;
    for (char& c : msg)
      if (c == '\t' || c == '\r') c = ' ';
    msg = oneLine(msg);
    msg.erase(0, msg.find_first_not_of(' '));
    msg.erase(msg.find_last_not_of(' ') + 1);
    if (!msg.empty()) break;
  }
  if (msg.empty()) return out;
  if (msg.size() > kExitReasonMessageMax) msg = msg.substr(0, utf8PrefixLength(msg, kExitReasonMessageMax)) + "...";
  return out + " (" + msg + ")";
}

std::string notRestartedReason(const WorkerExit& w, const spec::JobSpec& spec, const std::string& host) {
  if (w.refused_input && !w.start_failed)
    return fmt::format(
        "not restarted: rank {}{} stopped on an error no restart can fix (exit 2: its spec, a data file, a "
        "checkpoint, a diverged training, memory it ran out of; see its error below); every attempt would "
        "fail the same way",
        w.global_rank, host.empty() ? std::string() : " on " + host);
  // (an ad hoc job has no spec to fix: its command is the one after --)
  const bool fromSpec = !spec.source.empty() && spec.source != "command line";
  return fmt::format("not restarted: rank {}'s command '{}' cannot be started{} (see its error below); {}",
                     w.global_rank, spec.command.empty() ? std::string() : spec.command.front(),
                     host.empty() ? std::string() : " on " + host,
                     fromSpec ? fmt::format("fix the command, PATH or cwd in {}", spec.source)
                              : std::string("fix the command after --, or PATH"));
}

namespace {

// A line of a worker's error file as the summary prints it: control characters other than
// tab, and bytes that are no UTF-8 (oneLine), in \xNN form, so that an escape sequence in an
// exception's message (a colour left on, a cursor move) never reaches the terminal raw. A
// line's own '\r' (CRLF) is dropped.
std::string visible(std::string_view line) {
  if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
  std::string out;
  out.reserve(line.size());
  for (size_t start = 0;;) {
    const size_t tab = line.find('\t', start);
    out += oneLine(line.substr(start, tab == std::string_view::npos ? std::string_view::npos : tab - start));
    if (tab == std::string_view::npos) break;
    out += '\t';
    start = tab + 1;
  }
  return out;
}

// `File "x.py", line 7, in <module>` (trimmed): a Python traceback's frame line.
bool isFrameLine(const std::string& t) {
  if (t.rfind("File \"", 0) != 0) return false;
  const size_t at = t.find("\", line ");
  return at != std::string::npos && at + 8 < t.size() && t[at + 8] >= '0' && t[at + 8] <= '9';
}

// The output tail less what the error file's message and traceback already say: Python
// prints the traceback to stderr that @record writes to the error file. Its outer frames
// (`File "train.py", line 53, in <module>` / `main()`, above @record's wrapper, where the
// file's traceback begins) are traceback lines too, as are a cut line's (the tail keeps
// TailBuffer::kMaxLine bytes of a line) that begin one of the file's.
// Without a traceback, only the lines that repeat the message go: the message itself, or
// it after "dtrain: error: " (dtrain train's stderr line for what it writes to the file).
std::vector<std::string> tailLessTraceback(const WorkerExit& f) {
  std::set<std::string> said;
  for (const std::string* text : {&f.error_traceback, &f.error_message})
    for (const auto& l : split(*text, '\n'))
      if (std::string t = trim(l); !t.empty()) said.insert(std::move(t));
  if (f.error_traceback.empty()) {
    std::vector<std::string> out;
    for (const auto& l : f.stderr_tail) {
      std::string t = trim(l);
      if (t.rfind("dtrain: error: ", 0) == 0) t.erase(0, 15);
      if (!said.count(t)) out.push_back(l);
    }
    return out;
  }
  auto known = [&](const std::string& raw, const std::string& t) {
    if (said.count(t)) return true;
    if (raw.size() < TailBuffer::kMaxLine) return false;
    const auto it = said.lower_bound(t);  // the lines that t begins, if any, sort from here
    return it != said.end() && it->rfind(t, 0) == 0;
  };
  // Entries: a frame (its line, then its source line and ^^^ markers, indented) or one other
  // line. Dropped, from the end back: a frame the file has, and the run of frames just
  // before one (the outer frames); another line the file has, but a "Traceback (most recent
  // call last):" header only above dropped frames. A traceback the script printed itself (an
  // exception it handled) keeps its header and frames.
  const auto& tail = f.stderr_tail;
  struct Entry {
    size_t begin, end;
    bool frame;
  };
  std::vector<Entry> entries;
  for (size_t i = 0; i < tail.size();) {
    size_t j = i + 1;
    const bool frame = isFrameLine(trim(tail[i]));
    if (frame)
      while (j < tail.size() && !trim(tail[j]).empty() && tail[j].rfind("    ", 0) == 0) ++j;
    entries.push_back({i, j, frame});
    i = j;
  }
  std::vector<bool> drop(entries.size(), false);
  bool nextDropped = false, nextDroppedFrame = false;
  for (size_t k = entries.size(); k-- > 0;) {
    const Entry& e = entries[k];
    const std::string t = trim(tail[e.begin]);
    if (e.frame)
      drop[k] = known(tail[e.begin], t) || nextDroppedFrame;
    else if (t == "Traceback (most recent call last):")
      drop[k] = nextDropped && nextDroppedFrame;
    else
      drop[k] = known(tail[e.begin], t);
    nextDropped = drop[k];
    nextDroppedFrame = drop[k] && e.frame;
  }
  std::vector<std::string> out;
  for (size_t k = 0; k < entries.size(); ++k)
    if (!drop[k]) out.insert(out.end(), tail.begin() + static_cast<long>(entries[k].begin), tail.begin() + static_cast<long>(entries[k].end));
  return out;
}

}  // namespace

std::string formatFailure(const RunResult& result, const spec::JobSpec& spec) {
  if (result.first_failure < 0) {
    if (result.failure_message.empty()) return {};
    if (result.received_signal && !result.stopped_during.empty())  // (a node lost: no worker failed)
      return fmt::format("dtrain: job '{}' stopped by {} during {}, after {}; exit code {}\n", spec.name,
                         signalName(result.received_signal), result.stopped_during, result.failure_message,
                         result.exit_code);
    return fmt::format("dtrain: job '{}' failed: {}\n", spec.name, result.failure_message);
  }
  const auto& f = result.workers[result.first_failure];
  int failed = 0, stopped = 0;
  for (const auto& w : result.workers) {
    if (w.stopped_by_dtrain)
      ++stopped;
    else if (w.signal || w.exit_code) ++failed;
  }
  // The headline (the summary's `error`) carries the worker's own one-line reason, as the
  // restart events do: a script reading the summary learns why, not only that.
  const std::string why = f.hung ? "hung (no heartbeat within worker_timeout_s) and was killed" : exitReason(f);
  std::string out = fmt::format("dtrain: job '{}' failed: rank {} {}", spec.name, f.global_rank, why);
  if (stopped) out += fmt::format("; {} other worker(s) ended during teardown", stopped);
  // In the headline (the summary's error): a script must not have to compare restarts with
  // max_restarts to tell that the job gave up. (A lost node's message says it itself.)
  if (result.budget_exhausted)
    out += fmt::format("; restart budget exhausted: {} restart(s) of {} used", result.restarts, spec.max_restarts);
  if (result.received_signal && !result.stopped_during.empty())  // (the exit code last: it ends the headline)
    out = fmt::format("dtrain: job '{}' stopped by {} during {}, after rank {} {}{}; exit code {}", spec.name,
                      signalName(result.received_signal), result.stopped_during, f.global_rank, why,
                      stopped ? fmt::format("; {} other worker(s) ended during teardown", stopped) : std::string(),
                      result.exit_code);
  out += "\n";
  out += "  first failure:\n";
  out += fmt::format("    rank:       {} (local rank {})\n", f.global_rank, f.local_rank);
  out += fmt::format("    host:       {}\n", f.host);
  out += fmt::format("    pid:        {}\n", f.pid);
  if (!result.failure_message.empty() && !result.budget_exhausted) out += fmt::format("    cause:      {}\n", result.failure_message);
  out += fmt::format("    exit:       {}\n", f.signal ? signalName(f.signal) : fmt::format("code {}", f.exit_code));
  out += fmt::format("    time:       {}\n", f.when);
  // A message of several lines keeps its lines under the first, indented as the block.
  bool firstLine = true;
  for (const auto& l : split(f.error_message, '\n')) {
    if (trim(l).empty()) continue;
    out += (firstLine ? "    error:      " : "                ") + visible(l) + "\n";
    firstLine = false;
  }
  if (!f.error_traceback.empty()) {
    out += "    traceback:\n";
    for (const auto& l : split(f.error_traceback, '\n'))
      if (!l.empty()) out += "      " + visible(l) + "\n";
  }
  // The tail without what the traceback above already says: said once, not twice.
  const std::vector<std::string> tail = tailLessTraceback(f);
  if (!tail.empty()) {
    out += result.merged_output ? "    last output lines" : "    last stderr lines";
    out += tail.size() == f.stderr_tail.size() ? ":\n"
           : f.error_traceback.empty()        ? " (less the error above):\n"
                                              : " (less the traceback's):\n";
    for (const auto& l : tail) out += "      | " + l + "\n";
  }
  // A PyTorch job whose rank 0 had already ended well: rank 0 served torch's default store
  // (TORCHELASTIC_USE_AGENT_STORE=False), so a rank still using it lost it. The error says
  // only "Broken pipe": the cause, and the fix, are said here.
  if (!spec.trainer && f.global_rank != 0 && !f.lost) {
    const auto zero = std::find_if(result.workers.begin(), result.workers.end(),
                                   [](const WorkerExit& w) { return w.global_rank == 0; });
    auto lostConnection = [](const std::string& text) {
      for (const char* k : {"Broken pipe", "Connection reset", "Connection closed", "Connection refused", "TCPStore"})
        if (text.find(k) != std::string::npos) return true;
      return false;
    };
    // (and only from torch: a script's own lost connection, an HTTP request refused, is not.
    // torch's store raises RuntimeError ("RuntimeError: Broken pipe", nothing else when the
    // script held the store object); Python's own socket errors are OSErrors, "[Errno N]")
    auto torchSaid = [&](const std::string& text) {
      for (const char* k : {"torch", "TCPStore", "c10d", "ProcessGroup"})
        if (text.find(k) != std::string::npos) return true;
      return text.find("RuntimeError: ") != std::string::npos && lostConnection(text);
    };
    bool said = lostConnection(f.error_message), torch = torchSaid(f.error_message) || torchSaid(f.error_traceback);
    for (const auto& l : f.stderr_tail) {
      said = said || lostConnection(l);
      torch = torch || torchSaid(l);
    }
    said = said && torch;
    if (zero != result.workers.end() && said && !zero->signal && zero->exit_code == 0 && !zero->stopped_by_dtrain &&
        !zero->lost && !zero->when.empty() && zero->when <= f.when)
      out += fmt::format(
          "    hint:       rank 0 had exited 0 before ({}): torch's default store is rank 0's "
          "(TORCHELASTIC_USE_AGENT_STORE=False), so a rank still using it loses it; end the ranks together "
          "(dist.barrier(), then dist.destroy_process_group())\n",
          zero->when);
  }
  // A module missing for the interpreter that ran: `python3` found on the workers' PATH is
  // not always the one with torch (a pyenv or venv shim first on PATH), while torchrun runs its
  // own. Said with the path it was, and the fix.
  if (!spec.trainer && spec.nodes.empty() && !spec.command.empty() &&
      spec.command[0].rfind("python", 0) == 0 && spec.command[0].find('/') == std::string::npos) {
    std::string module;
    auto look = [&](const std::string& text) {
      const size_t at = text.find("ModuleNotFoundError: No module named '");
      if (at == std::string::npos || !module.empty()) return;
      const size_t from = at + std::strlen("ModuleNotFoundError: No module named '");
      const size_t to = text.find('\'', from);
      // (a package's own submodule missing is the package's matter, not the interpreter's)
      if (to != std::string::npos && text.substr(from, to - from).find('.') == std::string::npos)
        module = text.substr(from, to - from);
    };
    look(f.error_message);
    for (const auto& l : f.stderr_tail) look(l);
    if (!module.empty())
      if (const std::string found = findWorkerProgram(spec.command[0], spec.env, spec.cwd); !found.empty())
        out += fmt::format(
            "    hint:       {} on the workers' PATH is {}, which has no module '{}'; if another interpreter "
            "has it, give its path (e.g. dtrain run -- /usr/bin/python3 ...), or install it there\n",
            spec.command[0], visible(found), visible(module));
  }
  // The others' exits, and where their output is: a log directory is not always there.
  if (failed > 1) {
    constexpr int kListed = 8;
    std::vector<std::string> each;
    for (const auto& w : result.workers) {
      if (w.stopped_by_dtrain || !(w.signal || w.exit_code)) continue;
      if (static_cast<int>(each.size()) == kListed) {
        each.push_back("...");
        break;
      }
      each.push_back(fmt::format("{} ({}{})", w.global_rank, w.signal ? signalName(w.signal) : fmt::format("code {}", w.exit_code),
                                 w.after_stop > 0 && w.after_stop < 64
                                     ? fmt::format(", during the teardown, after its {}", signalName(w.after_stop))
                                     : std::string()));
    }
    out += fmt::format("  {} workers failed in all: ranks {}; {}\n", failed, fmt::join(each, ", "),
                       spec.log_dir.empty()
                           ? std::string("use --log-dir DIR to keep every rank's output in DIR/rank_N.log")
                           : fmt::format("every rank's output is in {}/rank_N.log{}", spec.log_dir,
                                         spec.nodes.empty() ? "" : " on its host"));
  }
  return out;
}

}  // namespace dtrain::launch
