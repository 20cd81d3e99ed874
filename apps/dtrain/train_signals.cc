#include "train_signals.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include "dtrain/common/errors.h"
#include "dtrain/common/strings.h"
#include "dtrain/launch/output.h"

namespace dtrain::app {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

constexpr int kSignals[] = {SIGUSR1, SIGUSR2, SIGTERM, SIGINT, SIGHUP, SIGQUIT};
// A stop's agreement: this long on top of twice the time between two agreements.
constexpr milliseconds kAgreeSlack{2000};
// After train() returned or threw (a stop under way): what is left is the exit itself.
constexpr milliseconds kDoneBound{5000};

train::TrainControl* gControl = nullptr;
int gWake[2] = {-1, -1};
std::atomic<long long> gGraceMs{30000};

extern "C" void onTrainSignal(int sig) {
  const int saved = errno;
  if (sig == SIGUSR1 || sig == SIGUSR2) {
    gControl->requestCheckpoint(sig);
  } else {
    int first = 0;
    // Ctrl-C twice (dtrain train run by hand on a terminal): now. (Under dtrain run a second
    // Ctrl-C makes the launcher SIGKILL its workers; it never sends SIGINT twice.)
    if (!gControl->stop.compare_exchange_strong(first, sig) && sig == SIGINT && first == SIGINT) ::_exit(128 + SIGINT);
  }
  const char b = static_cast<char>(sig);
  (void)!::write(gWake[1], &b, 1);
  errno = saved;
}

[[noreturn]] void quit(int sig, const std::string& why) {
  if (!why.empty())
    launch::writeAll(STDERR_FILENO,
                     fmt::format("dtrain train: {}: {}; exiting with {}\n", signalName(sig), why, 128 + sig));
  ::_exit(128 + sig);
}

void watch() {
  sigset_t set;
  sigemptyset(&set);
  for (int s : kSignals) sigaddset(&set, s);
  ::pthread_sigmask(SIG_UNBLOCK, &set, nullptr);  // this thread takes them
  train::TrainControl& c = *gControl;
  std::optional<Clock::time_point> t0;
  Clock::time_point phaseSince = Clock::now();
  int lastPhase = -1;
  for (;;) {
    pollfd p{gWake[0], POLLIN, 0};
    const int r = ::poll(&p, 1, t0 ? 20 : -1);
    if (r > 0) {
      char buf[64];
      while (::read(gWake[0], buf, sizeof(buf)) > 0) {
      }
    }
    const int sig = c.stop.load();
    if (sig == 0) continue;
    const auto now = Clock::now();
    if (!t0) t0 = now;
    const int phase = c.phase.load();
    if (phase != lastPhase) {
      lastPhase = phase;
      phaseSince = now;
    }
    const auto grace = milliseconds(gGraceMs.load());
    // Before the launcher's SIGKILL, so that the worker says why (a final checkpoint must fit
    // in the grace period): 1 s before it, or half of a grace of 2 s or less. (It was at least
    // 2 s after the signal: a grace of 3 s or less met the SIGKILL first, and nothing was said.)
    const auto hard = *t0 + std::max<milliseconds>(grace - milliseconds(1000), grace / 2);
    const bool late = now >= hard;
    switch (phase) {
      case train::TrainControl::kSetup:  // no step boundary is coming soon; nothing trained to save
        quit(sig, "");
      case train::TrainControl::kFinishing: {  // the last checkpoint is durable: the evaluation is given up
        {
          std::lock_guard<std::mutex> lk(c.finishing_mu);
          if (c.on_stop_while_finishing) c.on_stop_while_finishing();
        }
        quit(sig, "");
      }
      case train::TrainControl::kTraining: {
        const auto between = milliseconds(c.boundary_ms.load());
        const auto bound = std::max(*t0, phaseSince) + kAgreeSlack + 2 * between;
        if (now < bound && !late) break;
        // (a write in progress finishes first: a checkpoint is never cut short by this bound)
        if (c.writes.load() > 0 && !late) break;
        if (late)
          quit(sig, fmt::format("no final checkpoint: shutdown_timeout_s ({:.3g} s) left no time to agree on one "
                                "and write it{}; the newest complete checkpoint before it is kept",
                                grace.count() / 1000.0,
                                c.writes.load() > 0 ? " (a periodic checkpoint was still being written)" : ""));
        quit(sig, fmt::format("the ranks did not agree on a final checkpoint within {:.1f} s (a peer that does not "
                              "answer: stopped, hung or gone); no final checkpoint",
                              std::chrono::duration<double>(now - *t0).count()));
      }
      case train::TrainControl::kSaving:
        if (late)
          quit(sig,
               fmt::format("the final checkpoint was not written within {:.1f} s (shutdown_timeout_s {:.3g} s, less "
                           "a margin); the newest complete checkpoint before it is kept",
                           std::chrono::duration<double>(now - *t0).count(), grace.count() / 1000.0));
        break;
      default:  // kDone: train() returned or threw; the process is exiting
        if (now >= std::min(hard, std::max(*t0, phaseSince) + kDoneBound)) quit(sig, "");
        break;
    }
  }
}

}  // namespace

TrainSignals::TrainSignals(train::TrainControl& control) : control_(control) {
  DTRAIN_CHECK(gControl == nullptr);
  gControl = &control;
  if (::pipe2(gWake, O_CLOEXEC | O_NONBLOCK) != 0) throwErrno("dtrain train: pipe");
  struct sigaction sa {};
  sa.sa_handler = onTrainSignal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  sigset_t set;
  sigemptyset(&set);
  for (int s : kSignals) {
    ::sigaction(s, &sa, nullptr);
    sigaddset(&set, s);
  }
  // Blocked here and in every thread started from now on; the watcher unblocks them.
  ::pthread_sigmask(SIG_BLOCK, &set, nullptr);
  std::thread(watch).detach();
}

void TrainSignals::setGraceSeconds(double s) { gGraceMs.store(static_cast<long long>(std::max(0.0, s) * 1000)); }

int TrainSignals::waitForStop(std::chrono::milliseconds max) const {
  const auto until = Clock::now() + max;
  int sig = 0;
  while ((sig = control_.stop.load()) == 0 && Clock::now() < until) std::this_thread::sleep_for(milliseconds(5));
  return sig;
}

}  // namespace dtrain::app
