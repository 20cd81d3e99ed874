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
#include <optional>

#include <fmt/format.h>

#include "dtrain/common/errors.h"
#include "dtrain/common/fd.h"
#include "dtrain/common/strings.h"
#include "dtrain/launch/agent_protocol.h"
#include "dtrain/launch/env.h"
#include "dtrain/launch/output.h"
#include "dtrain/launch/process.h"
#include "dtrain/store/tcp_store.h"
#include "dtrain/store/token.h"
#include "signal_scope.h"

namespace dtrain::launch {
namespace {

using Clock = std::chrono::steady_clock;
using detail::SignalScope;

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
  LineSplitter splitter;
};

// One node: its agent process (ssh client or local child) and what it reported.
struct Node {
  const spec::NodeSpec* spec = nullptr;
  std::string name;
  pid_t pid = -1;
  bool running = false;
  int status = 0;
  Fd in;
  Pipe out, err;
  TailBuffer errTail{20};
  bool sawFailure = false;  // reported a failing worker or an F record
  bool sawExit = false;     // reported its workers' exits
  int nodeRank = -1;
};

// Pre-flight: `ssh host DTRAIN --version` on every remote host at once.
void preflight(const spec::JobSpec& spec, const std::vector<const spec::NodeSpec*>& remotes, const std::string& version) {
  if (remotes.empty()) return;
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
  while (true) {
    std::vector<pollfd> fds;
    std::vector<std::pair<Check*, bool>> owners;
    for (auto& c : checks) {
      if (c.proc.out) fds.push_back({c.proc.out.get(), POLLIN, 0}), owners.push_back({&c, false});
      if (c.proc.err) fds.push_back({c.proc.err.get(), POLLIN, 0}), owners.push_back({&c, true});
    }
    if (fds.empty()) break;
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    if (left <= 0) break;
    int n = ::poll(fds.data(), fds.size(), static_cast<int>(left));
    if (n < 0 && errno != EINTR) throwErrno("poll");
    for (size_t i = 0; n > 0 && i < fds.size(); ++i) {
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
  std::vector<std::string> problems;
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
      problems.push_back(fmt::format("{} ({}): no answer within {:.3g} s", c.node->host, c.node->origin, limit.count()));
      continue;
    }
    std::string got = c.out.substr(0, c.out.find('\n'));
    std::string lastErr;
    for (const auto& l : split(c.err, '\n'))
      if (!l.empty()) lastErr = l;
    int code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    if (code == 255) {
      problems.push_back(fmt::format("{} ({}): ssh failed: {}", c.node->host, c.node->origin,
                                     lastErr.empty() ? "exit 255" : lastErr));
    } else if (code == 127 || code == 126) {
      problems.push_back(fmt::format("{} ({}): dtrain not runnable at {} (exit {}); install it there or set ssh.dtrain_path",
                                     c.node->host, c.node->origin, bin, code));
    } else if (code != 0) {
      problems.push_back(fmt::format("{} ({}): '{} --version' exited {}: {}", c.node->host, c.node->origin, bin, code, lastErr));
    } else if (got != version) {
      problems.push_back(fmt::format("{} ({}): version mismatch: \"{}\" there, \"{}\" here; install the same dtrain",
                                     c.node->host, c.node->origin, got, version));
    }
  }
  if (!problems.empty()) {
    std::string msg = fmt::format("pre-flight failed for {} of {} remote host(s):", problems.size(), remotes.size());
    for (const auto& p : problems) msg += "\n  " + p;
    throw PreflightError(msg);
  }
}

class MultiNodeRunner {
 public:
  MultiNodeRunner(spec::JobSpec& spec, const MultiNodeOptions& opts) : spec_(spec), opts_(opts) {}
  RunResult run(const std::string& run_id, int storePort, const std::string& token);

 private:
  void onRecord(Node& n, std::string_view line);
  void emitWorkerLine(Node& n, bool isErr, int rank, int localRank, std::string_view text);
  void nodeFailed(Node& n, const std::string& why, int exitCode);
  void stopAll(const char* how);
  void reap();

