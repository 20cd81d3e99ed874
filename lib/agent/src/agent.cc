#include "dtrain/agent/agent.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <cstdlib>
#include <filesystem>
#include <cctype>
#include <fstream>
#include <iostream>
#include <mutex>
#include <new>
#include <optional>
#include <sstream>
#include <thread>
#include <tuple>

#include <fmt/format.h>

#include "dtrain/common/errors.h"
#include "dtrain/common/files.h"
#include "dtrain/common/fd.h"
#include "dtrain/common/strings.h"
#include "dtrain/launch/agent_protocol.h"
#include "dtrain/launch/launcher.h"
#include "dtrain/launch/orphan_guard.h"
#include "dtrain/launch/output.h"
#include "dtrain/launch/plan.h"
#include "dtrain/launch/process.h"
#include "dtrain/rendezvous/rendezvous.h"
#include "dtrain/spec/job_spec.h"
#include "dtrain/store/tcp_store.h"
#include "dtrain/train/checkpoint.h"
#include "dtrain/train/data.h"
#include "dtrain/train/device.h"
#include "dtrain/train/memory_estimate.h"

namespace dtrain::agent {
namespace {

// The agent's private directory (its spec copy, the result file), once made: a stop that comes
// while the agent is still checking its host ends it at once (_exit, on the stdin thread),
// and removes that directory first. Its guard cannot be relied on for it: the launcher kills
// an ended agent's process group, the guard with it. Held across the directory's making, so
// that an exit never comes between the making and the registering.
std::mutex gPrivateDirMu;
std::string gPrivateDir;

[[noreturn]] void exitBeforeConnected(int code) {
  std::lock_guard<std::mutex> lk(gPrivateDirMu);  // (held to the end: nothing is made after)
  if (!gPrivateDir.empty()) {
    std::error_code ec;
    std::filesystem::remove_all(gPrivateDir, ec);
  }
  ::_exit(code);
}

using Clock = std::chrono::steady_clock;
namespace proto = launch::proto;

// A record for the launcher, on stdout (its pipe or ssh channel). Queued (launch::Console):
// a launcher that is slow to read, or holds our output back while its own console is
// stalled, must not stop this agent's event loop, which takes the launcher's commands and
// stops its workers. The local launcher's loop reads no more worker lines while this
// channel is backlogged, so the workers wait instead. main() waits for what is left before
// the agent exits.
void send(const std::string& rec) { launch::console().write(STDOUT_FILENO, rec); }

// Reads one '\n'-terminated line from fd without buffering past it (the rest of stdin
// belongs to the control thread). Empty optional on EOF, a read error, a line too long, or
// when `timeout` (none: wait as long as it takes) has passed.
std::optional<std::string> readLine(int fd, std::optional<std::chrono::milliseconds> timeout) {
  // Each poll waits at most an hour, then the deadline is looked at again: poll's int
  // milliseconds would wrap past 24.8 days, and a wrapped wait ends early, taken for EOF (a
  // launcher silent for 17 days through a long round was taken for lost).
  constexpr long long kMaxPollMs = 3600LL * 1000;
  std::string line;
  const auto deadline = timeout ? Clock::now() + *timeout : Clock::time_point::max();
  while (true) {
    long long left = kMaxPollMs;
    if (timeout) {
      left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
      if (left <= 0) return std::nullopt;
    }
    pollfd p{fd, POLLIN, 0};
    int n = ::poll(&p, 1, static_cast<int>(std::min(left, kMaxPollMs)));
    if (n < 0 && errno == EINTR) continue;
    if (n == 0) continue;  // (the deadline, if any, is looked at above)
    if (n < 0) return std::nullopt;
    char c;
    ssize_t got = ::read(fd, &c, 1);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) return std::nullopt;
    if (c == '\n') return line;
    line += c;
    if (line.size() > 4096) return std::nullopt;
  }
}

bool isLoopback(const std::string& addr) {
  return addr.empty() || addr.rfind("127.", 0) == 0 || addr == "::1" || addr == "localhost";
}

// The local address the kernel would use to reach `peer` (a UDP connect sends nothing).
std::string routeSource(const std::string& peer) {
  addrinfo hints{};
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* res = nullptr;
  if (::getaddrinfo(peer.c_str(), "9", &hints, &res) != 0 || !res) return "";
  std::string out;
  Fd fd(::socket(res->ai_family, SOCK_DGRAM | SOCK_CLOEXEC, 0));
  if (fd && ::connect(fd.get(), res->ai_addr, res->ai_addrlen) == 0) {
    sockaddr_storage ss{};
    socklen_t len = sizeof(ss);
    char buf[INET6_ADDRSTRLEN] = {0};
    if (::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&ss), &len) == 0 &&
        ::getnameinfo(reinterpret_cast<sockaddr*>(&ss), len, buf, sizeof(buf), nullptr, 0, NI_NUMERICHOST) == 0)
      out = buf;
  }
  ::freeaddrinfo(res);
  return out;
}

