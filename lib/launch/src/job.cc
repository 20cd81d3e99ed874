#include "dtrain/launch/job.h"

#include <poll.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <csignal>
#include <ctime>
#include <memory>
#include <thread>

#include <fmt/format.h>

#include "dtrain/common/errors.h"
#include "dtrain/common/strings.h"
#include "dtrain/launch/output.h"
#include "signal_scope.h"
#include "dtrain/store/tcp_store.h"
#include "dtrain/store/token.h"

namespace dtrain::launch {

double restartBackoffS(double base_s, int doublings, double cap_s) {
  if (!(base_s > 0)) return 0;
  return std::min(cap_s, base_s * std::pow(2.0, std::clamp(doublings, 0, 64)));
}

JobStore::JobStore() = default;
JobStore::JobStore(JobStore&&) noexcept = default;
JobStore& JobStore::operator=(JobStore&&) noexcept = default;
JobStore::~JobStore() = default;

JobStore startJobStore(spec::JobSpec& spec, const std::string& bind) {
  store::TcpStoreServerOptions so;
  so.bind = bind;
  so.port = spec.rendezvous.port;
  so.token = store::newToken();
  JobStore js;
  try {
    js.server = std::make_unique<store::TcpStoreServer>(so);
  } catch (const IoError& e) {
    if (so.port == 0) throw;
    throw SpecError(fmt::format("{}: /rendezvous/port: {}; choose a free port, or 0 for any",
                                spec.source.empty() ? "job" : spec.source, e.what()));
  }
  js.server->start();
  spec.rendezvous.port = js.server->port();
  js.bind = bind;
  js.token = so.token;
  return js;
}

namespace {

// dtrain got stop signal `sig` just after workers died of one from outside: one stop of the
// whole job, not a failure. Those workers count as stopped (stopped_by_dtrain), the failure,
// if one is left, is the first worker that failed otherwise, and the job ends by the signal.
void treatAsOneStop(RunResult& r, int sig) {
  std::vector<std::string> ranks;
  for (auto& w : r.workers)
    if (outsideStopSignal(w)) {
      w.stopped_by_dtrain = true;
      ranks.push_back(fmt::format("{} ({})", w.global_rank, w.signal ? signalName(w.signal) : fmt::format("code {}", w.exit_code)));
    }
  r.first_failure = -1;
  for (size_t i = 0; i < r.workers.size(); ++i) {
    const auto& w = r.workers[i];
    if ((w.signal || w.exit_code) && !w.stopped_by_dtrain && !w.lost) {
      r.first_failure = static_cast<int>(i);
      break;
    }
  }
  if (r.first_failure >= 0) r.first_failure = rootCause(r.workers, r.first_failure);
  r.received_signal = sig;
  r.exit_code = 128 + sig;
  r.teardown_signal = 0;
  r.stopped_during.clear();
  console().write(STDERR_FILENO,
                  fmt::format("dtrain: rank(s) {} had ended by a stop signal from outside dtrain just before dtrain "
                              "got {}: one stop of the whole job (a scheduler's), not a failure; no restart\n",
                              fmt::join(ranks, ", "), signalName(sig)));
}

// Waits up to `d` on `signals` (the job's scope) for a stop signal; SIGUSR1/SIGUSR2 are said
// and dropped, as no worker runs to take them. The signal, or 0 when none came.
int waitForSignal(detail::SignalScope& signals, std::chrono::steady_clock::duration d, const char* during) {
  const auto until = std::chrono::steady_clock::now() + d;
  int got = 0;
  while (got == 0) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - std::chrono::steady_clock::now()).count();
    if (left <= 0) return 0;
    pollfd p{signals.fd(), POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(left)) <= 0) continue;
    signals.drain([&](int sig) { if (got == 0) got = sig; },
                  [&](int sig) {
                    console().write(STDERR_FILENO, fmt::format("dtrain: {}: no worker runs during {}; not passed on\n",
                                                               signalName(sig), during));
                  });
  }
  return got;
}

}  // namespace