  spec::JobSpec& spec_;
  const MultiNodeOptions& opts_;
  std::vector<Node> nodes_;
  RunResult result_;
  std::map<int, Fd> logs_;
  bool stopping_ = false;
  bool killSent_ = false;
  bool killed_ = false;
  Clock::time_point killDeadline_{};
  int fallbackExit_ = 0;  // exit code for a failure that is not a worker's
  bool consoleTty_ = false;
  std::string statusLine_;
};

void MultiNodeRunner::emitWorkerLine(Node& n, bool isErr, int rank, int localRank, std::string_view text) {
  std::string prefix = spec_.prefix_output ? fmt::format("[{} rank {}] ", n.name, rank) : std::string();
  if (!isErr && text.substr(0, kStatusPrefix.size()) == kStatusPrefix) {
    if (!consoleTty_) return;
    statusLine_ = prefix + std::string(text.substr(kStatusPrefix.size()));
    writeAll(STDOUT_FILENO, "\r\x1b[2K" + statusLine_);
    return;
  }
  if (!spec_.log_dir.empty()) {
    auto it = logs_.find(rank);
    if (it == logs_.end()) {
      auto path = std::filesystem::path(spec_.log_dir) / fmt::format("rank_{}.log", rank);
      int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
      if (fd < 0) throwErrno("open " + path.string());
      it = logs_.emplace(rank, Fd(fd)).first;
    }
    std::string rec(text);
    rec.push_back('\n');
    writeAll(it->second.get(), rec);
  }
  const auto& filter = spec_.console_ranks;
  if (!filter.empty() && std::find(filter.begin(), filter.end(), localRank) == filter.end()) return;
  std::string rec = prefix;
  rec.append(text);
  rec.push_back('\n');
  if (!statusLine_.empty()) writeAll(STDOUT_FILENO, "\r\x1b[2K");
  writeAll(isErr ? STDERR_FILENO : STDOUT_FILENO, rec);
  if (!statusLine_.empty()) writeAll(STDOUT_FILENO, statusLine_);
}

void MultiNodeRunner::nodeFailed(Node& n, const std::string& why, int exitCode) {
  if (n.sawFailure || stopping_) return;
  n.sawFailure = true;
  if (result_.failure_message.empty()) {
    result_.failure_message = why;
    fallbackExit_ = exitCode;
  }
  stopAll("stop");
}

void MultiNodeRunner::onRecord(Node& n, std::string_view line) {
  auto r = proto::parse(line);
  auto intField = [&](size_t i) {
    try {
      return std::stoi(r->fields.at(i));
    } catch (...) {
      return -1;
    }
  };
  if (!r) return;
  switch (r->type) {
    case 'O':
    case 'E':
      if (r->fields.size() == 3) emitWorkerLine(n, r->type == 'E', intField(0), intField(1), r->fields[2]);
      return;
    case 'N':
      n.nodeRank = intField(0);
      return;
    case 'X': {
      auto w = proto::parseExit(*r);
      if (!w) return;
      w->host = n.name;
      n.sawExit = true;
      result_.workers.push_back(*w);
      bool failed = (w->signal || w->exit_code) && !w->stopped_by_dtrain;
      if (failed && result_.first_failure < 0 && !stopping_) {
        result_.first_failure = static_cast<int>(result_.workers.size() - 1);
        n.sawFailure = true;
        stopAll("stop");
      }
      return;
    }
    case 'T':
      if (!opts_.result_file.empty() && r->fields.size() == 1) std::ofstream(opts_.result_file) << r->fields[0];
      return;
    case 'F':
      if (r->fields.size() == 2) nodeFailed(n, r->fields[1], r->fields[0] == "spec" ? kExitUsage : kExitFailure);
      return;
    default:
      return;
  }
}

void MultiNodeRunner::stopAll(const char* how) {
  std::string cmd = std::string(how) + "\n";
  for (auto& n : nodes_)
    if (n.in) writeAll(n.in.get(), cmd);
  if (!stopping_) {
    stopping_ = true;
    // Agents escalate to SIGKILL after the grace period themselves; this is the backstop
    // for an agent (or an ssh connection) that does not come back.
    killDeadline_ = Clock::now() + std::chrono::milliseconds(static_cast<long>(spec_.shutdown_timeout_s * 1000) + 10000);
  }
  if (std::string(how) == "kill") {
    killSent_ = true;
    killDeadline_ = std::min(killDeadline_, Clock::now() + std::chrono::seconds(5));
  }
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
      n.in.reset();
      ::kill(-pid, SIGKILL);  // anything left in its process group goes with it
    }
  }
}