// A command from the launcher (agent_protocol.h).
struct Command {
  // kLost is not a word on the wire: the launcher or its store is gone (stdin EOF, no heartbeat).
  // kPassOn: a signal for the workers ("signal SIGUSR1"); never a step of the agent's own.
  enum Kind { kStop, kKill, kLost, kPause, kRestart, kExit, kPassOn } kind = kStop;
  int restart_count = 0;
  int nnodes = 0;
  // kPassOn: the signal to pass on. kStop: the one to stop the workers with ("stop SIGINT":
  // the user's Ctrl-C to dtrain run; 0 or SIGTERM: SIGTERM).
  int signal = 0;
  int round = -1;  // kRestart: the round to join (the launcher's openRound_); -1: the open one
};

std::optional<Command> parseCommand(const std::string& line) {
  auto w = split(line, ' ');
  if (w.empty()) return std::nullopt;
  if (auto sig = proto::stopSignal(line)) return Command{Command::kStop, 0, 0, *sig};
  if (w[0] == "kill") return Command{Command::kKill};
  if (w[0] == "pause") return Command{Command::kPause};
  if (w[0] == "exit") return Command{Command::kExit};
  if (w[0] == "signal" && w.size() == 2 && (w[1] == "SIGUSR1" || w[1] == "SIGUSR2"))
    return Command{Command::kPassOn, 0, 0, w[1] == "SIGUSR1" ? SIGUSR1 : SIGUSR2};
  if (w[0] == "restart" && (w.size() == 3 || w.size() == 4)) {
    try {
      return Command{Command::kRestart, std::stoi(w[1]), std::stoi(w[2]), 0, w.size() == 4 ? std::stoi(w[3]) : -1};
    } catch (...) {
    }
  }
  return std::nullopt;
}

// Commands from the stdin thread (and the heartbeat thread, which posts kLost when the
// store is gone) to the main thread. A pipe byte per command wakes LocalLauncher's poll;
// every command taken (pop, takePassOn, dropPassOns) reads one, so the pipe is readable
// exactly while one waits. Signals to pass on are kept apart: they are no step of the agent
// (pending() and pop() do not see them, so they never end a rendezvous or a round).
// Thread-safety: post() from any thread; the rest from the main thread.
class Control {
 public:
  Control() { std::tie(r_, w_) = launch::makePipe(); }
  void post(Command c) {
    {
      std::lock_guard<std::mutex> lk(mu_);
      (c.kind == Command::kPassOn ? passOn_ : q_).push_back(c);
    }
    cv_.notify_all();
    char b = 1;
    (void)!::write(w_.get(), &b, 1);
  }
  // The oldest signal to pass on, or 0.
  int takePassOn() {
    std::lock_guard<std::mutex> lk(mu_);
    if (passOn_.empty()) return 0;
    const int sig = passOn_.front().signal;
    passOn_.pop_front();
    char b;
    (void)!::read(r_.get(), &b, 1);
    return sig;
  }
  // Signals that arrived while no worker ran (between rounds) are not for the next round's.
  void dropPassOns() {
    while (takePassOn() != 0) {
    }
  }
  int fd() const { return r_.get(); }
  bool pending() {
    std::lock_guard<std::mutex> lk(mu_);
    return !q_.empty();
  }
  // Blocks until a command is there.
  Command pop() {
    std::unique_lock<std::mutex> lk(mu_);
    cv_.wait(lk, [&] { return !q_.empty(); });
    Command c = q_.front();
    q_.pop_front();
    char b;
    (void)!::read(r_.get(), &b, 1);
    return c;
  }

 private:
  Fd r_, w_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Command> q_, passOn_;
};

struct Failure {
  std::string kind;  // spec | timeout | io
  std::string message;
};

int fail(const Failure& f) {
  send(proto::record('F', {f.kind, f.message}));
  return f.kind == "spec" ? kExitUsage : kExitFailure;
}

