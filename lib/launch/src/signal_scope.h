#pragma once
// Private to lib/launch: the launchers' signal handling and timestamps.
#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <ctime>
#include <iterator>
#include <string>
#include <utility>

#include <fmt/format.h>

#include "dtrain/common/time.h"
#include "dtrain/common/errors.h"

namespace dtrain::launch::detail {

// Self-pipe: signal handlers write the signal number; the event loop polls the read end.
inline int gSignalPipe[2] = {-1, -1};

inline void onSignal(int sig) {
  int saved = errno;
  unsigned char b = static_cast<unsigned char>(sig);
  ssize_t ignored = ::write(gSignalPipe[1], &b, 1);
  (void)ignored;
  errno = saved;
}

// Milliseconds on the monotonic clock (async-signal-safe).
inline long long monotonicMs() {
  timespec t{};
  ::clock_gettime(CLOCK_MONOTONIC, &t);
  return static_cast<long long>(t.tv_sec) * 1000 + t.tv_nsec / 1000000;
}

// Whether a signal (`info`) that comes `sinceMs` after the same one (sent as `firstCode` by
// `firstPid`) repeats it rather than asking again: within 0.1 s, sent by kill() from the very
// process that sent that one (timeout(1) signals dtrain and then its own process group,
// dtrain again); or, within 1 s, sent by kill() from dtrain's parent where that one came from
// elsewhere: a wrapper (timeout(1), a script's trap) passing on the terminal's Ctrl-C that
// reached dtrain too. A second Ctrl-C on the terminal (SI_KERNEL) always counts, as does a
// kill from elsewhere. Async-signal-safe.
inline bool repeatsSignal(const siginfo_t* info, int firstCode, pid_t firstPid, long long sinceMs) {
  if (info == nullptr || info->si_code != SI_USER || sinceMs < 0) return false;
  const bool sameSender = firstCode == SI_USER && info->si_pid == firstPid;
  return sameSender ? sinceMs < 100 : sinceMs < 1000 && info->si_pid == ::getppid();
}

// The run's SIGINT, where a second one means "kill the workers now": an echo (repeatsSignal)
// of the last one that counted is dropped. The state is the handler's alone.
inline struct {
  long long at_ms = -1;
  int code = 0;
  pid_t pid = 0;
} gLastInterrupt;

inline bool interruptEcho(const siginfo_t* info) {
  const long long now = monotonicMs();
  const bool echo = gLastInterrupt.at_ms >= 0 &&
                    repeatsSignal(info, gLastInterrupt.code, gLastInterrupt.pid, now - gLastInterrupt.at_ms);
  if (!echo) gLastInterrupt = {now, info ? info->si_code : 0, info ? info->si_pid : 0};
  return echo;
}

inline void onSignalInfo(int sig, siginfo_t* info, void*) {
  if (sig == SIGINT && interruptEcho(info)) return;
  onSignal(sig);
}

// The line a user sees when a signal starts the teardown (stderr of the console owner): what
// happens next, when, and how to cut the grace period short.
inline std::string shutdownNotice(const std::string& signal, size_t workers, const char* what, const std::string& sent,
                                  double graceS, bool interrupt) {
  return fmt::format("dtrain: {}: stopping {} {}{} ({} to the workers now, SIGKILL after {:g} s){}\n", signal, workers,
                     what, workers == 1 ? "" : "s", sent, graceS, interrupt ? "; Ctrl-C again to kill now" : "");
}

// Signals passed on to the workers instead of stopping the job, as mpirun does: a batch
// system's warning before its time limit (Slurm's --signal=USR1@120, `scancel -s USR1`) is
// for the training script, which checkpoints on it.
inline bool passedOn(int sig) { return sig == SIGUSR1 || sig == SIGUSR2; }
inline void dropSignal(int) {}

// Installs the handlers for the lifetime of a run and restores the old ones after, except
// for passedOn() signals: those stay caught (and dropped) once a launch has begun, since
// their default action would end dtrain, and with it every worker, between two launches'
// scopes (a restart's back-off, a new round). Caught, not ignored: a worker gets SIG_DFL back
// (spawnProcess), while an ignored signal would be inherited.
// Scopes nest (one thread: the launcher's): an inner one shares the outer's pipe, so a
// signal that comes between two inner scopes (an attempt's end and the back-off) waits in
// the pipe for the next one, rather than taking its default action (runLocalJob holds an
// outer scope over all its attempts).
class SignalScope {
 public:
  // (SIGQUIT, Ctrl-\\, is a stop too, as under torchrun: passed on with its grace period,
  // where its default action ended dtrain at once and the guard SIGKILLed the workers)
  static constexpr int kSignals[] = {SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGCHLD, SIGUSR1, SIGUSR2};
  SignalScope() {
    if (depth()++ == 0 && ::pipe2(gSignalPipe, O_CLOEXEC | O_NONBLOCK) != 0) {
      --depth();
      throwErrno("pipe");
    }
    struct sigaction sa {};
    sa.sa_sigaction = onSignalInfo;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESTART | SA_NOCLDSTOP | SA_SIGINFO;
    for (size_t i = 0; i < std::size(kSignals); ++i) {
      ::sigaction(kSignals[i], nullptr, &old_[i]);
      // SIGHUP ignored when dtrain started stays ignored: that is what `nohup dtrain run`
      // asks for (the workers inherit it, as nohup's child would). Not SIGINT, which a
      // script's background jobs start with ignored: scripts stop a background dtrain with
      // kill -INT, and dtrain always ended on it.
      if (old_[i].sa_handler == SIG_IGN && kSignals[i] == SIGHUP) continue;
      ::sigaction(kSignals[i], &sa, nullptr);
    }
    struct sigaction ign {};
    ign.sa_handler = SIG_IGN;
    ::sigaction(SIGPIPE, &ign, &oldPipe_);
  }
  ~SignalScope() {
    for (size_t i = 0; i < std::size(kSignals); ++i) {
      if (passedOn(kSignals[i]) && old_[i].sa_handler == SIG_DFL) {
        struct sigaction drop {};
        drop.sa_handler = dropSignal;
        sigemptyset(&drop.sa_mask);
        drop.sa_flags = SA_RESTART;
        ::sigaction(kSignals[i], &drop, nullptr);
        continue;
      }
      ::sigaction(kSignals[i], &old_[i], nullptr);
    }
    ::sigaction(SIGPIPE, &oldPipe_, nullptr);
    if (--depth() > 0) return;  // the outer scope's handlers are back, and its pipe stays
    ::close(gSignalPipe[0]);
    ::close(gSignalPipe[1]);
    gSignalPipe[0] = gSignalPipe[1] = -1;
  }
  SignalScope(const SignalScope&) = delete;
  SignalScope& operator=(const SignalScope&) = delete;
  int fd() const { return gSignalPipe[0]; }
  // Reads every pending signal and calls onSignal(sig) for each that stops the job,
  // onPassOn(sig) for each passedOn() one; SIGCHLD only wakes the loop so that it reaps.
  template <typename F, typename G>
  void drain(F&& onSignal, G&& onPassOn) {
    unsigned char sigs[64];
    ssize_t got;
    while ((got = ::read(fd(), sigs, sizeof(sigs))) > 0)
      for (ssize_t i = 0; i < got; ++i) {
        const int sig = static_cast<int>(sigs[i]);
        // (only the handler writes here; anything else is not a signal of ours)
        if (sig == SIGCHLD || std::find(std::begin(kSignals), std::end(kSignals), sig) == std::end(kSignals)) continue;
        if (passedOn(sig))
          onPassOn(sig);
        else
          onSignal(sig);
      }
  }
  // Where no worker runs: passedOn() signals are dropped.
  template <typename F>
  void drain(F&& onSignal) {
    drain(std::forward<F>(onSignal), [](int) {});
  }

 private:
  static int& depth() {
    static int d = 0;
    return d;
  }
  struct sigaction old_[std::size(kSignals)] {};
  struct sigaction oldPipe_ {};
};

using dtrain::utcNow;

}  // namespace dtrain::launch::detail
