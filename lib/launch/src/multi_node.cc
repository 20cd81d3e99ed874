#include "dtrain/launch/multi_node.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <optional>

#include <fmt/format.h>

#include "dtrain/common/errors.h"
#include "dtrain/common/fd.h"
#include "dtrain/common/strings.h"
#include "dtrain/launch/agent_protocol.h"
#include "dtrain/launch/env.h"
#include "dtrain/launch/job.h"
#include "dtrain/launch/output.h"
#include "dtrain/launch/process.h"
#include "dtrain/rendezvous/rendezvous.h"
#include "dtrain/store/tcp_store.h"
#include "dtrain/store/token.h"
#include "signal_scope.h"

namespace dtrain::launch {
namespace {

using Clock = std::chrono::steady_clock;
using detail::SignalScope;

// A teardown after a failure still waiting this long says what it waits for (as on one node).
constexpr auto kTeardownNoticeAfter = std::chrono::seconds(2);
// An agent whose round ended with a code but no failed worker is lost after this unless it
// ends (an agent that lost the store does, at once) or moves on meanwhile.
constexpr auto kIdleWithoutFailureWait = std::chrono::seconds(5);
// An elastic job's agents wait this much longer for a round than rendezvous.timeout_s: at the
// timeout the launcher decides whether the round goes on without the nodes that did not join,
// and the joined ones must be waiting still (their own timeout would end the job).
constexpr double kJoinGraceS = 5;

// The entries of `v` (each with its time `at`) that have waited `wait` by `now`, taken out.
template <typename T>
std::vector<T> takeDue(std::vector<T>& v, Clock::duration wait, Clock::time_point now) {
  std::vector<T> due;
  for (size_t i = 0; i < v.size();)
    if (now - v[i].at >= wait) {
      due.push_back(v[i]);
      v.erase(v.begin() + static_cast<long>(i));
    } else {
      ++i;
    }
  return due;
}

std::string nodeName(const spec::JobSpec& spec, const spec::NodeSpec& n) {
  int same = 0;
  for (const auto& o : spec.nodes) same += o.host == n.host;
  return same > 1 ? fmt::format("{}:{}", n.host, n.port) : n.host;
}

std::string remoteDtrain(const spec::JobSpec& spec) {
  return spec.ssh.dtrain_path.empty() ? selfExecutable() : spec.ssh.dtrain_path;
}

std::vector<std::string> envStrings(const EnvMap& env) {
  std::vector<std::string> out;
  for (const auto& [k, v] : env) out.push_back(k + "=" + v);
  return out;
}

// The remote command line: ssh joins its arguments with spaces for the remote shell, so
// every word is quoted here.
std::string remoteCommand(const std::vector<std::string>& argv) {
  std::string out = "exec";
  for (const auto& a : argv) out += " " + shellQuote(a);
  return out;
}

struct Pipe {
  Fd fd;
  // An agent's records: a worker's line (up to LineSplitter::kMaxLine) escaped (a tab, a
  // newline or a backslash takes two bytes), with its header. At the workers' own maximum a
  // line cut by the agent made a record the launcher cut again, and the bytes past the cut
  // (the record's header's worth) were dropped as a malformed record.
  LineSplitter splitter{2 * LineSplitter::kMaxLine + 4096};
};

enum class NodeState {
  kStarting,  // agent spawned, not heard from yet
  kWaiting,   // a host coming back: connected, waiting to be admitted
  kJoining,   // told to join a round
  kRunning,   // its workers run in the current round
  kIdle,      // its workers of the round have ended; waiting for the launcher's word
  kLost,      // its agent is gone; retried after the cooldown
  kDone,      // told to exit
};

// One node: its agent process (ssh client or local child) and what it reported.
struct Node {
  const spec::NodeSpec* spec = nullptr;
  size_t index = 0;  // hostfile position
  std::string name;
  pid_t pid = -1;
  bool running = false;
  int status = 0;
  Fd in;
  Pipe out, err;
  TailBuffer errTail{20};
  NodeState state = NodeState::kStarting;
  bool member = false;  // part of the current (or next) round
  int round = -1;       // round it last reported starting
  int rankOffset = 0;   // its workers' global ranks in that round: rankOffset .. + localWorkers - 1
  int localWorkers = 0;
  int idleRc = 0;
  int failures = 0;     // times lost: the cooldown grows with it
  Clock::time_point retryAt{};
  std::string lostReason;  // set when we kill it (heartbeat silent)
  bool notJoined = false;  // killed for not joining a round in time (elastic): no restart spent
  bool stopping = false;   // paused while its workers ran: until it reports them ended ('D')
  Clock::time_point stoppingSince{};
  int toldRound = -1;      // the round it was told to join last (round 0 at its start)
  // Its heartbeat counter when its agent was spawned, and whether it has moved on since: a
  // starting agent is watched from its first beat (one frozen before it reports would
  // otherwise hold the job for good), not before (ssh and the agent's checks take their time).
  std::string beatAtSpawn;
  bool beating = false;
  bool reportedFailure = false;  // said why it fails the job ('F'): its end while the job stops is not a loss
  std::vector<WorkerExit> exits;  // of its workers in its latest round
};

bool connected(const Node& n) {
  return n.running && (n.state == NodeState::kWaiting || n.state == NodeState::kJoining ||
                       n.state == NodeState::kRunning || n.state == NodeState::kIdle);
}

// A member of round 0 whose agent runs and has said nothing yet: an agent says nothing before
// its round forms, so one that is in round 0's rendezvous (or on its way there) looks so. It
// takes the launcher's word as any (a round formed again without a node lost meanwhile).
bool startingMember(const Node& n) { return n.member && n.running && n.state == NodeState::kStarting; }

// Pre-flight: `ssh host DTRAIN --version` on every remote host at once.
struct Problem {
  const spec::NodeSpec* node;
  std::string text;
  bool unreachable;  // ssh could not get there (may come back); else the host is set up wrong
};

// `stoppedBy`: set to SIGINT/SIGTERM/SIGHUP when one ended the check early (no problems then).
std::vector<Problem> preflight(const spec::JobSpec& spec, const std::vector<const spec::NodeSpec*>& remotes,
                               const std::string& version, int& stoppedBy) {
  stoppedBy = 0;
  if (remotes.empty()) return {};
  // The run's own handlers are not installed yet, and a host that does not answer holds the
  // check up to connect_timeout_s + 5 s: Ctrl-C must end it now, not after that.
  SignalScope signals;
  std::string bin = remoteDtrain(spec);
  struct Check {
    const spec::NodeSpec* node;
    Spawned proc;
    std::string out, err;
    bool done = false;
    int status = 0;
  };
  std::vector<Check> checks;
  EnvMap env = currentEnvironment();
  for (const auto* n : remotes) {
    SpawnOptions so;
    so.argv = sshArgv(spec, *n);
    so.argv.push_back(remoteCommand({bin, "--version"}));
    so.env = envStrings(env);
    checks.push_back({n, spawnProcess(so), "", "", false, 0});
  }
  auto limit = std::chrono::duration<double>(spec.ssh.connect_timeout_s + 5);
  auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(limit);
  char buf[4096];
  while (!stoppedBy) {
    std::vector<pollfd> fds;
    std::vector<std::pair<Check*, bool>> owners;
    fds.push_back({signals.fd(), POLLIN, 0});
    owners.push_back({nullptr, false});
    for (auto& c : checks) {
      if (c.proc.out) fds.push_back({c.proc.out.get(), POLLIN, 0}), owners.push_back({&c, false});
      if (c.proc.err) fds.push_back({c.proc.err.get(), POLLIN, 0}), owners.push_back({&c, true});
    }
    if (fds.size() == 1) break;
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    if (left <= 0) break;
    int n = ::poll(fds.data(), fds.size(), static_cast<int>(left));
    if (n < 0 && errno != EINTR) throwErrno("poll");
    if (n > 0 && (fds[0].revents & POLLIN))
      signals.drain([&](int sig) {
        if (!stoppedBy) stoppedBy = sig;
      });
    for (size_t i = 1; n > 0 && !stoppedBy && i < fds.size(); ++i) {
      if (!(fds[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
      auto [c, isErr] = owners[i];
      Fd& fd = isErr ? c->proc.err : c->proc.out;
      ssize_t got = ::read(fd.get(), buf, sizeof(buf));
      if (got <= 0) {
        fd.reset();
        continue;
      }
      std::string& dst = isErr ? c->err : c->out;
      if (dst.size() < 65536) dst.append(buf, static_cast<size_t>(got));
    }
  }
  if (stoppedBy) {
    // Nothing has started anywhere yet: the ssh checks (and what they started: a
    // ProxyCommand) are all there is to stop.
    // (the hosts whose check has not answered yet: the others' are done, nothing to kill)
    std::vector<std::string> pending;
    for (const auto& c : checks)
      if (c.proc.out || c.proc.err) pending.push_back(c.node->host);
    console().write(STDERR_FILENO,
                    fmt::format("dtrain: {}: stopped during the pre-flight; killing the ssh check(s) of {} "
                                "host(s) not done yet ({}); no agent or worker was started\n",
                                signalName(stoppedBy), pending.size(), fmt::join(pending, ", ")));
    for (auto& c : checks) ::kill(-c.proc.pid, SIGKILL);
    for (auto& c : checks) ::waitpid(c.proc.pid, nullptr, 0);
    return {};
  }
  std::vector<Problem> problems;
  for (auto& c : checks) {
    int status = 0;
    bool exited = false;
    for (int i = 0; i < 50 && !exited; ++i) {
      exited = ::waitpid(c.proc.pid, &status, WNOHANG) == c.proc.pid;
      if (!exited && (c.proc.out || c.proc.err || Clock::now() >= deadline)) break;
      if (!exited) ::usleep(10000);
    }
    if (!exited) {
      ::kill(-c.proc.pid, SIGKILL);
      ::waitpid(c.proc.pid, &status, 0);
      problems.push_back({c.node, fmt::format("{} ({}): no answer within {:.3g} s", c.node->host, c.node->origin, limit.count()), true});
      continue;
    }
    std::string got = c.out.substr(0, c.out.find('\n'));
    std::string lastErr;
    // (trimmed: ssh ends its own messages in CRLF when it has a terminal, which showed as \x0d)
    for (const auto& l : split(c.err, '\n'))
      if (!trim(l).empty()) lastErr = trim(l);
    int code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    if (code == 255) {
      problems.push_back({c.node, fmt::format("{} ({}): ssh failed: {}", c.node->host, c.node->origin,
                                              lastErr.empty() ? "exit 255" : lastErr), true});
    } else if (code == 127 || code == 126) {
      problems.push_back({c.node, fmt::format("{} ({}): dtrain not runnable at {} (exit {}); install it there or set ssh.dtrain_path",
                                              c.node->host, c.node->origin, bin, code), false});
    } else if (code != 0) {
      // (nothing after the code when it printed nothing: a dangling ": " reads as a cut line)
      problems.push_back({c.node, fmt::format("{} ({}): '{} --version' exited {}{}", c.node->host, c.node->origin, bin, code,
                                              lastErr.empty() ? "" : ": " + lastErr),
                          false});
    } else if (got != version) {
      problems.push_back({c.node, fmt::format("{} ({}): version mismatch: \"{}\" there, \"{}\" here; install the same dtrain",
                                              c.node->host, c.node->origin, got, version), false});
    }
  }
  return problems;
}

class MultiNodeRunner {
 public:
  MultiNodeRunner(spec::JobSpec& spec, const MultiNodeOptions& opts, std::string runId, int storePort, std::string token)
      : spec_(spec), opts_(opts), runId_(std::move(runId)), storePort_(storePort), token_(std::move(token)) {}
  // `excluded`: hosts that failed pre-flight; they start lost, to be retried.
  RunResult run(const std::vector<const spec::NodeSpec*>& excluded);

 private:
  void spawnAgent(Node& n, bool wait);
  void onRecord(Node& n, std::string_view line);
  void emitWorkerLine(Node& n, bool isErr, int rank, int localRank, std::string_view text);
  void event(const std::string& kind, int round, const std::string& reason, const std::string& host = "", int rank = -1);
  void send(Node& n, const std::string& cmd);
  // A failure of the running round's worker: held back (detail::kCollateralHold) in a round
  // of several nodes, else judged at once by blameWorker.
  void workerFailed(Node& n, const WorkerExit& w);
  // The incident is this worker's failure (reported at `since`): a restart, or the job's end.
  void blameWorker(Node& n, const WorkerExit& w, Clock::time_point since);
  void releaseHeld();  // the held failure is the incident's cause after all: judged now
  // The held failure was a stop signal from outside, and dtrain got `sig` within
  // kOutsideStopWindow: the round's workers that died of one count as stopped, no verdict.
  void oneStop(int sig);
  // The most workers node n's agent may start, and the largest world a round may have.
  int maxLocalWorkers(const Node& n) const;
  int maxWorld() const;
  bool heldSettled() const;
  void nodeLost(Node& n, const std::string& why);
  void pauseMembers();
  // Pauses the members' workers now and starts the next round delayS after `since` (the
  // incident's first report). The caller has already counted the restart when it spends the
  // budget (a join does not).
  void scheduleRestart(double delayS, Clock::time_point since = Clock::now());
  double backoff() const;  // before restart number result_.restarts
  void tryRestart();
  // n's workers are being stopped (paused while they ran): the next round waits for its 'D'.
  void markStopping(Node& n) {
    if (!n.stopping) n.stoppingSince = Clock::now();
    n.stopping = true;
  }
  // An elastic job (min_nodes below the host count) goes on without hosts that fail it.
  bool elastic() const { return spec_.min_nodes < static_cast<int>(spec_.nodes.size()); }
  // The round forming (openRound_) not formed within rendezvous.timeout_s: without the
  // members that did not join when enough did (elastic), else the job's failure.
  void roundNotFormed();
  // The launcher's view of the job's rounds: it opens them and says who is to join them,
  // never joins one itself.
  rendezvous::Rendezvous launcherRendezvous();
  void finalFailure(const std::string& why, int exitCode, std::optional<WorkerExit> worker = std::nullopt);
  // Sends every agent `how`: "kill", or a stop (proto::stopCommand: "stop" sends the
  // workers SIGTERM, the launcher's own stops; "stop SIGINT" passes the user's Ctrl-C on).
  void stopAll(const std::string& how);
  void teardownNotice();
  void checkAllIdle();
  void timers();
  void reap();
  int memberCount() const;
  // The round an event carries (docs/elastic.md, "Events"): the round that runs, or forms
  // (round 0 during startup, not "round -1"); from a restart's announcement (its `restart`
  // event names openRound_ + 1, as does a join's pause) until that round is opened, the
  // round it opens. So rounds never go down along the event log, and everything between a
  // `restart (round N)` and the start of round N (a node lost in the teardown, a lost
  // host's retry that fails, a node lost while round N forms) says N. Not the round the
  // workers last ran in: activeRound_ stays at N - 1 until every member has started N.
  int eventRound() const { return detail::eventRound(openRound_, pending_); }

  spec::JobSpec& spec_;
  const MultiNodeOptions& opts_;
  std::string runId_;
  int storePort_;
  std::string token_;
  std::unique_ptr<store::TcpStore> store_;  // the launcher's own client: rounds, heartbeats
  std::unique_ptr<rendezvous::HeartbeatMonitor> hearts_;
  std::vector<Node> nodes_;
  RunResult result_;
  std::optional<WorkerExit> failedWorker_;
  // Why the latest restart was scheduled: a worker's failure, else a lost node's message. A
  // signal in its back-off names it (the job ended by the signal, after that failure).
  std::optional<WorkerExit> restartWorker_;
  std::string restartCause_;
  std::map<int, Fd> logs_;
  std::set<int> logsFailed_;  // ranks whose log could not be written (said once)
  // (Re)opens rank's log under a header of `round`.
  std::string logPath(int rank) const;  // DIR/rank_N.log
  std::map<int, Fd>::iterator openLog(int rank, int round);
  int firstRoundNodes_ = 0;
  int openRound_ = 0;       // the rendezvous round agents join next / are in
  int activeRound_ = -1;    // the round whose workers run (all members reported it)
  bool restarting_ = true;  // members told to join openRound_, not all there yet
  // Failures of openRound_'s workers seen while restarting_ (their node had started the
  // round, another had not reported it yet): handled once the round is active. Dropping
  // them left the job waiting forever for the slower node's healthy workers.
  std::vector<std::pair<Node*, WorkerExit>> earlyFailures_;
  // The first worker failure of an incident in a round of several nodes, its verdict held
  // back for up to detail::kCollateralHold: it may be collateral of a node lost in the same
  // incident, which is then blamed instead. Later failures meanwhile are consequences, as
  // after a restart's announcement.
  struct HeldFailure {
    Node* node;
    WorkerExit exit;
    Clock::time_point at;  // reported: the incident's start
  };
  std::optional<HeldFailure> held_;
  // Agents that ended their workers on a stop signal of their own (SIGTERM, SIGINT, SIGHUP to
  // the agent on its host), each lost after kOutsideStopWindow unless dtrain's own signal
  // comes first: then it was one stop of the whole job.
  struct HeldAgentStop {
    Node* node;
    int sig;
    Clock::time_point at;
  };
  std::vector<HeldAgentStop> heldAgentStops_;
  // Agents whose round ended with a code but no failed worker: lost if they have not ended
  // (or moved on) within kIdleWithoutFailureWait; see onRecord 'D'.
  struct IdleWithoutFailure {
    Node* node;
    int rc;
    Clock::time_point at;
  };
  std::vector<IdleWithoutFailure> idleWithoutFailure_;
  // Since when the agents' pipes are left unread (the console takes nothing more): their
  // records wait there, so no agent is judged late meanwhile.
  std::optional<Clock::time_point> heldSince_;
  bool killAsked_ = false;  // a second Ctrl-C: the agents are SIGKILLed at the deadline, held console or not
  bool pending_ = false;    // a restart is scheduled
  Clock::time_point pendingAt_{};
  std::optional<Clock::time_point> minNodesDeadline_;
  // Since when openRound_ has been forming: its first node joined (elastic jobs: the launcher
  // judges a round that does not form; others leave it to the agents' own timeout); reset
  // when a round opens and once it runs.
  std::optional<Clock::time_point> formingSince_;
  Clock::time_point nextArrivalCheck_{};
  bool finishing_ = false;  // every member succeeded; agents told to exit
  bool stopping_ = false;
  bool killed_ = false;
  Clock::time_point stopStarted_{};
  bool teardownNoticed_ = false;
  Clock::time_point killDeadline_{};
  Clock::time_point nextHeartbeatCheck_{};
  int fallbackExit_ = 0;  // exit code for a failure that is not a worker's
  bool consoleTty_ = false;
  std::string statusLine_;
  EnvMap env_;
};

int MultiNodeRunner::memberCount() const {
  int n = 0;
  for (const auto& node : nodes_) n += node.member;
  return n;
}

void MultiNodeRunner::event(const std::string& kind, int round, const std::string& reason, const std::string& host, int rank) {
  result_.events.push_back({detail::utcNow(), round, kind, reason, host, rank});
  console().write(STDERR_FILENO, spec::formatEvent(result_.events.back()) + "\n");
}

void MultiNodeRunner::send(Node& n, const std::string& cmd) {
  if (n.in) writeAll(n.in.get(), cmd + "\n");
}

void MultiNodeRunner::spawnAgent(Node& n, bool wait) {
  const auto& ns = *n.spec;
  int nnodes = firstRoundNodes_;
  std::vector<std::string> args = {"agent", "--store-port", std::to_string(storePort_), "--run-id", runId_,
                                   "--node", n.name, "--order", std::to_string(n.index), "--nnodes", std::to_string(nnodes)};
  if (ns.slots > 0) args.insert(args.end(), {"--nproc", std::to_string(ns.slots)});
  if (!ns.gpus.empty()) {
    std::vector<std::string> g;
    for (int x : ns.gpus) g.push_back(std::to_string(x));
    args.insert(args.end(), {"--gpus", fmt::format("{}", fmt::join(g, ","))});
  }
  if (!ns.address.empty()) args.insert(args.end(), {"--address", ns.address});
  if (wait) args.push_back("--wait");
  if (elastic()) args.insert(args.end(), {"--join-grace", fmt::format("{}", kJoinGraceS)});
  if (result_.merged_output) args.push_back("--merge-output");
  if (!opts_.data_share) args.push_back("--no-data-share");
  if (!opts_.memory_check) args.push_back("--no-memory-check");
  SpawnOptions so;
  so.env = envStrings(env_);
  so.stdin_pipe = true;
  if (ns.local) {
    args.insert(args.end(), {"--store-addr", "127.0.0.1"});
    so.argv = {selfExecutable()};
    so.argv.insert(so.argv.end(), args.begin(), args.end());
  } else {
    if (!spec_.rendezvous.addr.empty()) args.insert(args.end(), {"--store-addr", spec_.rendezvous.addr});
    args.insert(args.begin(), remoteDtrain(spec_));
    so.argv = sshArgv(spec_, ns);
    so.argv.push_back(remoteCommand(args));
  }
  Spawned child = spawnProcess(so);
  n.pid = child.pid;
  n.running = true;
  n.status = 0;
  n.in = std::move(child.in);
  n.out = Pipe{std::move(child.out)};
  n.err = Pipe{std::move(child.err)};
  n.state = NodeState::kStarting;
  // (no round of this agent's yet: a host tried again is not taken for one that ran in the
  // round of an incident, which nodeLost excuses once)
  n.round = -1;
  n.lostReason.clear();
  n.notJoined = false;
  n.stopping = false;
  n.toldRound = wait ? -1 : openRound_;
  n.beating = false;
  n.beatAtSpawn.clear();
  try {
    if (hearts_) n.beatAtSpawn = hearts_->counter(n.name);
  } catch (const std::exception&) {
  }
  n.exits.clear();  // of a round it was lost in; not the summary's
  send(n, "token " + token_);
}

std::string MultiNodeRunner::logPath(int rank) const {
  return (std::filesystem::path(spec_.log_dir) / fmt::format("rank_{}.log", rank)).string();
}

std::map<int, Fd>::iterator MultiNodeRunner::openLog(int rank, int round) {
  // Appended to, after a header line (the round): earlier runs and rounds stay.
  return logs_.insert_or_assign(rank, Fd(openRankLog(logPath(rank), runId_, round))).first;
}

void MultiNodeRunner::emitWorkerLine(Node& n, bool isErr, int rank, int localRank, std::string_view text) {
  std::string prefix = spec_.prefix_output ? fmt::format("[{} rank {}] ", n.name, rank) : std::string();
  if (!isErr && text.substr(0, kStatusPrefix.size()) == kStatusPrefix) {
    if (!consoleTty_) return;
    const std::string_view status = text.substr(kStatusPrefix.size());
    statusLine_ = status.empty() ? std::string() : prefix + std::string(status);  // empty: the bar is done
    console().write(STDOUT_FILENO, "\r\x1b[2K" + statusLine_);
    return;
  }
  if (!spec_.log_dir.empty()) {
    auto it = logs_.find(rank);
    if (it == logs_.end()) it = openLog(rank, std::max(activeRound_, 0));  // (a line before its round record)
    std::string rec(text);
    rec.push_back('\n');
    if (!writeAll(it->second.get(), rec)) {
      const int err = errno;
      if (logsFailed_.insert(rank).second)  // said once per rank's log
        console().write(STDERR_FILENO, logWriteWarning(logPath(rank), fmt::format("rank {}", rank), err));
    }
  }
  const auto& filter = spec_.console_ranks;
  if (!filter.empty() && std::find(filter.begin(), filter.end(), localRank) == filter.end()) return;
  std::string rec = prefix;
  rec.append(text);
  rec.push_back('\n');
  if (!statusLine_.empty()) console().write(STDOUT_FILENO, "\r\x1b[2K");
  console().write(isErr ? STDERR_FILENO : STDOUT_FILENO, rec);
  if (!statusLine_.empty()) console().write(STDOUT_FILENO, statusLine_);
}

void MultiNodeRunner::finalFailure(const std::string& why, int exitCode, std::optional<WorkerExit> worker) {
  if (stopping_ || finishing_) return;
  if (result_.failure_message.empty()) {
    result_.failure_message = why;
    fallbackExit_ = exitCode;
  }
  if (worker && !failedWorker_) failedWorker_ = worker;
  // A worker that failed before its round became active is still the first failure.
  if (!failedWorker_ && !earlyFailures_.empty()) failedWorker_ = earlyFailures_.front().second;
  stopAll(proto::stopCommand(SIGTERM));
}

void MultiNodeRunner::workerFailed(Node& n, const WorkerExit& w) {
  if (w.hung) event("worker_hung", eventRound(), w.error_message, n.name, w.global_rank);
  if (restartCannotHelp(w)) {
    // Every attempt would fail the same way, so the budget is not spent on it.
    finalFailure(notRestartedReason(w, spec_, n.name), kExitFailure, w);
    return;
  }
  if (memberCount() > 1 || outsideStopSignal(w)) {
    // Its peers on other nodes may have failed only because a node vanished, and this
    // report may have overtaken that node's loss: judged once the round's nodes have all
    // been heard from, or after detail::kCollateralHold. The workers stop now whatever the
    // verdict. A worker that died of a stop signal dtrain did not send is held at least
    // kOutsideStopWindow, in a round of one node too: a scheduler stopping the job signals
    // dtrain as well, and that signal makes it one stop, not a failure (the drain below).
    held_ = HeldFailure{&n, w, Clock::now()};
    pauseMembers();
    return;
  }
  blameWorker(n, w, Clock::now());
}

int MultiNodeRunner::maxLocalWorkers(const Node& n) const {
  // (as the agent resolves them: slots, else one per listed GPU, else nproc_per_node; "auto"
  // is the host's GPU count, unknown here: bounded by the hostfile's own cap on slots)
  constexpr int kMaxSlots = 4096;
  if (n.spec->slots > 0) return n.spec->slots;
  if (!n.spec->gpus.empty()) return static_cast<int>(n.spec->gpus.size());
  return spec_.nproc_auto ? kMaxSlots : std::max(1, spec_.nproc_per_node);
}

int MultiNodeRunner::maxWorld() const {
  long long w = 0;
  for (const auto& m : nodes_) w += maxLocalWorkers(m);
  return static_cast<int>(std::min<long long>(w, 1 << 24));
}

void MultiNodeRunner::oneStop(int sig) {
  held_.reset();
  std::vector<std::string> agents;
  for (const auto& h : heldAgentStops_) agents.push_back(fmt::format("{} ({})", h.node->name, signalName(h.sig)));
  heldAgentStops_.clear();
  std::vector<std::string> ranks;
  for (auto& n : nodes_) {
    if (!n.member || n.round != activeRound_) continue;
    for (auto& w : n.exits)
      if (outsideStopSignal(w)) {
        w.stopped_by_dtrain = true;
        ranks.push_back(fmt::format("{} ({})", w.global_rank, w.signal ? signalName(w.signal) : fmt::format("code {}", w.exit_code)));
      }
  }
  std::string who;
  if (!ranks.empty()) who = fmt::format("rank(s) {}", fmt::join(ranks, ", "));
  if (!agents.empty()) who += fmt::format("{}the agent(s) on {}", who.empty() ? "" : " and ", fmt::join(agents, ", "));
  console().write(STDERR_FILENO,
                  fmt::format("dtrain: {} had ended by a stop signal from outside dtrain just before dtrain got {}: "
                              "one stop of the whole job (a scheduler's), not a failure; no restart\n",
                              who, signalName(sig)));
}

bool MultiNodeRunner::heldSettled() const {
  // Every node of the round has reported its workers ended (idle): no loss of one of them
  // can be on its way. (A lost node is no longer a member; its loss took the hold over.)
  return std::all_of(nodes_.begin(), nodes_.end(),
                     [](const Node& m) { return !m.member || m.state == NodeState::kIdle; });
}

void MultiNodeRunner::releaseHeld() {
  HeldFailure h = std::move(*held_);
  held_.reset();
  // The exit reported first may be a rank that only lost its peer ("lost rank K"), reaped
  // before the peer that died (rank K on the same node or another): blamed as on one node
  // (rootCause), over every exit the round's nodes have reported by now.
  std::vector<WorkerExit> all;
  std::vector<Node*> owner;
  int first = -1;
  for (auto& n : nodes_) {
    if (!n.member || n.round != activeRound_) continue;
    for (const auto& w : n.exits) {
      if (&n == h.node && w.global_rank == h.exit.global_rank) first = static_cast<int>(all.size());
      all.push_back(w);
      owner.push_back(&n);
    }
  }
  if (first >= 0) {
    const int cause = rootCause(all, first);
    if (cause != first) {
      h.node = owner[static_cast<size_t>(cause)];
      h.exit = all[static_cast<size_t>(cause)];
    }
  }
  const bool wasStopping = stopping_;
  blameWorker(*h.node, h.exit, h.at);
  // The job ends: its workers were told to stop at the failure (the pause), and the agents'
  // grace period runs from then, so the teardown's notice counts from then too.
  if (stopping_ && !wasStopping) stopStarted_ = h.at;
}

void MultiNodeRunner::blameWorker(Node& n, const WorkerExit& w, Clock::time_point since) {
  std::string what = exitReason(w);
  if (result_.restarts >= spec_.max_restarts) {
    result_.budget_exhausted = spec_.max_restarts > 0;
    finalFailure(spec_.max_restarts > 0 ? fmt::format("restart budget exhausted: {} restart(s) of {} used",
                                                      result_.restarts, spec_.max_restarts)
                                        : "",
                 kExitFailure, w);
    return;
  }
  ++result_.restarts;
  event("restart", openRound_ + 1,
        fmt::format("rank {} on {} {}; restart {} of {}", w.global_rank, n.name, what, result_.restarts, spec_.max_restarts),
        n.name, w.global_rank);
  restartWorker_ = w;
  restartWorker_->host = n.name;
  restartCause_.clear();
  scheduleRestart(backoff(), since);
}

void MultiNodeRunner::nodeLost(Node& n, const std::string& why) {
  bool wasMember = n.member && n.state != NodeState::kDone;
  n.state = NodeState::kLost;
  n.member = false;
  n.in.reset();
  if (stopping_ || finishing_) return;
  ++n.failures;
  // Horovod-style: a host that keeps failing waits longer before it is tried again.
  double cooldown = restartBackoffS(std::max(1.0, spec_.restart_backoff_s), n.failures, 300.0);
  n.retryAt = Clock::now() + std::chrono::milliseconds(static_cast<long>(cooldown * 1000));
  if (!wasMember) {
    // (a retried host that failed again: the event of the round that runs, or of the one a
    // restart has announced, eventRound)
    event("host_excluded", eventRound(), fmt::format("{} ({}) did not come back: {}; next try in {:.0f} s", n.name,
                                                   n.spec->origin, why, cooldown),
          n.name);
    return;
  }
  const std::string lost = fmt::format("node {} ({}) lost: {}", n.name, n.spec->origin, why);
  Clock::time_point since = Clock::now();
  if (held_) {
    // A worker's failure came first, its verdict held: most likely collateral of this loss
    // (its collective lost the peers that ran here), whose report it overtook. The incident
    // is this node's; the worker's exit stays in the summary's ranks.
    since = held_->at;
    held_.reset();
  }
  event("node_lost", eventRound(), lost, n.name);
  auto excluded = [&] {
    event("host_excluded", eventRound(),
          fmt::format("{} excluded for {:.0f} s (lost {} time(s))", n.name, cooldown, n.failures), n.name);
  };
  // Not in the round in time, as enough others were (roundNotFormed), or, the first time for
  // a host, lost before any worker of the job ran (its agent ended or went silent while round
  // 0 formed) in an elastic job: a membership change, as a host failing the pre-flight is; no
  // restart is spent, the round forms again without it, once every node found late with it
  // is gone too (not taken into the round as still there). None of its workers ran, so no
  // worker failed: a host let back in that is late again spends nothing either (its cooldown
  // doubles each time), where spending the budget would end a job that runs well on min_nodes.
  const bool beforeAnyWorker = elastic() && activeRound_ < 0 && n.failures == 1 &&
                               std::none_of(nodes_.begin(), nodes_.end(), [](const Node& m) { return m.round >= 0; });
  if (n.notJoined || beforeAnyWorker) {
    n.notJoined = false;
    excluded();
    // (reaped together, each said in round 0: not the round a first one's restart announces)
    const bool othersLate =
        std::any_of(nodes_.begin(), nodes_.end(), [&](const Node& m) { return &m != &n && m.notJoined; });
    if (!pending_ && !othersLate) scheduleRestart(0, since);
    return;
  }
  // One incident, one restart. A restart already on its way for this incident (pending_: a
  // worker's failure came first; its peers on the lost node were the cause or a consequence):
  // the next round starts without this node. The round such a restart opened still forming
  // (restarting_; not every member has started its workers), this node having run in the
  // incident's round and not started the new one: its loss is part of that incident (one
  // frozen by it, a host that swaps: its peer's watchdog fired first, its heartbeat went
  // silent later, and it could not answer the round), and the round, which waits for it,
  // forms again without it. (A host that came back meanwhile and is lost again is not: a host
  // that keeps failing spends restarts, so the budget ends it.)
  const bool formingForIncident =
      !pending_ && restarting_ && (restartWorker_ || !restartCause_.empty()) && n.round == activeRound_;
  if (pending_ || formingForIncident) {
    excluded();
    if (formingForIncident) scheduleRestart(0, since);
    return;
  }
  // (members whose agent still runs: another one lost at the same moment, reaped with this
  // one and about to be said, is not left)
  reap();
  int left = 0;
  for (const auto& node : nodes_) left += node.member && node.running;
  if (spec_.max_restarts == 0 || result_.restarts >= spec_.max_restarts) {
    std::string msg = lost;
    if (spec_.max_restarts > 0)
      msg += fmt::format("; restart budget exhausted: {} restart(s) of {} used", result_.restarts, spec_.max_restarts);
    finalFailure(msg, kExitFailure);
    return;
  }
  excluded();
  ++result_.restarts;
  event("restart", openRound_ + 1,
        fmt::format("{}; {} node(s) left (min_nodes {}); restart {} of {}", lost, left, spec_.min_nodes,
                    result_.restarts, spec_.max_restarts),
        n.name);
  restartWorker_.reset();
  restartCause_ = lost;
  scheduleRestart(backoff(), since);
}

double MultiNodeRunner::backoff() const {
  return restartBackoffS(spec_.restart_backoff_s, result_.restarts - 1, 60.0);
}

void MultiNodeRunner::pauseMembers() {
  for (auto& n : nodes_) {
    if (connected(n) && (n.state == NodeState::kRunning || n.state == NodeState::kJoining)) {
      if (n.state == NodeState::kRunning) markStopping(n);
      send(n, "pause");
    } else if (startingMember(n)) {
      send(n, "pause");  // (in round 0's rendezvous, or on its way there: it waits for the restart)
    }
  }
}

void MultiNodeRunner::scheduleRestart(double delayS, Clock::time_point since) {
  // Workers stop now (a held failure's already are); the next round starts after the back-off.
  pauseMembers();
  auto at = since + std::chrono::milliseconds(static_cast<long>(delayS * 1000));
  if (!pending_ || at > pendingAt_) pendingAt_ = at;
  pending_ = true;
  restarting_ = true;  // failures until the next round starts are consequences, not causes
  earlyFailures_.clear();
}

void MultiNodeRunner::tryRestart() {
  std::vector<Node*> ready;
  for (auto& n : nodes_)
    if (connected(n) || startingMember(n)) ready.push_back(&n);
  // The round opens once every member has stopped the workers of the round before (the
  // agents' grace bounds it; a frozen one is lost by its heartbeat): a node that joins at once
  // (a host let back in) must not have its peers judged late for their teardown.
  if (std::any_of(ready.begin(), ready.end(), [](const Node* n) { return n->stopping; })) return;
  if (static_cast<int>(ready.size()) < spec_.min_nodes) {
    if (!minNodesDeadline_) {
      minNodesDeadline_ = Clock::now() + std::chrono::seconds(spec_.rendezvous.timeout_s);
      console().write(STDERR_FILENO,
                      fmt::format("dtrain: {} node(s) available, min_nodes is {}: waiting up to {} s for hosts to "
                                  "come back\n",
                                  ready.size(), spec_.min_nodes, spec_.rendezvous.timeout_s));
    }
    if (Clock::now() >= *minNodesDeadline_)
      finalFailure(fmt::format("only {} node(s) left, min_nodes is {}; waited {} s (rendezvous.timeout_s) for others "
                               "to come back",
                               ready.size(), spec_.min_nodes, spec_.rendezvous.timeout_s),
                   kExitFailure);
    return;
  }
  minNodesDeadline_.reset();
  if (static_cast<int>(ready.size()) > spec_.max_nodes) ready.resize(static_cast<size_t>(spec_.max_nodes));
  rendezvous::Rendezvous rdzv = launcherRendezvous();
  std::vector<std::string> names;
  for (const Node* n : ready) names.push_back(n->name);
  // (its members named before it opens: an agent of the round before that is still about,
  // killed but not told yet, does not take a place in it)
  rdzv.expect(openRound_ + 1, names);
  rdzv.openNextRound(openRound_);
  ++openRound_;
  for (auto& n : nodes_) n.member = false;
  for (Node* n : ready) {
    if (n->state == NodeState::kWaiting)
      event("node_joined", openRound_, fmt::format("{} ({}) is back and joins round {}", n->name, n->spec->origin, openRound_),
            n->name);
    n->member = true;
    n->state = NodeState::kJoining;
    // (its exits stay those of the round it last ran, n.round, until it reports the new one:
    // a round that never starts leaves the summary the ranks of the one that ran)
    n->toldRound = openRound_;
    send(*n, fmt::format("restart {} {} {}", result_.restarts, ready.size(), openRound_));
  }
  pending_ = false;
  restarting_ = true;
  formingSince_.reset();
}

void MultiNodeRunner::roundNotFormed() {
  formingSince_.reset();
  std::vector<std::string> arrived;
  rendezvous::Rendezvous rdzv = launcherRendezvous();
  try {
    arrived = rdzv.arrived(openRound_);
  } catch (const std::exception&) {
    return;  // (the store's trouble is the agents' to say)
  }
  std::vector<Node*> late;
  int joined = 0;
  for (auto& n : nodes_) {
    if (!n.member || !n.running) continue;
    if (n.round == openRound_ || std::find(arrived.begin(), arrived.end(), n.name) != arrived.end())
      ++joined;
    else
      late.push_back(&n);
  }
  if (late.empty()) return;  // (all there: the round closes, its records are on their way)
  // (one still stopping the workers of a round it had formed before the launcher's word came
  // is not late yet: judged timeout_s after it has stopped them)
  if (std::any_of(late.begin(), late.end(), [](const Node* n) { return n->stopping; })) {
    formingSince_ = Clock::now();
    return;
  }
  const auto waited = std::chrono::seconds(spec_.rendezvous.timeout_s);
  if (joined < spec_.min_nodes) {
    finalFailure(rdzv.timeoutText(openRound_, waited, spec_.min_nodes), kExitFailure);
    return;
  }
  // Killed as a frozen heartbeat's agent is, then lost (nodeLost): excluded and tried again
  // after its cooldown, as a host that failed the pre-flight; the round forms again without.
  for (Node* n : late) {
    n->notJoined = true;
    n->lostReason = fmt::format("did not join round {} within {} s (rendezvous.timeout_s)", openRound_,
                                spec_.rendezvous.timeout_s);
    ::kill(-n->pid, SIGKILL);
  }
}

rendezvous::Rendezvous MultiNodeRunner::launcherRendezvous() {
  rendezvous::RendezvousOptions ro;
  ro.run_id = runId_;
  return rendezvous::Rendezvous(std::shared_ptr<store::Store>(store_.get(), [](store::Store*) {}), ro, {"launcher"});
}

void MultiNodeRunner::onRecord(Node& n, std::string_view line) {
  auto r = proto::parse(line);
  if (!r) return;
  auto intField = [&](size_t i) {
    try {
      return std::stoi(r->fields.at(i));
    } catch (...) {
      return -1;
    }
  };
  switch (r->type) {
    case 'O':
    case 'E':
      // (a rank outside the node's round is not its worker's: an agent's bytes are checked
      // like any peer's, never opening a log file for a number it made up)
      if (r->fields.size() == 3 && n.round >= 0 && intField(0) >= n.rankOffset &&
          intField(0) < n.rankOffset + n.localWorkers)
        emitWorkerLine(n, r->type == 'E', intField(0), intField(1), r->fields[2]);
      return;
    case 'W':
      if (n.state == NodeState::kStarting) n.state = NodeState::kWaiting;
      return;
    case 'N': {
      // The numbers must fit the job: an agent that says otherwise (a different dtrain, a
      // corrupted stream) is cut off as a lost node, rather than trusted to make the launcher
      // open a log per rank it names.
      const int world = intField(2), offset = intField(3), round = intField(6), local = intField(7);
      if (r->fields.size() != 8 || round < 0 || local < 1 || local > maxLocalWorkers(n) || offset < 0 ||
          world < 1 || world > maxWorld() || offset > world - local) {
        n.lostReason = fmt::format("its agent reported a round the job cannot have ({} workers from rank {} of {}); "
                                   "is the same dtrain version installed there (DTRAIN_BIN)?",
                                   local, offset, world);
        ::kill(-n.pid, SIGKILL);
        return;
      }
      n.round = round;
      n.rankOffset = offset;
      n.localWorkers = local;
      // A round it had formed before it read the launcher's word (a pause, a restart into a
      // later round): its workers start and stop at once, and it joins the round it was told
      // of after that. Its exits are of that round (n.round), its state stays the one it was
      // told (it is joining); the round it joins waits for the stop as for the others'.
      if (round < n.toldRound) {
        markStopping(n);
        n.exits.clear();  // (those of that round follow)
        return;
      }
      n.state = NodeState::kRunning;
      // Rank 0 starts again: the trainer outcome of a round before (stopped for a host that
      // joined, its final checkpoint since pruned) is not this job's any more. This round's
      // comes with its end ('T'), or none if its rank 0 fails.
      if (n.rankOffset == 0 && !opts_.result_file.empty()) std::remove(opts_.result_file.c_str());
      // (paused before it said it started: its workers are stopped now, and the next round
      // waits for that as for the others')
      if (pending_) markStopping(n);
      n.exits.clear();
      // Each rank of the node's round gets its log now, under a header of that round, as a
      // single node's ranks get one per attempt: a rank that prints nothing still has its
      // file, and a rank that moved host between rounds has its rounds told apart.
      if (!spec_.log_dir.empty())
        for (int r = n.rankOffset; r < n.rankOffset + n.localWorkers; ++r) openLog(r, n.round);
      bool all = restarting_ && !pending_;
      for (const auto& m : nodes_)
        if (m.member && m.round != openRound_) all = false;
      if (all) {
        restarting_ = false;
        formingSince_.reset();
        activeRound_ = openRound_;
        // That restart happened: a later pause (a host joining) is not its back-off.
        restartWorker_.reset();
        restartCause_.clear();
        auto early = std::move(earlyFailures_);
        earlyFailures_.clear();
        for (auto& [node, w] : early)
          if (!stopping_ && !finishing_ && !restarting_ && !held_ && node->member && node->round == activeRound_)
            workerFailed(*node, w);
      }
      return;
    }
    case 'X': {
      auto w = proto::parseExit(*r);
      if (!w) return;
      // One exit per worker of the node's round, as its round record said: an agent that
      // reports others (another dtrain, a corrupted stream) is cut off as a lost node, rather
      // than trusted to fail the job for a rank it made up or to grow the summary without end.
      if (n.round < 0 || w->global_rank < n.rankOffset || w->global_rank >= n.rankOffset + n.localWorkers ||
          w->local_rank != w->global_rank - n.rankOffset ||
          std::any_of(n.exits.begin(), n.exits.end(), [&](const WorkerExit& e) { return e.global_rank == w->global_rank; })) {
        n.lostReason = fmt::format("its agent reported an exit the job cannot have (rank {}, local rank {}, of its {} "
                                   "workers from rank {}); is the same dtrain version installed there (DTRAIN_BIN)?",
                                   w->global_rank, w->local_rank, n.localWorkers, n.rankOffset);
        ::kill(-n.pid, SIGKILL);
        return;
      }
      w->host = n.name;
      // A worker that died of a stop signal dtrain did not send, while dtrain stops the job
      // by its own: the same stop reached it first (a scheduler signals every process).
      if (stopping_ && result_.received_signal && outsideStopSignal(*w)) w->stopped_by_dtrain = true;
      n.exits.push_back(*w);
      bool failed = (w->signal || w->exit_code) && !w->stopped_by_dtrain;
      if (!failed || stopping_ || finishing_) return;
      if (!restarting_ && !held_ && n.round == activeRound_) {
        workerFailed(n, *w);
      } else if (restarting_ && !pending_ && n.round == openRound_) {
        earlyFailures_.emplace_back(&n, *w);  // the round is starting: a cause, not a consequence
      }
      return;
    }
    case 'D':
      n.stopping = false;
      // (the end of a round it had left already: see 'N')
      if (r->fields.size() >= 2 && intField(1) >= 0 && intField(1) < n.toldRound) return;
      n.state = NodeState::kIdle;
      n.idleRc = intField(0);
      // Its workers ended without a failure of theirs and the launcher asked for nothing,
      // by a signal to the agent itself (a SIGTERM, a host shutting down): the agent waits
      // for the launcher's word, so nothing else would come from that node this round. It
      // counts as lost (an elastic job goes on without it) rather than leaving the job
      // waiting for it forever. (An agent that gave up on a silent store ends on its own,
      // with its reason on stderr: lost when it exits.)
      if (n.idleRc > 128 && !stopping_ && !finishing_ && !pending_ &&
          (n.round == activeRound_ || (restarting_ && n.round == openRound_)) &&
          std::none_of(n.exits.begin(), n.exits.end(),
                       [](const WorkerExit& w) { return (w.signal || w.exit_code) && !w.stopped_by_dtrain; })) {
        const int sig = n.idleRc - 128;
        // A stop signal: held kOutsideStopWindow, as a worker's death by one is (workerFailed):
        // a scheduler stopping the job signals dtrain too, and then it is one stop.
        if (sig == SIGTERM || sig == SIGINT || sig == SIGHUP)
          heldAgentStops_.push_back({&n, sig, Clock::now()});
        else
          nodeLost(n, fmt::format("its agent was stopped by {} on that host (and stopped its workers)", signalName(sig)));
        return;
      }
      // A round that ended with a code but without a failed worker: an agent that lost the
      // store ends right after (lost when it exits, with its reason from its stderr); any
      // other (another dtrain, a record lost on the way) would hold the job for good, so it
      // is lost if it has not ended within a few seconds.
      if (n.idleRc >= 1 && n.idleRc <= 128 && !stopping_ && !finishing_ && !pending_ &&
          (n.round == activeRound_ || (restarting_ && n.round == openRound_)) &&
          std::none_of(n.exits.begin(), n.exits.end(),
                       [](const WorkerExit& w) { return (w.signal || w.exit_code) && !w.stopped_by_dtrain; })) {
        idleWithoutFailure_.push_back({&n, n.idleRc, Clock::now()});
        return;
      }
      checkAllIdle();
      return;
    case 'T':
      if (!opts_.result_file.empty() && r->fields.size() == 1) std::ofstream(opts_.result_file) << r->fields[0];
      return;
    case 'F':
      n.reportedFailure = true;
      // (the agent's failures name their node; one that does not, as another dtrain's agent
      // might, gets the name here: a job of many hosts must say which one refused it)
      if (r->fields.size() == 2)
        finalFailure(r->fields[1].rfind(fmt::format("node {}: ", n.name), 0) == 0 ||
                             (r->fields[0] == "timeout" && r->fields[1].rfind("rendezvous round ", 0) == 0)
                         ? r->fields[1]
                         : fmt::format("node {}: {}", n.name, r->fields[1]),
                     r->fields[0] == "spec" ? kExitUsage : kExitFailure);
      return;
    default:
      return;
  }
}

void MultiNodeRunner::checkAllIdle() {
  if (restarting_ || pending_ || held_ || stopping_ || finishing_) return;
  for (const auto& n : nodes_)
    if (n.member && (n.state != NodeState::kIdle || n.idleRc != 0)) return;
  finishing_ = true;
  for (auto& n : nodes_) {
    if (!connected(n) && n.state != NodeState::kStarting) continue;
    send(n, "exit");
    n.state = NodeState::kDone;
  }
}

void MultiNodeRunner::stopAll(const std::string& how) {
  pending_ = false;  // no restart after a stop
  held_.reset();     // nor a verdict on a held failure (a signal judged it first)
  for (auto& n : nodes_) {
    if (!n.running) continue;
    send(n, how);
    // A remote node not heard from yet runs no workers; its ssh may still be connecting to
    // a host that does not answer (a lost host being retried), which would hold the job's
    // end up to ssh's ConnectTimeout. Killed now, as the pre-flight's checks are: an agent
    // that did start there sees its stdin close and ends. Not when its agent has said
    // something not read yet: its round record, sent as it starts its workers, which are
    // then stopped through the agent with their grace period. (A local agent gets the stop:
    // one slow to start that joins the round late gives up its wait for the round's master
    // on it.)
    if (n.state == NodeState::kStarting && !n.spec->local) {
      pollfd p{n.out.fd ? n.out.fd.get() : -1, POLLIN, 0};
      const bool unread = n.out.fd && ::poll(&p, 1, 0) > 0 && (p.revents & POLLIN);
      if (!unread && n.out.splitter.pending().empty()) ::kill(-n.pid, SIGKILL);
    }
  }
  if (!stopping_) {
    stopping_ = true;
    stopStarted_ = Clock::now();
    // Agents escalate to SIGKILL after the grace period themselves; this is the backstop
    // for an agent (or an ssh connection) that does not come back.
    killDeadline_ = Clock::now() + std::chrono::milliseconds(static_cast<long>(spec_.shutdown_timeout_s * 1000) + 10000);
  }
  if (how == "kill") {
    killDeadline_ = std::min(killDeadline_, Clock::now() + std::chrono::seconds(5));
    killAsked_ = true;  // (the backstop then fires even while the console holds the agents' pipes)
  }
}

// A teardown after a failure that takes a while (workers slow to honour SIGTERM, or ignoring
// it) says once, after kTeardownNoticeAfter, which ranks it still waits for and until when:
// silent, it looks like a hang for up to shutdown_timeout_s. Not for a signal's teardown,
// whose notice said it all at once.
void MultiNodeRunner::teardownNotice() {
  if (!stopping_ || killed_ || teardownNoticed_ || result_.received_signal) return;
  if (!failedWorker_ && result_.failure_message.empty()) return;
  if (Clock::now() < stopStarted_ + kTeardownNoticeAfter) return;
  // The ranks of the round that have not reported an exit, per node still connected.
  std::vector<std::string> waiting;
  for (const auto& n : nodes_) {
    if (!n.running || n.state != NodeState::kRunning) continue;
    std::vector<std::string> ranks;
    for (int l = 0; l < n.localWorkers; ++l) {
      const int rank = n.rankOffset + l;
      if (std::none_of(n.exits.begin(), n.exits.end(), [&](const WorkerExit& w) { return w.global_rank == rank; }))
        ranks.push_back(std::to_string(rank));
    }
    if (!ranks.empty()) waiting.push_back(fmt::format("{} ({})", fmt::join(ranks, ", "), n.name));
  }
  if (waiting.empty()) return;  // an agent still ending: nothing left that a user would wait for
  teardownNoticed_ = true;
  // Each agent SIGKILLs its workers shutdown_timeout_s after the stop it was sent.
  const double left = std::max(
      0.0, spec_.shutdown_timeout_s - std::chrono::duration<double>(Clock::now() - stopStarted_).count());
  std::string what = failedWorker_ ? fmt::format("rank {} ({}) failed", failedWorker_->global_rank, failedWorker_->host) : std::string("the job failed");
  std::string line = fmt::format("dtrain: {}; waiting up to {:.0f} s more for rank(s) {} to exit after SIGTERM, then "
                                 "SIGKILL (shutdown_timeout_s, --shutdown-timeout)\n",
                                 what, left, fmt::join(waiting, " and "));
  if (!statusLine_.empty()) console().write(STDOUT_FILENO, "\r\x1b[2K");  // above a progress bar, as worker lines
  console().write(STDERR_FILENO, line);
  if (!statusLine_.empty()) console().write(STDOUT_FILENO, statusLine_);
}

void MultiNodeRunner::reap() {
  while (true) {
    int status = 0;
    pid_t pid = ::waitpid(-1, &status, WNOHANG);
    if (pid <= 0) return;
    for (auto& n : nodes_) {
      if (n.pid != pid || !n.running) continue;
      n.running = false;
      n.status = status;
      ::kill(-pid, SIGKILL);  // anything left in its process group goes with it
    }
  }
}

void MultiNodeRunner::timers() {
  auto now = Clock::now();
  if (stopping_ || finishing_) return;
  for (const HeldAgentStop& h : takeDue(heldAgentStops_, kOutsideStopWindow, now)) {
    // (unless it has moved on meanwhile: lost, told to exit)
    if (h.node->state == NodeState::kIdle && h.node->idleRc == 128 + h.sig && h.node->member)
      nodeLost(*h.node, fmt::format("its agent was stopped by {} on that host (and stopped its workers)", signalName(h.sig)));
  }
  for (const IdleWithoutFailure& h : takeDue(idleWithoutFailure_, kIdleWithoutFailureWait, now)) {
    if (h.node->state == NodeState::kIdle && h.node->idleRc == h.rc && h.node->member) {
      std::string why = fmt::format("its agent ended its round with code {} but reported no failed worker", h.rc);
      if (!h.node->errTail.lines().empty()) why += ": " + h.node->errTail.lines().back();
      ::kill(-h.node->pid, SIGKILL);  // (it would not end by itself: the job would wait for it)
      nodeLost(*h.node, why);
    }
  }
  if (held_ && detail::heldFailureDue(held_->at, now, heldSettled()) &&
      (!outsideStopSignal(held_->exit) || now - held_->at >= kOutsideStopWindow))
    releaseHeld();
  if (pending_ && now >= pendingAt_) tryRestart();
  // An elastic job's forming round is judged rendezvous.timeout_s after its first node
  // joined, as the agents' own timeouts count (not from the agents' start: ssh, the data's
  // checks, a previous round's workers writing their final checkpoint take their time).
  if (elastic() && restarting_ && !pending_ && !held_) {
    if (!formingSince_ && now >= nextArrivalCheck_) {
      nextArrivalCheck_ = now + std::chrono::milliseconds(200);
      try {
        if (!launcherRendezvous().arrived(openRound_).empty()) formingSince_ = now;
      } catch (const std::exception&) {
      }
    } else if (formingSince_ && now >= *formingSince_ + std::chrono::seconds(spec_.rendezvous.timeout_s)) {
      roundNotFormed();
    }
  }
  // Liveness: a connected agent whose heartbeat stopped is cut off (and then lost).
  if (now >= nextHeartbeatCheck_) {
    nextHeartbeatCheck_ = now + std::chrono::milliseconds(500);
    std::vector<std::string> names;
    auto watched = [](const Node& n) { return connected(n) || (n.running && n.state == NodeState::kStarting && n.beating); };
    for (auto& n : nodes_) {
      if (n.running && n.state == NodeState::kStarting && !n.beating) {
        try {
          n.beating = hearts_->counter(n.name) != n.beatAtSpawn;
        } catch (const std::exception&) {
        }
      }
      if (watched(n)) names.push_back(n.name);
    }
    std::vector<std::string> dead;
    try {
      dead = hearts_->dead(names);
    } catch (const std::exception&) {
    }
    for (auto& n : nodes_) {
      if (!watched(n) || std::find(dead.begin(), dead.end(), n.name) == dead.end()) continue;
      n.lostReason = fmt::format("no heartbeat for {:.3g} s (rendezvous.heartbeat_timeout_s)", spec_.rendezvous.heartbeat_timeout_s);
      ::kill(-n.pid, SIGKILL);
    }
  }
  // A node whose workers do not end after its pause within the agents' grace and a margin (a
  // worker in uninterruptible sleep survives SIGKILL: a hung driver, a dead NFS mount) holds
  // every next round, as its agent waits for them: it is lost, as a silent one is.
  for (auto& n : nodes_) {
    if (!n.stopping || !n.running || n.state == NodeState::kLost || heldSince_) continue;
    const auto limit = std::chrono::milliseconds(static_cast<long>(spec_.shutdown_timeout_s * 1000)) +
                       std::chrono::seconds(10);
    if (now - n.stoppingSince < limit) continue;
    n.lostReason = fmt::format("its workers did not end within {:.3g} s of their stop (shutdown_timeout_s + 10 s)",
                               spec_.shutdown_timeout_s + 10);
    n.stopping = false;
    ::kill(-n.pid, SIGKILL);
  }
  // Hosts that were lost are tried again after their cooldown, while there is room.
  int inPlay = 0;
  for (const auto& n : nodes_) inPlay += n.running;
  for (auto& n : nodes_) {
    if (n.state != NodeState::kLost || n.running || now < n.retryAt || inPlay >= spec_.max_nodes) continue;
    console().write(STDERR_FILENO, fmt::format("dtrain: trying {} ({}) again\n", n.name, n.spec->origin));
    spawnAgent(n, /*wait=*/true);
    ++inPlay;
  }
  // A waiting host is admitted at once (a membership change spends no restart).
  bool waiting = std::any_of(nodes_.begin(), nodes_.end(), [](const Node& n) { return n.state == NodeState::kWaiting; });
  if (waiting && !pending_ && !restarting_ && !held_ && memberCount() < spec_.max_nodes) scheduleRestart(0);
}

RunResult MultiNodeRunner::run(const std::vector<const spec::NodeSpec*>& excluded) {
  SignalScope signals;
  consoleTty_ = consoleCanRedraw();
  // Our stdout and stderr are one file (a terminal, 2>&1): agents give each worker one pipe
  // for both, so its lines arrive in the order written (all as stdout).
  result_.merged_output = sameOpenFile(STDOUT_FILENO, STDERR_FILENO);
  if (!spec_.log_dir.empty()) std::filesystem::create_directories(spec_.log_dir);
  env_ = currentEnvironment();
  {
    store::TcpStoreOptions co;
    co.host = "127.0.0.1";
    co.port = storePort_;
    co.token = token_;
    store_ = std::make_unique<store::TcpStore>(co);
    hearts_ = std::make_unique<rendezvous::HeartbeatMonitor>(
        std::shared_ptr<store::Store>(store_.get(), [](store::Store*) {}), runId_,
        std::chrono::milliseconds(static_cast<long>(spec_.rendezvous.heartbeat_timeout_s * 1000)));
  }
  nodes_.resize(spec_.nodes.size());
  for (size_t i = 0; i < spec_.nodes.size(); ++i) {
    Node& n = nodes_[i];
    n.spec = &spec_.nodes[i];
    n.index = i;
    n.name = nodeName(spec_, spec_.nodes[i]);
    n.member = std::find(excluded.begin(), excluded.end(), n.spec) == excluded.end();
    if (!n.member) {
      n.state = NodeState::kLost;
      n.failures = 1;
      double cooldown = std::min(300.0, std::max(1.0, spec_.restart_backoff_s) * 2);
      n.retryAt = Clock::now() + std::chrono::milliseconds(static_cast<long>(cooldown * 1000));
      event("host_excluded", 0, fmt::format("{} ({}) failed pre-flight; next try in {:.0f} s", n.name, n.spec->origin, cooldown),
            n.name);
    }
    firstRoundNodes_ += n.member;
  }
  // ("auto" is counted by each host's agent: possibly several, whatever this host's count)
  bool crowded = std::any_of(spec_.nodes.begin(), spec_.nodes.end(), [&](const spec::NodeSpec& n) {
    return n.slots ? n.slots > 1 : spec_.nproc_auto || spec_.nproc_per_node > 1;
  });
  if (crowded && !env_.count("OMP_NUM_THREADS") && !spec_.env.count("OMP_NUM_THREADS"))
    console().write(STDERR_FILENO,
                    "dtrain: setting OMP_NUM_THREADS=1 for the workers of nodes that run several, to avoid "
                    "overloading them; set it in the spec's env or with --env to tune\n");
  {
    // (the nodes round 0 waits for: a timeout names those that did not join)
    std::vector<std::string> names;
    for (const auto& n : nodes_)
      if (n.member) names.push_back(n.name);
    launcherRendezvous().expect(0, names);
  }
  for (auto& n : nodes_)
    if (n.member) spawnAgent(n, /*wait=*/false);

  std::vector<char> buf(65536);
  Console& con = console();
  while (true) {
    std::vector<pollfd> fds;
    std::vector<std::pair<Node*, bool>> owners;
    fds.push_back({signals.fd(), POLLIN, 0});
    owners.push_back({nullptr, false});
    bool anyRunning = false;
    for (const auto& n : nodes_) anyRunning |= n.running;
    // Backpressure, as on one node (local_launcher.cc): while the console takes nothing
    // more, the agents' output is left unread; an agent then stops reading its workers' pipes
    // once its own channel here is backlogged, and the workers block on their writes. This
    // loop goes on meanwhile (signals, stops sent to the agents, heartbeats, timers), but the
    // agents' records wait behind their workers' lines in the same channel: a worker's exit
    // on a node is learned once the console takes output again (its own agent tears that
    // node's workers down at once regardless). With every agent gone, what is left in their
    // pipes is read regardless.
    const bool held = con.backlogged() && anyRunning;
    if (held) {
      if (!heldSince_) heldSince_ = Clock::now();
      fds.push_back({con.wakeFd(), POLLIN, 0});
      owners.push_back({nullptr, false});
    } else if (heldSince_) {
      // An agent's end may have waited on us for that long (its last records unread): the
      // backstop below does not count it, nor the limit on a paused node's workers (its 'D'
      // waited in the pipe too).
      // (counted from the stop when it came later: the time before it was not the agents')
      if (stopping_ && !killed_) killDeadline_ += Clock::now() - std::max(*heldSince_, stopStarted_);
      for (auto& n : nodes_)
        if (n.stopping) n.stoppingSince += Clock::now() - std::max(*heldSince_, n.stoppingSince);
      heldSince_.reset();
    }
    const size_t firstPipe = fds.size();
    bool anyPipes = false;
    for (auto& n : nodes_) {
      anyPipes |= n.out.fd || n.err.fd;
      if (held) continue;
      if (n.out.fd) fds.push_back({n.out.fd.get(), POLLIN, 0}), owners.push_back({&n, false});
      if (n.err.fd) fds.push_back({n.err.fd.get(), POLLIN, 0}), owners.push_back({&n, true});
    }
    bool retriesLeft = !stopping_ && !finishing_ &&
                       std::any_of(nodes_.begin(), nodes_.end(), [](const Node& n) { return n.state == NodeState::kLost; }) &&
                       (pending_ || restarting_ || minNodesDeadline_);
    if (!anyRunning && !anyPipes && !pending_ && !retriesLeft) break;
    int timeoutMs = 250;
    if (stopping_ && !killed_) {
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(killDeadline_ - Clock::now()).count();
      timeoutMs = static_cast<int>(std::clamp<long>(left, 0, 250));
      teardownNotice();
    }
    int n = ::poll(fds.data(), fds.size(), timeoutMs);
    if (n < 0 && errno != EINTR) throwErrno("poll");
    if (held && n > 0 && (fds[firstPipe - 1].revents & POLLIN)) con.clearWake();
    // While the console holds the agents' pipes, their last records may be waiting on us; but
    // a console that never drains must not keep the agents (and dtrain, deaf to any signal)
    // alive for good: the backstop fires anyway one more shutdown_timeout_s later, or at once
    // on a second Ctrl-C ("kill").
    const auto heldGrace = std::chrono::milliseconds(static_cast<long>(spec_.shutdown_timeout_s * 1000));
    if (stopping_ && !killed_ && (!held || killAsked_ || Clock::now() >= killDeadline_ + heldGrace) &&
        Clock::now() >= killDeadline_) {
      killed_ = true;
      for (auto& node : nodes_)
        if (node.running) ::kill(-node.pid, SIGKILL);
    }
    if (n > 0 && (fds[0].revents & POLLIN)) {
      signals.drain([&](int sig) {
        // A worker's death by a stop signal from outside, held, with dtrain's own signal now,
        // within kOutsideStopWindow: one stop of the whole job (a scheduler's), not a failure,
        // as on one host (job.cc). Otherwise a failure whose verdict is held is judged with
        // what is known now: the signal's headline names it as it would have after the hold.
        // (a held failure of its own is judged first: a worker failing by itself meanwhile is a
        // failure, whatever else the scheduler's stop reached)
        const bool heldOutside =
            held_ && outsideStopSignal(held_->exit) && Clock::now() - held_->at <= kOutsideStopWindow;
        if (held_ && !stopping_ && !heldOutside) releaseHeld();
        if (!stopping_ && !pending_ && (heldOutside || !heldAgentStops_.empty())) oneStop(sig);
        if (held_ && !stopping_) releaseHeld();  // (an outside stop not made one stop: a restart is under way)
        // In the teardown after a failure that ends the job anyway (no restart is coming: a
        // restart's teardown pauses, it does not stop), a signal only hurries the teardown:
        // the job still ends as that failure, as on one node (RunResult::teardown_signal).
        if (stopping_ && !result_.received_signal && (failedWorker_ || !result_.failure_message.empty()))
          result_.teardown_signal = sig;
        else if (!result_.received_signal && !result_.teardown_signal)
          result_.received_signal = sig;
        bool again = stopping_ && sig == SIGINT;
        if (!stopping_ && (pending_ || restarting_) && (restartWorker_ || !restartCause_.empty())) {
          // In the back-off before a restart its event announced (or while its round forms):
          // the job ends by the signal, after that failure, and says both in one headline (as
          // on one node).
          // (the teardown while a node still stops its workers, whatever the back-off's clock says)
          const bool tearingDown = std::any_of(nodes_.begin(), nodes_.end(), [](const Node& n) { return n.stopping; });
          result_.stopped_during = fmt::format("{} restart {} of {}",
                                               pending_ && minNodesDeadline_ ? "the wait for hosts (min_nodes) before"
                                               : pending_ && (tearingDown || Clock::now() >= pendingAt_)
                                                   ? "the teardown before"
                                               : pending_ ? "the back-off before"
                                                          : "the start of",
                                               result_.restarts, spec_.max_restarts);
          if (restartWorker_)
            failedWorker_ = restartWorker_;
          else
            result_.failure_message = restartCause_;
          // Paused nodes run no workers: only those still stopping theirs (or, the round
          // forming, already running its) are told to the user.
          const size_t stopping = static_cast<size_t>(std::count_if(
              nodes_.begin(), nodes_.end(), [](const Node& n) { return n.running && n.member && n.state == NodeState::kRunning; }));
          // (in the back-off the paused nodes' workers got SIGTERM at the pause, and a stop
          // sends a stopping worker nothing new; a round that started gets the signal)
          if (stopping)
            console().write(STDERR_FILENO, detail::shutdownNotice(signalName(sig), stopping, "node",
                                                                  pending_ ? "SIGTERM" : signalName(sig),
                                                                  spec_.shutdown_timeout_s, sig == SIGINT));
          else
            console().write(STDERR_FILENO, fmt::format("dtrain: {}: stopping during {}; no worker runs\n",
                                                       signalName(sig), result_.stopped_during));
        } else if (!stopping_) {
          const size_t running =
              // (the nodes of the round: an agent of a host waiting to rejoin runs no workers)
              static_cast<size_t>(std::count_if(nodes_.begin(), nodes_.end(), [](const Node& n) { return n.running && n.member; }));
          // Each agent passes the signal on to its workers, as on one host (agent_protocol.h "stop").
          console().write(STDERR_FILENO, detail::shutdownNotice(signalName(sig), running, "node", signalName(sig),
                                                                spec_.shutdown_timeout_s, sig == SIGINT));
        } else if (again) {
          result_.killed_now = true;
          console().write(STDERR_FILENO, "dtrain: killing the workers now (SIGKILL)\n");
        }
        // A second Ctrl-C means "now". Otherwise the agents pass the signal on to the workers
        // (SIGINT, SIGTERM, SIGHUP), as one host does; an agent already stopping its workers
        // (a failure's teardown, a restart's pause) sends them nothing new.
        stopAll(again ? std::string("kill") : proto::stopCommand(sig));
      }, [&](int sig) {
        // For the workers (agent_protocol.h "signal"): each agent passes it to its own.
        size_t nodes = 0;
        if (!stopping_)
          for (auto& node : nodes_)
            if (node.running && node.member && node.state == NodeState::kRunning) {
              send(node, "signal " + signalName(sig));
              ++nodes;
            }
        console().write(STDERR_FILENO, nodes ? fmt::format("dtrain: {}: passed on to the workers of {} node{}\n",
                                                           signalName(sig), nodes, nodes == 1 ? "" : "s")
                                             : fmt::format("dtrain: {}: no worker runs{}; not passed on\n",
                                                           signalName(sig), stopping_ ? " (stopping)" : ""));
      });
    }
    for (size_t i = firstPipe; n > 0 && i < fds.size(); ++i) {
      if (!(fds[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
      auto [node, isErr] = owners[i];
      Pipe& p = isErr ? node->err : node->out;
      ssize_t got = ::read(p.fd.get(), buf.data(), buf.size());
      if (got < 0 && errno == EINTR) continue;
      auto handle = [&, node = node, isErr = isErr](std::string_view l) {
        if (isErr) {
          node->errTail.push(l);
          console().write(STDERR_FILENO, fmt::format("dtrain: [{}] {}\n", node->name, l));
        } else {
          onRecord(*node, l);
        }
      };
      if (got <= 0) {
        p.splitter.finish(handle);
        p.fd.reset();
        continue;
      }
      p.splitter.feed(std::string_view(buf.data(), static_cast<size_t>(got)), handle);
    }
    reap();
    // An agent that ended (its output read to the end) while it still had a part to play.
    // Once the job is stopping or finishing, every agent is expected to end: that one is
    // done, not lost (lost dropped its workers' exits from the summary).
    for (auto& node : nodes_) {
      if (node.running || node.out.fd || node.state == NodeState::kLost || node.state == NodeState::kDone) continue;
      int code = WIFEXITED(node.status) ? WEXITSTATUS(node.status) : 128 + WTERMSIG(node.status);
      std::string why = node.lostReason;
      if (why.empty()) {
        why = fmt::format("its agent{} exited with {}", node.spec->local ? "" : " (ssh)", code);
        if (!node.errTail.lines().empty()) why += ": " + node.errTail.lines().back();
      }
      if (stopping_ || finishing_) {
        // Gone before it said its workers ended while the job stops (killed, its host lost),
        // not by dtrain's own kill: said, and its ranks that reported no end are listed as
        // lost in the summary (they were dropped from it, unsaid); no restart, the job ends.
        if (!killed_ && node.member && node.state == NodeState::kRunning && !node.reportedFailure) {
          node.state = NodeState::kLost;
          node.member = false;
          event("node_lost", eventRound(),
                fmt::format("node {} ({}) lost while the job was stopping: {}", node.name, node.spec->origin, why),
                node.name);
          continue;
        }
        node.state = NodeState::kDone;
        continue;
      }
      nodeLost(node, why);
    }
    timers();
  }
  if (!statusLine_.empty()) console().write(STDOUT_FILENO, "\n");
  // The summary shows the last round's ranks, in order; first_failure follows its worker.
  // The last round is the latest any node reported starting: a job that ended while its next
  // round formed (too few nodes came) shows the round that ran (the open one, which no node
  // started, left its lost nodes' ranks out). A node lost in it adds the exits it did report,
  // and its ranks that reported none are listed as lost: the summary names every rank of the
  // round, and says which ones nobody can tell how they ended.
  int shown = -1;
  for (const auto& node : nodes_) shown = std::max(shown, node.round);
  for (const auto& node : nodes_) {
    if (node.round != shown) continue;  // (a member that has not started it yet holds an older round's)
    result_.workers.insert(result_.workers.end(), node.exits.begin(), node.exits.end());
    if (node.state != NodeState::kLost) continue;
    for (int l = 0; l < node.localWorkers; ++l) {
      const int rank = node.rankOffset + l;
      if (std::any_of(node.exits.begin(), node.exits.end(), [&](const WorkerExit& w) { return w.global_rank == rank; }))
        continue;
      WorkerExit w;
      w.global_rank = rank;
      w.local_rank = l;
      w.host = node.name;
      w.lost = true;
      result_.workers.push_back(w);
    }
  }
  std::stable_sort(result_.workers.begin(), result_.workers.end(),
                   [](const WorkerExit& a, const WorkerExit& b) { return a.global_rank < b.global_rank; });
  if (failedWorker_) {
    auto it = std::find_if(result_.workers.begin(), result_.workers.end(), [&](const WorkerExit& w) {
      return w.global_rank == failedWorker_->global_rank && w.host == failedWorker_->host;
    });
    if (it == result_.workers.end()) it = result_.workers.insert(result_.workers.end(), *failedWorker_);
    // (the same rank of a round started after the failure, stopped by the signal that ended
    // the job during that start: the summary says the failure, not that worker's stop)
    else if (it->pid != failedWorker_->pid && failedWorker_->pid != 0)
      *it = *failedWorker_;
    result_.first_failure = static_cast<int>(it - result_.workers.begin());
  }
  if (result_.received_signal) {
    result_.exit_code = 128 + result_.received_signal;
  } else if (failedWorker_) {
    result_.exit_code = failedWorker_->signal ? 128 + failedWorker_->signal : failedWorker_->exit_code;
  } else if (!result_.failure_message.empty()) {
    result_.exit_code = fallbackExit_;
  }
  return result_;
}

}  // namespace

std::vector<std::string> sshArgv(const spec::JobSpec& spec, const spec::NodeSpec& node) {
  const auto& s = spec.ssh;
  std::vector<std::string> a = {"ssh", "-T", "-o", "BatchMode=yes",
                                "-o", fmt::format("ConnectTimeout={}", std::max(1, static_cast<int>(std::ceil(s.connect_timeout_s)))),
                                "-o", "StrictHostKeyChecking=" + s.host_key_checking,
                                // A dead connection ends ssh (and so tells us) within ~15 s.
                                "-o", "ServerAliveInterval=5", "-o", "ServerAliveCountMax=3"};
  int port = node.port ? node.port : s.port;
  if (port) a.insert(a.end(), {"-p", std::to_string(port)});
  if (!s.identity_file.empty()) a.insert(a.end(), {"-i", s.identity_file});
  std::string user = node.user.empty() ? s.user : node.user;
  if (!user.empty()) a.insert(a.end(), {"-l", user});
  a.insert(a.end(), s.options.begin(), s.options.end());
  a.push_back(node.host);
  return a;
}

Plan makeNodesPlan(const spec::JobSpec& spec, const std::string& run_id) {
  Plan plan;
  plan.run_id = run_id;
  plan.nnodes = static_cast<int>(spec.nodes.size());
  plan.master_addr = spec.rendezvous.master_addr.empty() ? "node 0's address" : spec.rendezvous.master_addr;
  for (size_t i = 0; i < spec.nodes.size(); ++i) {
    const auto& n = spec.nodes[i];
    int slots = n.slots > 0 ? n.slots : spec.nproc_per_node;
    for (int l = 0; l < slots; ++l) {
      WorkerSlot s;
      s.host = nodeName(spec, n);
      s.node_rank = static_cast<int>(i);
      s.local_rank = l;
      s.global_rank = plan.world_size++;
      s.device = n.gpus.empty() ? "auto" : fmt::format("cuda:{}", n.gpus[static_cast<size_t>(l) % n.gpus.size()]);
      plan.workers.push_back(s);
    }
  }
  return plan;
}

namespace detail {

int eventRound(int openRound, bool restartAnnounced) { return restartAnnounced ? openRound + 1 : openRound; }

// A vanished node makes its peers on the other nodes fail ("lost rank N"), and which report
// reaches the launcher first is a race: an agent killed, its ssh ends a network round trip
// later, while the collateral exit travels over another node's connection. The hold is short
// (its restart's back-off counts from the failure, and the default back-off, 1 s, covers it)
// and usually ends sooner: the nodes' workers are stopped at once, and once every node has
// said that they ended, no loss can be on its way. A node lost later than that (heartbeat
// silence, seconds away) is a separate report, after the failure's verdict.
bool heldFailureDue(std::chrono::steady_clock::time_point heldAt, std::chrono::steady_clock::time_point now,
                    bool everyNodeHeardFrom) {
  return everyNodeHeardFrom || now >= heldAt + kCollateralHold;
}

}  // namespace detail

RunResult runMultiNodeJob(spec::JobSpec& spec, const std::string& run_id, const MultiNodeOptions& opts) {
  std::vector<const spec::NodeSpec*> remotes;
  for (const auto& n : spec.nodes)
    if (!n.local) remotes.push_back(&n);
  int stoppedBy = 0;
  auto problems = preflight(spec, remotes, opts.version, stoppedBy);
  if (stoppedBy) {
    // Ended as a signal ends any later phase: 128 + signal, "stopped by ..." (said by main).
    RunResult r;
    r.received_signal = stoppedBy;
    r.exit_code = 128 + stoppedBy;
    return r;
  }
  // An elastic job (min_nodes below the host count) starts without hosts that cannot be
  // reached, as long as enough are left; they are tried again later. A host set up wrong
  // (no dtrain, another version) always stops the job: retrying cannot fix it.
  std::vector<const spec::NodeSpec*> excluded;
  bool fatal = std::any_of(problems.begin(), problems.end(), [](const Problem& p) { return !p.unreachable; });
  int usable = static_cast<int>(spec.nodes.size() - problems.size());
  if (!problems.empty()) {
    std::string table;
    for (const auto& p : problems) table += "\n  " + p.text;
    if (fatal || usable < spec.min_nodes)
      throw PreflightError(fmt::format("pre-flight failed for {} of {} remote host(s):{}", problems.size(), remotes.size(), table));
    console().write(STDERR_FILENO,
                    fmt::format("dtrain: pre-flight: {} host(s) unreachable; starting with {} (min_nodes {}), "
                                "retrying the others later:{}\n",
                                problems.size(), usable, spec.min_nodes, table));
    for (const auto& p : problems) excluded.push_back(p.node);
  }

  JobStore js = startJobStore(spec, remotes.empty() ? "127.0.0.1" : "0.0.0.0");

  // What every node runs: the resolved spec with the forwarded part of our environment
  // (the spec's own env wins), the working directory made explicit.
  spec::JobSpec shipped = spec;
  if (shipped.trainer) shipped.command.clear();  // each agent starts its own `dtrain train`
  for (const auto& [k, v] : currentEnvironment()) {
    for (const auto& prefix : spec.env_forward)
      if (k.rfind(prefix, 0) == 0 && !shipped.env.count(k) && spec::workerIdentityVar(k).empty()) shipped.env[k] = v;
  }
  // Relative paths mean what they mean here; agents start elsewhere (ssh: the home directory).
  if (shipped.cwd.empty()) shipped.cwd = std::filesystem::current_path().string();
  if (!shipped.log_dir.empty()) shipped.log_dir = std::filesystem::absolute(shipped.log_dir).string();
  // Remote workers' output reaches this console: they may draw a progress bar when it is a terminal.
  // ... and its size, less the widest "[node rank N] " of the job (the world at its largest),
  // unless the spec's env or the launcher's own sets it.
  if (consoleCanRedraw()) {
    shipped.env["DTRAIN_CONSOLE_TTY"] = "1";
    std::string widest;
    int world = 0;
    for (const auto& n : spec.nodes) {
      if (const std::string name = nodeName(spec, n); name.size() > widest.size()) widest = name;
      world += n.slots > 0 ? n.slots : std::max(1, spec.nproc_per_node);
    }
    addConsoleSize(shipped.env, currentEnvironment(),
                   spec.prefix_output ? fmt::format("[{} rank {}] ", widest, std::max(0, world - 1)).size() : 0);
  }
  {
    store::TcpStoreOptions co;
    co.host = "127.0.0.1";
    co.port = spec.rendezvous.port;
    co.token = js.token;
    store::TcpStore client(co);
    client.set("job/spec", spec::serializeForNode(shipped));
    client.set("job/source", spec.source.empty() ? "command line" : spec.source);
  }
  MultiNodeRunner runner(spec, opts, run_id, spec.rendezvous.port, js.token);
  return runner.run(excluded);
}

}  // namespace dtrain::launch