std::string storeAddrFromSsh() {
  // "client_ip client_port server_ip server_port": the launcher as this host sees it, when
  // ssh came straight from it. Through a jump host (ssh -J, ProxyJump, ProxyCommand) it is
  // the jump host's address; the launcher cannot know which of its own addresses a node
  // reaches, so rendezvous.addr (--store-addr) says it. A wrong address is no attack: the
  // store must prove the job token (docs/store-protocol.md), so the agent fails, naming it.
  const char* c = std::getenv("SSH_CONNECTION");
  if (!c) return "";
  auto parts = split(c, ' ');
  return parts.empty() ? "" : parts[0];
}

// Test hooks: DTRAIN_TEST_REPORT_DELAY="<node>:<ms>[@<round>]" holds that node's report of a
// started round (only of that round, with @) back, staging a node that is slow to start its
// workers (tests/e2e/elastic.sh, tests/e2e/elastic_events.sh); DTRAIN_TEST_JOIN_DELAY, the
// same for its joining a round (a host slow to start its agent: tests/e2e/multinode_local.sh).
void delayForTests(const char* var, const std::string& node, int round, const std::function<bool()>& stop = {}) {
  const char* v = std::getenv(var);
  if (!v) return;
  // ("<node>:<ms>[@round]", several separated by commas)
  long ms = 0;
  for (std::string s : split(v, ',')) {
    if (auto at = s.rfind('@'); at != std::string::npos) {
      if (s.substr(at + 1) != std::to_string(round)) continue;
      s.resize(at);
    }
    auto colon = s.rfind(':');
    if (colon == std::string::npos || s.substr(0, colon) != node) continue;
    char* end = nullptr;
    ms = std::strtol(s.c_str() + colon + 1, &end, 10);
    if (!end || *end != '\0' || ms <= 0 || ms > 60000) ms = 0;
    break;
  }
  if (ms <= 0) return;
  // (in slices: a stop from the launcher ends the wait, as it would end what it stages)
  for (const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(ms);
       std::chrono::steady_clock::now() < until && !(stop && stop());)
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
}

// Removes the private files (spec snapshot, result file) that agents of this user left in
// `dir` when they died without their cleanup: a whole host killed (the guard with them), or
// one killed before it had a guard. Only dtrain's exact names: an agent's private directory
// "dtrain-<12 hex run id>-<pid place>-<pid>-XXXXXX" (ownedFilePrefix), or its files before
// there was one, "dtrain-[result-]<run id>-<pid place>-<pid>.json"; see
// removeStaleOwnedFiles for which are taken as stale.
void removeStaleAgentFiles(const std::filesystem::path& dir) {
  removeStaleOwnedFiles(dir, {"dtrain-", "dtrain-result-"});
}

// A trainer job this host cannot hold is said before the rendezvous, as this node's error
// (SpecError, "<spec>: <field>: this job needs about ... on this host ..."), as the launcher
// says it for a local job: not as its workers' allocation failures, or the OOM killer's
// SIGKILLs, after the launch, with a restart spent on each. The world is settled by the
// rendezvous: taken as nnodes x this node's workers, this node's ranks from its hostfile
// position (what a worker's estimate depends on: the layout of a pipeline's stages, rank 0's
// extra copies), which is the job's when the hosts have equal slots.
void checkNodeMemory(const spec::JobSpec& spec, const AgentOptions& opts, const train::Datasets& sets,
                     const train::DataImage& image, const MemoryAvailability& available) {
  const spec::TrainerSpec& t = *spec.trainer;
  train::MemoryLayout l;
  l.workers = spec.nproc_per_node;
  l.world = std::max(1, opts.nnodes) * l.workers;
  l.first_rank = std::max(0, opts.order) * l.workers;
  if (l.workers < 1 || l.world % std::max(1, t.parallel.pipeline_stages) != 0) return;
  try {
    l.gpu = train::resolveDevice(t.device, 0, l.workers).cuda;
  } catch (const SpecError&) {
    return;  // (no device: that error is the workers', said by their own check)
  }
  if (t.data.type != "synthetic") {
    l.data_rows = sets.train->size() + sets.eval->size();
    l.data_shared = static_cast<bool>(image.fd);
  }
  l.eval_rows = static_cast<long long>(sets.eval->size());
  // (the checkpoint is read on node 0 only)
  l.checkpoint_to_read = opts.order == 0 && !t.checkpoint.dir.empty() && train::holdsCheckpointFiles(t.checkpoint.dir);
  train::checkHostMemory(t, l, available, spec.source);
}

}  // namespace