namespace {

// HeldStopSignals' two rules, kept by signal handlers: async-signal-safe calls only, state in
// sig_atomic_t. One HeldStopSignals at a time (dtrain run's, on main()'s thread).
volatile sig_atomic_t gEscalationArmed = 0;  // between HeldStopSignals() and endPreflight()/release()
volatile sig_atomic_t gFirstHeldStop = 0;    // the first stop signal held, 0 before one came
// Who sent the first one and when (written by the handlers only, which mask each other).
volatile sig_atomic_t gFirstCode = 0;
volatile pid_t gFirstPid = 0;
volatile long long gFirstAtMs = 0;
// A SIGHUP that arrives this soon after the first is its echo, not a second request: a closed
// terminal's comes from the kernel and then from the shell (other signals' echoes:
// detail::repeatsSignal).
constexpr long long kEchoMs = 100;
struct sigaction gOldAlarm {};
bool gAlarmInstalled = false;  // (not touched by handlers)

constexpr int kStopSignals[] = {SIGINT, SIGTERM, SIGHUP, SIGQUIT};

const char* stopName(int sig) {
  return sig == SIGINT    ? "SIGINT"
         : sig == SIGTERM ? "SIGTERM"
         : sig == SIGHUP  ? "SIGHUP"
         : sig == SIGQUIT ? "SIGQUIT"
                          : "a signal";
}

// Appends C strings to a fixed buffer (no allocation: called in a signal handler).
struct LineBuffer {
  char text[256];
  size_t n = 0;
  LineBuffer& operator<<(const char* s) {
    while (*s && n < sizeof(text)) text[n++] = *s++;
    return *this;
  }
  LineBuffer& operator<<(unsigned v) {
    char digits[12];
    size_t k = 0;
    do digits[k++] = static_cast<char>('0' + v % 10); while ((v /= 10) != 0 && k < sizeof(digits));
    while (k > 0 && n < sizeof(text)) text[n++] = digits[--k];
    return *this;
  }
};

// Ends dtrain by `sig`'s default action, as if it had never been caught: a stop signal whose
// handler is still HeldStopSignals' gets its default action back and is unblocked (so a
// further one, or one pending, ends dtrain at once even if the line below blocked), the line
// goes to stderr only when it can take it now, and `sig` is raised. SIGHUP ignored from the
// start (nohup) stays ignored: its handler was never ours.
void endByDefault(int sig, const LineBuffer& line, void (*ours)(int, siginfo_t*, void*)) {
  gEscalationArmed = 0;
  ::alarm(0);
  sigset_t stops;
  sigemptyset(&stops);
  for (int s : kStopSignals) {
    struct sigaction cur {};
    if (::sigaction(s, nullptr, &cur) != 0 || !(cur.sa_flags & SA_SIGINFO) || cur.sa_sigaction != ours) continue;
    struct sigaction dfl {};
    dfl.sa_handler = SIG_DFL;
    sigemptyset(&dfl.sa_mask);
    ::sigaction(s, &dfl, nullptr);
    sigaddset(&stops, s);
  }
  ::sigprocmask(SIG_UNBLOCK, &stops, nullptr);
  pollfd p{STDERR_FILENO, POLLOUT, 0};
  if (::poll(&p, 1, 0) == 1 && (p.revents & POLLOUT)) (void)!::write(STDERR_FILENO, line.text, line.n);
  struct sigaction dfl {};
  dfl.sa_handler = SIG_DFL;
  sigemptyset(&dfl.sa_mask);
  ::sigaction(sig, &dfl, nullptr);
  ::raise(sig);
}

using detail::monotonicMs;

// The same signal as the first, and either a SIGHUP within kEchoMs (a closed terminal's, from
// the kernel and then from the shell) or a repeat of it (detail::repeatsSignal: timeout(1)'s
// second copy, a wrapper passing on the terminal's Ctrl-C): one request delivered twice.
bool isEcho(int sig, const siginfo_t* info, long long nowMs) {
  if (sig != gFirstHeldStop) return false;
  if (sig == SIGHUP && nowMs - gFirstAtMs < kEchoMs) return true;
  return detail::repeatsSignal(info, gFirstCode, gFirstPid, nowMs - gFirstAtMs);
}

void onHeldStop(int sig, siginfo_t* info, void*) {
  detail::onSignal(sig);  // held, for the next step's stopSignal()
  if (!gEscalationArmed) return;
  const long long now = monotonicMs();
  if (gFirstHeldStop == 0) {
    gFirstHeldStop = sig;
    gFirstCode = info ? info->si_code : 0;
    gFirstPid = info ? info->si_pid : 0;
    gFirstAtMs = now;
    ::alarm(HeldStopSignals::kHeldStopGraceS);  // (the other stop signals and SIGALRM are masked here)
    return;
  }
  if (isEcho(sig, info, now)) return;
  LineBuffer line;
  line << "dtrain: " << stopName(sig) << " again while the job was being checked (the step in progress has not "
       << "finished): ending now by " << stopName(sig) << "; no summary written\n";
  endByDefault(sig, line, onHeldStop);
}

void onHeldAlarm(int) {
  const int sig = gFirstHeldStop;
  if (!gEscalationArmed || sig == 0) return;
  LineBuffer line;
  line << "dtrain: " << stopName(sig) << " " << HeldStopSignals::kHeldStopGraceS
       << " s ago while the job was being checked, and the step in progress has not finished: ending now by "
       << stopName(sig) << "; no summary written\n";
  endByDefault(sig, line, onHeldStop);
}

void disarm() {
  gEscalationArmed = 0;
  if (!gAlarmInstalled) return;
  ::alarm(0);
  ::sigaction(SIGALRM, &gOldAlarm, nullptr);
  gAlarmInstalled = false;
  gFirstHeldStop = 0;
}

}  // namespace