RunResult MultiNodeRunner::run(const std::string& run_id, int storePort, const std::string& token) {
  SignalScope signals;
  consoleTty_ = ::isatty(STDOUT_FILENO) == 1;
  if (!spec_.log_dir.empty()) std::filesystem::create_directories(spec_.log_dir);
  EnvMap env = currentEnvironment();
  std::string self = selfExecutable();
  std::string bin = remoteDtrain(spec_);
  int nnodes = static_cast<int>(spec_.nodes.size());
  nodes_.resize(spec_.nodes.size());
  for (size_t i = 0; i < spec_.nodes.size(); ++i) {
    Node& n = nodes_[i];
    const auto& ns = spec_.nodes[i];
    n.spec = &ns;
    n.name = nodeName(spec_, ns);
    std::vector<std::string> args = {"agent", "--store-port", std::to_string(storePort), "--run-id", run_id,
                                     "--node", n.name, "--order", std::to_string(i), "--nnodes", std::to_string(nnodes)};
    if (ns.slots > 0) args.insert(args.end(), {"--nproc", std::to_string(ns.slots)});
    if (!ns.gpus.empty()) {
      std::vector<std::string> g;
      for (int x : ns.gpus) g.push_back(std::to_string(x));
      args.insert(args.end(), {"--gpus", fmt::format("{}", fmt::join(g, ","))});
    }
    if (!ns.address.empty()) args.insert(args.end(), {"--address", ns.address});
    SpawnOptions so;
    so.env = envStrings(env);
    so.stdin_pipe = true;
    if (ns.local) {
      args.insert(args.end(), {"--store-addr", "127.0.0.1"});
      so.argv = {self};
      so.argv.insert(so.argv.end(), args.begin(), args.end());
    } else {
      if (!spec_.rendezvous.addr.empty()) args.insert(args.end(), {"--store-addr", spec_.rendezvous.addr});
      args.insert(args.begin(), bin);
      so.argv = sshArgv(spec_, ns);
      so.argv.push_back(remoteCommand(args));
    }
    Spawned child = spawnProcess(so);
    n.pid = child.pid;
    n.running = true;
    n.in = std::move(child.in);
    n.out.fd = std::move(child.out);
    n.err.fd = std::move(child.err);
    writeAll(n.in.get(), "token " + token + "\n");
  }

  bool crowded = std::any_of(spec_.nodes.begin(), spec_.nodes.end(),
                             [&](const spec::NodeSpec& n) { return (n.slots ? n.slots : spec_.nproc_per_node) > 1; });
  if (crowded && !env.count("OMP_NUM_THREADS") && !spec_.env.count("OMP_NUM_THREADS"))
    writeAll(STDERR_FILENO, "dtrain: setting OMP_NUM_THREADS=1 for the workers of nodes that run several, to avoid "
                            "overloading them; set it in the spec's env or with --env to tune\n");

  std::vector<char> buf(65536);
  while (true) {
    std::vector<pollfd> fds;
    std::vector<std::pair<Node*, bool>> owners;
    fds.push_back({signals.fd(), POLLIN, 0});
    owners.push_back({nullptr, false});
    bool anyRunning = false;
    for (auto& n : nodes_) {
      anyRunning |= n.running;
      if (n.out.fd) fds.push_back({n.out.fd.get(), POLLIN, 0}), owners.push_back({&n, false});
      if (n.err.fd) fds.push_back({n.err.fd.get(), POLLIN, 0}), owners.push_back({&n, true});
    }
    if (!anyRunning && fds.size() == 1) break;
    int timeoutMs = 1000;
    if (stopping_ && !killed_) {
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(killDeadline_ - Clock::now()).count();
      timeoutMs = static_cast<int>(std::clamp<long>(left, 0, 1000));
    }
    if (!anyRunning) timeoutMs = 200;
    int n = ::poll(fds.data(), fds.size(), timeoutMs);
    if (n < 0 && errno != EINTR) throwErrno("poll");
    if (n == 0 && !anyRunning) break;
    if (stopping_ && !killed_ && Clock::now() >= killDeadline_) {
      killed_ = true;
      for (auto& node : nodes_)
        if (node.running) ::kill(-node.pid, SIGKILL);
    }
    if (n > 0 && (fds[0].revents & POLLIN)) {
      unsigned char sigs[64];
      ssize_t got;
      while ((got = ::read(signals.fd(), sigs, sizeof(sigs))) > 0) {
        for (ssize_t i = 0; i < got; ++i) {
          int sig = sigs[i];
          if (sig == SIGCHLD) continue;
          if (!result_.received_signal) result_.received_signal = sig;
          stopAll(stopping_ && sig == SIGINT ? "kill" : "stop");  // a second Ctrl-C means "now"
        }
      }
    }
    for (size_t i = 1; n > 0 && i < fds.size(); ++i) {
      if (!(fds[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
      auto [node, isErr] = owners[i];
      Pipe& p = isErr ? node->err : node->out;
      ssize_t got = ::read(p.fd.get(), buf.data(), buf.size());
      if (got < 0 && errno == EINTR) continue;
      auto handle = [&, node = node, isErr = isErr](std::string_view l) {
        if (isErr) {
          node->errTail.push(l);
          writeAll(STDERR_FILENO, fmt::format("dtrain: [{}] {}\n", node->name, l));
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
    // An agent that ended without reporting its workers lost them: the node is gone.
    for (auto& node : nodes_) {
      if (node.running || node.out.fd || node.sawExit || node.sawFailure) continue;
      int code = WIFEXITED(node.status) ? WEXITSTATUS(node.status) : 128 + WTERMSIG(node.status);
      std::string tail = node.errTail.lines().empty() ? "" : ": " + node.errTail.lines().back();
      nodeFailed(node, fmt::format("node {} ({}) lost: its agent{} exited with {}{}", node.name, node.spec->origin,
                                   node.spec->local ? "" : " (ssh)", code, tail),
                 kExitFailure);
      node.sawFailure = true;
    }
  }
  if (!statusLine_.empty()) writeAll(STDOUT_FILENO, "\n");
  // Ranks in order; first_failure follows its worker.
  std::optional<WorkerExit> first;
  if (result_.first_failure >= 0) first = result_.workers[static_cast<size_t>(result_.first_failure)];
  std::stable_sort(result_.workers.begin(), result_.workers.end(),
                   [](const WorkerExit& a, const WorkerExit& b) { return a.global_rank < b.global_rank; });
  if (first) {
    for (size_t i = 0; i < result_.workers.size(); ++i)
      if (result_.workers[i].global_rank == first->global_rank) result_.first_failure = static_cast<int>(i);
  }
  if (result_.received_signal) {
    result_.exit_code = 128 + result_.received_signal;
  } else if (first) {
    result_.exit_code = first->signal ? 128 + first->signal : first->exit_code;
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

RunResult runMultiNodeJob(spec::JobSpec& spec, const std::string& run_id, const MultiNodeOptions& opts) {
  std::vector<const spec::NodeSpec*> remotes;
  for (const auto& n : spec.nodes)
    if (!n.local) remotes.push_back(&n);
  preflight(spec, remotes, opts.version);

  store::TcpStoreServerOptions so;
  so.bind = remotes.empty() ? "127.0.0.1" : "0.0.0.0";
  so.port = spec.rendezvous.port;
  so.token = store::newToken();
  std::unique_ptr<store::TcpStoreServer> server;
  try {
    server = std::make_unique<store::TcpStoreServer>(so);
  } catch (const IoError& e) {
    if (so.port == 0) throw;
    throw SpecError(fmt::format("{}: /rendezvous/port: {}; choose a free port, or 0 for any",
                                spec.source.empty() ? "job" : spec.source, e.what()));
  }
  server->start();
  spec.rendezvous.port = server->port();

  // What every node runs: the resolved spec with the forwarded part of our environment
  // (the spec's own env wins), the working directory made explicit.
  spec::JobSpec shipped = spec;
  if (shipped.trainer) shipped.command.clear();  // each agent starts its own `dtrain train`
  for (const auto& [k, v] : currentEnvironment()) {
    for (const auto& prefix : spec.env_forward)
      if (k.rfind(prefix, 0) == 0 && !shipped.env.count(k)) shipped.env[k] = v;
  }
  // Relative paths mean what they mean here; agents start elsewhere (ssh: the home directory).
  if (shipped.cwd.empty()) shipped.cwd = std::filesystem::current_path().string();
  if (!shipped.log_dir.empty()) shipped.log_dir = std::filesystem::absolute(shipped.log_dir).string();
  // Remote workers' output reaches this console: they may draw a progress bar when it is a terminal.
  if (::isatty(STDOUT_FILENO) == 1) shipped.env["DTRAIN_CONSOLE_TTY"] = "1";
  {
    store::TcpStoreOptions co;
    co.host = "127.0.0.1";
    co.port = server->port();
    co.token = so.token;
    store::TcpStore client(co);
    client.set("job/spec", spec::serializeForNode(shipped));
    client.set("job/source", spec.source.empty() ? "command line" : spec.source);
  }
  MultiNodeRunner runner(spec, opts);
  return runner.run(run_id, server->port(), so.token);
}

}  // namespace dtrain::launch