int runAgent(const AgentOptions& opts) {
  ::signal(SIGPIPE, SIG_IGN);
  auto tokenLine = readLine(STDIN_FILENO, std::chrono::seconds(30));
  if (!tokenLine || tokenLine->rfind("token ", 0) != 0)
    return fail({"spec", "dtrain agent: expected \"token <secret>\" on stdin; the agent is started by dtrain run, not by hand"});
  std::string token = tokenLine->substr(6);

  std::string storeAddr = opts.store_addr.empty() ? storeAddrFromSsh() : opts.store_addr;
  if (storeAddr.empty())
    return fail({"spec", "dtrain agent: no --store-addr and no SSH_CONNECTION to learn the launcher's address from; "
                         "set rendezvous.addr in the job spec"});

  // Shared with a detached thread that may outlive this frame while the process exits.
  // Until connected (nothing started yet), a stop or a lost launcher just ends the agent.
  auto connectedPtr = std::make_shared<std::atomic<bool>>(false);
  auto controlPtr = std::make_shared<Control>();
  auto& connected = *connectedPtr;
  auto& control = *controlPtr;
  std::thread([controlPtr, connectedPtr] {
    while (true) {
      auto line = readLine(STDIN_FILENO, std::nullopt);  // (the launcher speaks only on events)
      if (!line) {
        if (!*connectedPtr) exitBeforeConnected(128 + SIGHUP);
        controlPtr->post({Command::kLost});
        return;
      }
      auto cmd = parseCommand(*line);
      if (!cmd) continue;
      if (!*connectedPtr && (cmd->kind == Command::kStop || cmd->kind == Command::kKill))
        exitBeforeConnected(128 + SIGTERM);
      controlPtr->post(*cmd);
    }
  }).detach();

  // A host coming back (--wait) that cannot run the job's workers (it cannot reach the
  // launcher's store; its data files, its program or its temp dir are not usable): it did
  // not come back, like a host that does not answer. The job goes on without it and the
  // launcher tries it again later (its host_excluded event says this line); it is no reason
  // to end a job that runs well elsewhere. At the job's start it is the job's error.
  auto preflightFailed = [&](const Failure& f) {
    if (!opts.wait) return fail(f);
    std::cerr << f.message << "\n";
    return f.kind == "spec" ? kExitUsage : kExitFailure;
  };
  std::shared_ptr<store::TcpStore> st;
  spec::JobSpec spec;
  std::string specText;
  bool reached = false;  // connected and authenticated
  try {
    store::TcpStoreOptions so;
    so.host = storeAddr;
    so.port = opts.store_port;
    so.token = token;
    so.connect_timeout = std::chrono::seconds(30);
    st = std::make_shared<store::TcpStore>(so);
    reached = true;
    specText = st->get("job/spec");
    std::string source = st->get("job/source");
    spec = spec::parseJobSpec(specText, source);
  } catch (const SpecError& e) {
    return preflightFailed({"spec", fmt::format("node {}: {}", opts.node, e.what())});
  } catch (const IoError& e) {
    // The address was a guess from SSH_CONNECTION: say where it came from and how to give it.
    std::string hint = opts.store_addr.empty() && !reached
                           ? fmt::format(" ({} is the ssh client's address as this host sees it (SSH_CONNECTION); "
                                         "through a jump host that is the jump host, not the launcher: set "
                                         "rendezvous.addr to the launcher's address as this host reaches it)",
                                         storeAddr)
                           : std::string();
    return preflightFailed({"io", fmt::format("node {}: {}{}", opts.node, e.what(), hint)});
  } catch (const std::exception& e) {
    return preflightFailed({"io", fmt::format("node {}: cannot use the launcher's store at {}:{}: {}", opts.node,
                                              storeAddr, opts.store_port, e.what())});
  }
  // (`connected` is set once the checks below are done: until then a stop from the launcher
  // or its end ends this agent at once, also in the middle of a long parse of the data files,
  // as before the connection; its guard removes the files it made)

  if (!opts.gpus.empty()) {
    std::vector<std::string> g;
    for (int i : opts.gpus) g.push_back(std::to_string(i));
    std::string cvd = fmt::format("{}", fmt::join(g, ","));
    ::setenv("CUDA_VISIBLE_DEVICES", cvd.c_str(), 1);
    spec.env["CUDA_VISIBLE_DEVICES"] = cvd;
  }
  if (opts.nproc > 0) {
    spec.nproc_per_node = opts.nproc;
    spec.nproc_auto = false;
  }
  std::string resultFile;
  std::string specFile;
  std::string privateDir;  // holds both (makePrivateDirectory): nobody else can put a link or a file there
  // Registered with a guard of the agent's own before they are written: the agent may be
  // killed at any point (while it waits for the rendezvous, between rounds) and the guard
  // then removes them. A guard dies with its host, so an agent also removes what dead agents
  // left here.
  std::optional<launch::OrphanGuard> fileGuard;
  Fd checkpointLock;  // node 0: the checkpoint directory's lock, held for the job
  train::DataImage dataImage;  // this host's workers map it, every round (train/data.h)
  // This node's copies (the spec may carry secrets) go however the agent ends: a refusal at
  // startup (a checkpoint dir it cannot use) returned with them left in /tmp.
  struct RemoveAtEnd {
    const std::string& dir;
    ~RemoveAtEnd() {
      std::error_code ec;
      if (!dir.empty()) std::filesystem::remove_all(dir, ec);
    }
  } removeAtEnd{privateDir};
  {
    // (an unusable temp dir is the job's error only where the job needs it: below)
    if (tempDirectoryProblem().empty()) removeStaleAgentFiles(tempDirectory());
  }
  try {
    spec::resolve(spec);
    // This host's workers' error files live in its temp dir (the launcher's local job too):
    // an unusable TMPDIR here is said now, as this node's error, before the rendezvous.
    tempDirectory();
    if (spec.trainer) {
      // The trainer reads its spec from a file: this node's copy of what the launcher sent.
      fileGuard.emplace();
      {
        std::lock_guard<std::mutex> lk(gPrivateDirMu);
        privateDir = makePrivateDirectory(ownedFilePrefix("dtrain-", opts.run_id));
        gPrivateDir = privateDir;
      }
      fileGuard->removeIfKilled(privateDir);
      specFile = (std::filesystem::path(privateDir) / "spec.json").string();
      resultFile = (std::filesystem::path(privateDir) / "result.json").string();
      writePrivateFile(specFile, specText);  // its env may carry secrets
      spec.env["DTRAIN_RESULT_FILE"] = resultFile;
      spec.command = {launch::selfExecutable(), "train", specFile};
      // Rank 0 writes checkpoints on node 0's host: the first node's agent makes sure it can
      // (and that they are this config's) before any worker starts, as the launcher does for
      // a local job; else the run's work is lost at its first save.
      // (an agent started again here, after this host was lost, may find its predecessor still
      // tearing down with the lock: waited for over that teardown's grace)
      // (a host coming back, --wait, takes it at the start of a round that makes it node 0,
      // below: another node may hold it for this job until that round)
      if (opts.order == 0 && !opts.wait)
        checkpointLock = train::prepareCheckpointDir(*spec.trainer, spec.source, spec.shutdown_timeout_s + 5);
      // This host's data files, parsed once here for its workers (the data image), as the
      // launcher does for a local job: bad or missing data on this host is said now, as this
      // node's error, before the rendezvous, rather than by every worker after it.
      // (what is available is taken before the parse: the image it leaves is counted once
      // as the workers' data, and a parse without one is gone before they start)
      const MemoryAvailability availability = memoryAvailability();
      train::SharedDatasets parsed = train::openSharedDatasets(*spec.trainer, {}, opts.data_share);
      dataImage = std::move(parsed.image);
      if (!dataImage.problem.empty())
        std::cerr << "warning: each worker on this host parses the data files itself: its agent could not share "
                     "its parse ("
                  << dataImage.problem << ")\n";
      if (opts.memory_check) checkNodeMemory(spec, opts, parsed.sets, dataImage, availability);
    } else if (!spec.command.empty()) {
      // The program must be one exec can run on this host: said once, as the job's error,
      // rather than as exit 127 from every rank here and a restart budget spent on it.
      const std::string where = spec.source.empty() || spec.source == "command line" ? std::string("the command after --")
                                                                                      : spec.source + ": /command/0";
      const std::string found = launch::findWorkerProgram(spec.command[0], spec.env, spec.cwd);
      if (found.empty())
        throw SpecError(fmt::format("{}: cannot run \"{}\" on this host: {}", where, spec.command[0],
                                    spec.command[0].find('/') != std::string::npos
                                        ? std::string("no such executable file; check the path")
                                        : fmt::format("no such program on its PATH{}; check the name, or give its path",
                                                      launch::missingProgramHint(spec.command[0], spec.env, spec.cwd))));
      if (const std::string why = launch::workerShebangProblem(found, spec.env, spec.cwd); !why.empty())
        throw SpecError(fmt::format("{}: cannot run \"{}\" on this host: {}", where, spec.command[0], why));
    }
  } catch (const SpecError& e) {
    return preflightFailed({"spec", fmt::format("node {}: {}", opts.node, e.what())});
  } catch (const std::bad_alloc&) {
    return preflightFailed({"io", fmt::format("node {}: not enough memory on this host to read the job's data files "
                                              "(the agent parses them once for its workers)",
                                              opts.node)});
  }
  connected = true;

  // Heartbeats (the launcher's liveness check of this node) double as our check that the
  // launcher and its store are still there: gone for store_lost_s -> like stdin EOF.
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  std::atomic<bool> storeLost{false};  // the heartbeat gave up (not stdin EOF)
  // The first beat before anything is reported, so that a host coming back is never judged
  // by its counter from before it was lost.
  try {
    rendezvous::HeartbeatMonitor::beat(*st, opts.run_id, opts.node);
  } catch (const std::exception&) {
  }
  // The beats go over a connection of their own, with every wait bounded by what is left of
  // store_lost_s since the last beat that got through: on the shared client a beat waited
  // behind the main thread's calls (a rendezvous wait holds it), and a store cut off the
  // network held a beat (or a reconnect) for that client's 30 s timeouts, so a host lost its
  // store for ~30 s before its workers were stopped. A store slow to answer but answering
  // within the budget is still alive.
  std::thread heart([&] {
    const auto budget = std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(opts.store_lost_s));
    auto lastOk = Clock::now();
    std::unique_ptr<store::TcpStore> hb;
    // One beat with at most `t` for the connection and the call.
    auto beatWithin = [&](store::Duration t) {
      if (!hb) {
        store::TcpStoreOptions so;
        so.host = storeAddr;
        so.port = opts.store_port;
        so.token = token;
        so.connect_timeout = t;
        so.request_timeout = t;
        hb = std::make_unique<store::TcpStore>(so);
      }
      hb->setRequestTimeout(t);
      rendezvous::HeartbeatMonitor::beat(*hb, opts.run_id, opts.node);
    };
    std::unique_lock<std::mutex> lk(mu);
    while (!cv.wait_for(lk, std::chrono::milliseconds(500), [&] { return done; })) {
      lk.unlock();
      try {
        const auto left = std::chrono::duration_cast<store::Duration>(lastOk + budget - Clock::now());
        if (left <= store::Duration::zero()) throw IoError("store unreachable");
        beatWithin(left);
        lastOk = Clock::now();
      } catch (const std::exception&) {
        hb.reset();  // a connection that failed a call is gone; a new one next time
        if (Clock::now() - lastOk >= budget) {
          // Before the store is called lost, one more try of its own (a new connection, up to
          // 2 s): this agent may have been stopped itself (SIGSTOP, a paused VM, a host
          // swapping hard), its pause counted as the store's silence; a store that answers
          // now is there.
          bool answered = false;
          try {
            beatWithin(std::chrono::duration_cast<store::Duration>(std::min<Clock::duration>(budget, std::chrono::seconds(2))));
            answered = true;
          } catch (const std::exception&) {
            hb.reset();
          }
          if (answered) {
            lastOk = Clock::now();
          } else {
            storeLost = true;
            // On stderr: the launcher names it as why this node was lost, if it hears of it.
            launch::console().write(STDERR_FILENO,
                                    fmt::format("the launcher's store at {}:{} did not answer for {:g} s; stopping "
                                                "this node's workers\n",
                                                storeAddr, opts.store_port, opts.store_lost_s));
            control.post({Command::kLost});
            lk.lock();
            return;
          }
        }
      }
      lk.lock();
    }
  });
  auto stopHeart = [&] {
    {
      std::lock_guard<std::mutex> lk(mu);
      done = true;
    }
    cv.notify_all();
    heart.join();
  };

  int rc = kExitOk;
  int restartCount = 0;
  int nnodes = opts.nnodes;
  std::optional<Command> next;  // what to do after the current round
  if (opts.wait) {
    // A host coming back: ready, and admitted by the launcher's next "restart".
    send(proto::record('W', {opts.node}));
    next = control.pop();
  } else {
    next = Command{Command::kRestart, 0, nnodes, 0, 0};  // (round 0: the first one)
  }
  while (next && next->kind == Command::kRestart) {
    restartCount = next->restart_count;
    nnodes = next->nnodes;
    const int targetRound = next->round;
    next.reset();
    launch::Plan plan;
    rendezvous::RoundResult round;
    try {
      rendezvous::RendezvousOptions ro;
      ro.run_id = opts.run_id;
      ro.min_nodes = ro.max_nodes = nnodes;
      ro.join_timeout = std::chrono::milliseconds(static_cast<long>((spec.rendezvous.timeout_s + opts.join_grace_s) * 1000));
      ro.last_call = std::chrono::milliseconds(0);
      ro.should_abort = [&control] { return control.pending(); };
      // (the round the launcher named: a late start does not take a place in a later round
      // it was not told of, and leave it there when the launcher's word comes)
      ro.round = targetRound;
      rendezvous::NodeInfo self;
      self.name = opts.node;
      self.nproc = spec.nproc_per_node;
      self.order = opts.order;
      self.addr = opts.address.empty() ? st->localAddress() : opts.address;
      rendezvous::Rendezvous rdzv(st, ro, self);
      delayForTests("DTRAIN_TEST_JOIN_DELAY", opts.node, restartCount, [&control] { return control.pending(); });
      round = rdzv.join();

      // Node 0 names the master: its address as the others reach it, and a port free here.
      std::string masterKey = fmt::format("job/r/{}/master", round.round);
      if (round.node_rank == 0) {
        std::string addr = spec.rendezvous.master_addr.empty() ? self.addr : spec.rendezvous.master_addr;
        if (isLoopback(addr)) {
          // A local node reached the store over loopback: use the route toward another node.
          for (const auto& n : round.nodes)
            if (!isLoopback(n.addr)) {
              std::string src = routeSource(n.addr);
              if (!src.empty()) addr = src;
              break;
            }
        }
        st->set(masterKey, fmt::format("{}\t{}", addr, launch::pickFreePort(spec.rendezvous.port)));
        // Node 0 of a later round on another host than the first (that one was lost, or has
        // come back): its rank 0 writes the checkpoints now, here, so this agent takes the
        // directory's lock and checks it can write there, as the first node's did; else a
        // second job was let onto the directory. Waited for briefly (the node 0 of the round
        // before lets it go as this round starts, below), never fatal: a lock still held (the
        // lost node's agent, frozen with it on a shared file system; or another job) is
        // said, and the job goes on, as it would have.
        if (spec.trainer && !spec.trainer->checkpoint.dir.empty() && !checkpointLock) {
          try {
            checkpointLock = train::prepareCheckpointDir(*spec.trainer, spec.source, 5);
          } catch (const std::exception& e) {
            std::cerr << "warning: node " << opts.node << " runs rank 0 of round " << round.round
                      << " and could not take the checkpoint directory for this job: " << e.what() << std::endl;
          }
        }
      } else {
        checkpointLock.reset();  // (rank 0 writes elsewhere this round: that node's agent takes it)
      }
      // Waited for in short slices: a stop from the launcher (the round's node 0 failed, or is
      // gone: nobody will name the master) ends the wait, as it ends the rendezvous's.
      for (const auto until = Clock::now() + store::kDefaultTimeout;;) {
        try {
          st->wait({masterKey}, std::chrono::milliseconds(200));
          break;
        } catch (const TimeoutError&) {
          if (control.pending()) throw rendezvous::RendezvousAborted("stopped while waiting for the round's master");
          if (Clock::now() >= until) throw;
        }
      }
      auto master = split(st->get(masterKey), '\t');
      DTRAIN_CHECK(master.size() == 2);

      plan.run_id = opts.run_id;
      plan.round = round.round;
      plan.nnodes = round.nnodes;
      plan.world_size = round.world_size;
      plan.local_world_size = spec.nproc_per_node;
      plan.master_addr = master[0];
      plan.master_port = std::stoi(master[1]);
      plan.store_addr = storeAddr;
      plan.store_port = opts.store_port;
      plan.store_token = token;
      int gpus = spec::visibleGpuCount();
      for (int i = 0; i < spec.nproc_per_node; ++i) {
        launch::WorkerSlot s;
        s.host = opts.node;
        s.node_rank = round.node_rank;
        s.local_rank = i;
        s.global_rank = round.rank_offset + i;
        s.device = gpus > 0 ? fmt::format("cuda:{}", i % gpus) : "cpu";
        plan.workers.push_back(s);
      }
    } catch (const rendezvous::RendezvousAborted&) {
      next = control.pop();  // the launcher changed its mind: do what it says now
      if (next->kind == Command::kPause) next = control.pop();
      continue;
    } catch (const TimeoutError& e) {
      // A round that did not form is the round's, not this node's: the nodes not joined are
      // named, this one only saw it. (Any other timeout here is this node's.)
      const std::string what = e.what();
      rc = fail({"timeout", what.rfind("rendezvous round ", 0) == 0
                                ? fmt::format("{} (as node {} saw it)", what, opts.node)
                                : fmt::format("node {}: {}", opts.node, what)});
      break;
    } catch (const std::exception& e) {
      rc = fail({"io", fmt::format("node {}: rendezvous failed: {}", opts.node, e.what())});
      break;
    }
    delayForTests("DTRAIN_TEST_REPORT_DELAY", opts.node, round.round);
    send(proto::record('N', {std::to_string(round.node_rank), std::to_string(round.nnodes),
                             std::to_string(round.world_size), std::to_string(round.rank_offset), plan.master_addr,
                             std::to_string(plan.master_port), std::to_string(round.round),
                             std::to_string(plan.workers.size())}));

    // A data file changed since this host's image was made (between rounds: no worker maps it
    // now): made again, or the workers would each parse the files on top of the stale one.
    // (a data file that cannot be read again, or no memory for it: this node's failure, said
    // as the start's is; not an exception past the heartbeat thread, a std::terminate)
    try {
      if (spec.trainer && dataImage.fd)
        if (const std::string changed = train::refreshDataImage(*spec.trainer, dataImage); !changed.empty())
          std::cerr << fmt::format("round {}: {}\n", round.round, changed);
    } catch (const SpecError& e) {
      rc = fail({"spec", fmt::format("node {}: {}", opts.node, e.what())});
      break;
    } catch (const std::exception& e) {
      rc = fail({"io", fmt::format("node {}: the training data could not be read again for round {}: {}", opts.node,
                                   round.round, e.what())});
      break;
    }
    launch::LocalRunOptions lo;
    lo.line_sink = [](const launch::WorkerSlot& s, bool isErr, std::string_view line) {
      send(proto::record(isErr ? 'E' : 'O', {std::to_string(s.global_rank), std::to_string(s.local_rank), std::string(line)}));
    };
    lo.on_exit = [](const launch::WorkerExit& w) { send(proto::exitRecord(w)); };
    lo.control_fd = control.fd();
    control.dropPassOns();
    // Any command ends this round's workers; what comes next is decided after they are down.
    lo.on_control = [&control, &next]() {
      if (const int sig = control.takePassOn())
        return sig == SIGUSR1 ? launch::ControlAction::kPassOnUsr1 : launch::ControlAction::kPassOnUsr2;
      if (!control.pending()) return launch::ControlAction::kNone;
      Command c = control.pop();
      // A later word replaces an earlier one (pause -> restart), but stop, kill and lost stand.
      if (!next || (next->kind != Command::kStop && next->kind != Command::kKill && next->kind != Command::kLost)) next = c;
      if (c.kind == Command::kKill) return launch::ControlAction::kKill;
      if (c.kind == Command::kLost) return launch::ControlAction::kLost;
      // The launcher's stop passes on the signal dtrain run got (SIGINT for a Ctrl-C, SIGHUP);
      // its own stops (a failure, a lost node) and a pause are SIGTERM.
      return launch::stopAction(c.kind == Command::kStop ? c.signal : SIGTERM);
    };
    lo.restart_count = restartCount;
    lo.merge_output = opts.merge_output;
    lo.remove_if_killed = {privateDir};
    lo.other_nodes = plan.nnodes > 1;
    if (dataImage.fd) lo.inherit_fds.emplace_back(train::kDataImageEnv, dataImage.fd.get());
    try {
      launch::RunResult result = launch::makeLocalLauncher(lo)->run(plan, spec);
      rc = result.exit_code;
    } catch (const std::exception& e) {
      rc = fail({"io", fmt::format("node {}: {}", opts.node, e.what())});
      break;
    }
    // Workers this node stopped because the store was gone ended "stopped by dtrain", the
    // round's code 0: a launcher that was only stalled (SIGSTOP) and reads on must not take
    // that for a round that succeeded. Not 0, it waits for this agent's end: a lost node.
    if (storeLost && rc == kExitOk) rc = kExitFailure;
    // The trainer's outcome before the round's end: the launcher may start the next round
    // once every node's end is in, and an outcome read after that round began would stand
    // for it.
    if (!resultFile.empty()) {
      std::ifstream in(resultFile);
      if (in) {
        std::stringstream ss;
        ss << in.rdbuf();
        send(proto::record('T', {ss.str()}));
      }
      std::remove(resultFile.c_str());
    }
    send(proto::record('D', {std::to_string(rc), std::to_string(round.round)}));
    // Idle until the launcher decides: another round, or the end.
    while (!next || next->kind == Command::kPause) next = control.pop();
  }
  stopHeart();
  if (storeLost && rc == kExitOk) rc = kExitFailure;
  if (!specFile.empty()) std::remove(specFile.c_str());
  return rc;
}

}  // namespace dtrain::agent