HeldStopSignals::HeldStopSignals() : scope_(std::make_unique<detail::SignalScope>()) {
  // Over the scope's handler: the same, plus the two rules. Each stop signal and SIGALRM
  // masked while either handler runs, so that two signals at once cannot both be "the first".
  struct sigaction sa {};
  sigemptyset(&sa.sa_mask);
  for (int s : kStopSignals) sigaddset(&sa.sa_mask, s);
  sigaddset(&sa.sa_mask, SIGALRM);
  sa.sa_flags = SA_RESTART;  // (a step goes on after a first signal: it is the step's to end)
  sa.sa_handler = onHeldAlarm;
  ::sigaction(SIGALRM, &sa, &gOldAlarm);
  gAlarmInstalled = true;
  gFirstHeldStop = 0;
  gEscalationArmed = 1;
  sa.sa_sigaction = onHeldStop;
  sa.sa_flags = SA_RESTART | SA_SIGINFO;  // (the sender: an echo of the first is not a second)
  for (int s : kStopSignals) {
    struct sigaction cur {};
    ::sigaction(s, nullptr, &cur);
    if ((cur.sa_flags & SA_SIGINFO) && cur.sa_sigaction == detail::onSignalInfo)
      ::sigaction(s, &sa, nullptr);  // (not SIGHUP left ignored: nohup)
  }
}

HeldStopSignals::~HeldStopSignals() { release(); }

void HeldStopSignals::drain(bool sayPassedOn) {
  if (!scope_) return;
  scope_->drain([&](int sig) { held_.push_back(sig); },
                [&](int sig) {
                  if (sayPassedOn)
                    writeAll(STDERR_FILENO,
                             fmt::format("dtrain: {}: no worker runs yet (the job is being checked); not passed on\n",
                                         signalName(sig)));
                });
}

int HeldStopSignals::stopSignal() {
  drain(true);
  if (held_.empty()) return 0;
  reported_ = std::max<size_t>(reported_, 1);
  return held_.front();
}

void HeldStopSignals::endPreflight() {
  disarm();
  launched_ = true;
}

void HeldStopSignals::release() {
  disarm();
  scope_.reset();
}

