#include "dtrain/agent/agent.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <sstream>
#include <thread>

#include <fmt/format.h>

#include "dtrain/common/errors.h"
#include "dtrain/common/fd.h"
#include "dtrain/common/strings.h"
#include "dtrain/launch/agent_protocol.h"
#include "dtrain/launch/launcher.h"
#include "dtrain/launch/output.h"
#include "dtrain/launch/plan.h"
#include "dtrain/launch/process.h"
#include "dtrain/rendezvous/rendezvous.h"
#include "dtrain/spec/job_spec.h"
#include "dtrain/store/tcp_store.h"

namespace dtrain::agent {
namespace {

using Clock = std::chrono::steady_clock;
namespace proto = launch::proto;

void send(const std::string& rec) { launch::writeAll(STDOUT_FILENO, rec); }

// Reads one '\n'-terminated line from fd without buffering past it (the rest of stdin
// belongs to the control thread). Empty optional on EOF or timeout.
std::optional<std::string> readLine(int fd, std::chrono::milliseconds timeout) {
  std::string line;
  auto deadline = Clock::now() + timeout;
  while (true) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    if (left <= 0) return std::nullopt;
    pollfd p{fd, POLLIN, 0};
    int n = ::poll(&p, 1, static_cast<int>(left));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return std::nullopt;
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

// Control commands reach the launcher loop through a pipe: 'S' stop, 'K' kill (launcher
// gone). Written by the stdin and heartbeat threads, read by LocalLauncher's poll loop.
class Control {
 public:
  Control() { std::tie(r_, w_) = launch::makePipe(); }
  void post(char c) { (void)!::write(w_.get(), &c, 1); }
  int fd() const { return r_.get(); }
  launch::ControlAction take() {
    char c = 0;
    if (::read(r_.get(), &c, 1) != 1) return launch::ControlAction::kNone;
    return c == 'S' ? launch::ControlAction::kStop : launch::ControlAction::kKill;
  }

 private:
  Fd r_, w_;
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
  // "client_ip client_port server_ip server_port": the launcher as this host sees it.
  const char* c = std::getenv("SSH_CONNECTION");
  if (!c) return "";
  auto parts = split(c, ' ');
  return parts.empty() ? "" : parts[0];
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

  // Before the workers exist, a stop or a lost launcher just ends the agent.
  // Shared with a detached thread that may outlive this frame while the process exits.
  auto launchedPtr = std::make_shared<std::atomic<bool>>(false);
  auto controlPtr = std::make_shared<Control>();
  auto& launched = *launchedPtr;
  auto& control = *controlPtr;
  std::thread([controlPtr, launchedPtr] {
    auto& control = *controlPtr;
    auto& launched = *launchedPtr;
    while (true) {
      auto line = readLine(STDIN_FILENO, std::chrono::hours(24 * 365));
      if (!line) {
        if (!launched) ::_exit(128 + SIGHUP);
        control.post('K');
        return;
      }
      if (*line == "stop" || *line == "kill") {
        if (!launched) ::_exit(128 + SIGTERM);
        control.post(*line == "stop" ? 'S' : 'K');
      }
    }
  }).detach();

  std::shared_ptr<store::TcpStore> st;
  spec::JobSpec spec;
  std::string specText;
  try {
    store::TcpStoreOptions so;
    so.host = storeAddr;
    so.port = opts.store_port;
    so.token = token;
    so.connect_timeout = std::chrono::seconds(30);
    st = std::make_shared<store::TcpStore>(so);
    specText = st->get("job/spec");
    std::string source = st->get("job/source");
    spec = spec::parseJobSpec(specText, source);
  } catch (const SpecError& e) {
    return fail({"spec", fmt::format("node {}: {}", opts.node, e.what())});
  } catch (const std::exception& e) {
    return fail({"io", fmt::format("node {}: cannot use the launcher's store at {}:{}: {}", opts.node, storeAddr,
                                   opts.store_port, e.what())});
  }

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
  try {
    spec::resolve(spec);
    if (spec.trainer) {
      // The trainer reads its spec from a file: this node's copy of what the launcher sent.
      auto tmp = std::filesystem::temp_directory_path();
      specFile = (tmp / fmt::format("dtrain-{}-{}.json", opts.run_id, ::getpid())).string();
      std::ofstream(specFile) << specText;
      resultFile = (tmp / fmt::format("dtrain-result-{}-{}.json", opts.run_id, ::getpid())).string();
      spec.env["DTRAIN_RESULT_FILE"] = resultFile;
      spec.command = {launch::selfExecutable(), "train", specFile};
    }
  } catch (const SpecError& e) {
    return fail({"spec", fmt::format("node {}: {}", opts.node, e.what())});
  }

  launch::Plan plan;
  rendezvous::RoundResult round;
  try {
    rendezvous::RendezvousOptions ro;
    ro.run_id = opts.run_id;
    ro.min_nodes = ro.max_nodes = opts.nnodes;
    ro.join_timeout = std::chrono::seconds(spec.rendezvous.timeout_s);
    ro.last_call = std::chrono::milliseconds(0);
    rendezvous::NodeInfo self;
    self.name = opts.node;
    self.nproc = spec.nproc_per_node;
    self.order = opts.order;
    self.addr = opts.address.empty() ? st->localAddress() : opts.address;
    rendezvous::Rendezvous rdzv(st, ro, self);
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
    }
    auto master = split(st->get(masterKey), '\t');
    DTRAIN_CHECK(master.size() == 2);

    plan.run_id = opts.run_id;
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
  } catch (const TimeoutError& e) {
    return fail({"timeout", fmt::format("node {}: {}", opts.node, e.what())});
  } catch (const std::exception& e) {
    return fail({"io", fmt::format("node {}: rendezvous failed: {}", opts.node, e.what())});
  }
  send(proto::record('N', {std::to_string(round.node_rank), std::to_string(round.nnodes),
                           std::to_string(round.world_size), std::to_string(round.rank_offset), plan.master_addr,
                           std::to_string(plan.master_port), std::to_string(round.round)}));

  // Heartbeats double as the check that the launcher (and its store) is still there.
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  std::thread heart([&] {
    auto lastOk = Clock::now();
    std::unique_lock<std::mutex> lk(mu);
    while (!cv.wait_for(lk, std::chrono::milliseconds(500), [&] { return done; })) {
      lk.unlock();
      try {
        rendezvous::HeartbeatMonitor::beat(*st, opts.run_id, opts.node);
        lastOk = Clock::now();
      } catch (const std::exception&) {
        if (Clock::now() - lastOk > std::chrono::duration<double>(opts.store_lost_s)) {
          control.post('K');
          lk.lock();
          return;
        }
      }
      lk.lock();
    }
  });

  launch::LocalRunOptions lo;
  lo.line_sink = [](const launch::WorkerSlot& s, bool isErr, std::string_view line) {
    send(proto::record(isErr ? 'E' : 'O', {std::to_string(s.global_rank), std::to_string(s.local_rank), std::string(line)}));
  };
  lo.on_exit = [](const launch::WorkerExit& w) { send(proto::exitRecord(w)); };
  lo.control_fd = control.fd();
  lo.on_control = [&control] { return control.take(); };
  launched = true;
  launch::RunResult result;
  int rc = kExitFailure;
  try {
    result = launch::makeLocalLauncher(lo)->run(plan, spec);
    rc = result.exit_code;
  } catch (const std::exception& e) {
    rc = fail({"io", fmt::format("node {}: {}", opts.node, e.what())});
  }
  {
    std::lock_guard<std::mutex> lk(mu);
    done = true;
  }
  cv.notify_all();
  heart.join();
  if (!resultFile.empty()) {
    std::ifstream in(resultFile);
    if (in) {
      std::stringstream ss;
      ss << in.rdbuf();
      send(proto::record('T', {ss.str()}));
    }
    std::remove(resultFile.c_str());
  }
  if (!specFile.empty()) std::remove(specFile.c_str());
  return rc;
}

}  // namespace dtrain::agent