RunResult runLocalJob(spec::JobSpec& spec, const std::string& run_id, const LocalJobOptions& options) {
  // Over the whole job (first, so that it ends last, after the store's shutdown): a signal
  // between one attempt's end and the next scope (the check for a stop of the whole job, the
  // back-off, the next attempt) is kept for that scope, instead of ending dtrain by its
  // default action without a verdict or a summary.
  detail::SignalScope held;
  JobStore js = startJobStore(spec, "127.0.0.1");  // every worker is local
  Plan plan = makeLocalPlan(spec, run_id);
  plan.store_addr = js.bind;
  plan.store_port = spec.rendezvous.port;
  plan.store_token = js.token;
  std::vector<spec::JobEvent> events;
  std::string ompSaid;  // (said again by an attempt whose default changed)
  std::vector<std::pair<std::string, int>> fds = options.inherit_fds;
  for (int attempt = 0;; ++attempt) {
    if (attempt > 0 && options.refresh_fds) fds = options.refresh_fds(attempt);
    LocalRunOptions lo;
    lo.omp_said = &ompSaid;
    lo.restart_count = attempt;
    lo.remove_if_killed = options.remove_if_killed;
    lo.inherit_fds = fds;
    plan.round = attempt;
    RunResult r = makeLocalLauncher(lo)->run(plan, spec);
    // A worker that died of a stop signal from outside, with dtrain's own signal within
    // kOutsideStopWindow of that death (read by the launcher, or coming now): the job was
    // stopped, not failed. A signal later in a long teardown is one after a failure.
    if (r.first_failure >= 0 && outsideStopSignal(r.workers[static_cast<size_t>(r.first_failure)])) {
      int sig = r.outside_stop ? r.received_signal : 0;
      const auto left = kOutsideStopWindow - (std::chrono::steady_clock::now() - r.first_failure_at);
      if (!r.received_signal && left > left.zero()) sig = waitForSignal(held, left, "the check for a stop of the whole job");
      if (sig) treatAsOneStop(r, sig);
    }
    // A worker failed and then a signal came, during the teardown: the job ends by the signal,
    // cutting short the restart that failure would have started (said in one headline, as in
    // the back-off; nothing announced it, so it spends nothing).
    if (r.received_signal && r.first_failure >= 0) {
      const auto& f = r.workers[static_cast<size_t>(r.first_failure)];
      // ... unless no restart was coming (none left, or none could help): then the job had
      // already failed, and the signal only cut its teardown short. It ends as that failure
      // (its exit code, its headline), and says what the signal did.
      if (attempt >= spec.max_restarts || restartCannotHelp(f)) {
        r.teardown_signal = r.received_signal;
        r.received_signal = 0;
        r.exit_code = f.signal ? 128 + f.signal : f.exit_code;
      }
    }
    if (r.received_signal && r.first_failure >= 0) {
      const auto& f = r.workers[static_cast<size_t>(r.first_failure)];
      if (f.hung) {
        events.push_back({detail::utcNow(), attempt, "worker_hung", f.error_message, f.host, f.global_rank});
        console().write(STDERR_FILENO, spec::formatEvent(events.back()) + "\n");
      }
      if (attempt < spec.max_restarts && !restartCannotHelp(f))
        r.stopped_during = fmt::format("the teardown before restart {} of {}", attempt + 1, spec.max_restarts);
    }
    bool failed = r.first_failure >= 0 && !r.received_signal;
    bool refused = false;  // a restart the caller's refuse_restart stopped
    if (failed) {
      const auto& f = r.workers[static_cast<size_t>(r.first_failure)];
      std::string what = exitReason(f);
      if (f.hung) {
        events.push_back({detail::utcNow(), attempt, "worker_hung", f.error_message, f.host, f.global_rank});
        console().write(STDERR_FILENO, spec::formatEvent(events.back()) + "\n");
      }
      const std::string refusal =
          !restartCannotHelp(f) && attempt < spec.max_restarts && options.refuse_restart ? options.refuse_restart() : "";
      if (restartCannotHelp(f)) {
        // Every attempt would fail the same way, so the budget is not spent on it.
        r.failure_message = notRestartedReason(f, spec);
      } else if (!refusal.empty()) {
        r.failure_message = refusal;
        refused = true;
      } else if (attempt < spec.max_restarts) {
        events.push_back({detail::utcNow(), attempt + 1, "restart",
                          fmt::format("rank {} {}; restart {} of {}", f.global_rank, what, attempt + 1, spec.max_restarts),
                          f.host, f.global_rank});
        console().write(STDERR_FILENO, spec::formatEvent(events.back()) + "\n");
      } else if (spec.max_restarts > 0) {
        r.failure_message = fmt::format("restart budget exhausted: {} restart(s) of {} used", attempt, spec.max_restarts);
        r.budget_exhausted = true;
      }
    }
    r.restarts = attempt;
    r.events = events;
    if (!failed || refused || attempt >= spec.max_restarts ||
        restartCannotHelp(r.workers[static_cast<size_t>(r.first_failure)])) {
      // A stop signal held since the last attempt ended changes nothing: said, not dropped.
      held.drain([&](int sig) {
        console().write(STDERR_FILENO,
                        fmt::format("dtrain: {} after the job had ended; the outcome stands\n", signalName(sig)));
      });
      return r;
    }
    // Back off (1 s, 2 s, 4 s, ... at most 60 s) and start the next attempt on a fresh
    // MASTER_PORT: the old one may still be held by the previous attempt's sockets.
    const double pause = restartBackoffS(spec.restart_backoff_s, attempt, 60.0);
    // A signal during the pause ends the job as it would have during the run.
    const std::string backoff = fmt::format("the back-off before restart {} of {}", attempt + 1, spec.max_restarts);
    if (int sig = waitForSignal(held, std::chrono::milliseconds(static_cast<long>(pause * 1000)), backoff.c_str())) {
      r.received_signal = sig;
      r.exit_code = 128 + sig;
      r.restarts = attempt + 1;  // announced by the restart event: it spent the budget
      r.stopped_during = backoff;
      return r;
    }
    plan.master_port = pickFreePort(spec.rendezvous.port);
  }
}

}  // namespace dtrain::launch
