#include "dtrain/launch/plan.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <fstream>
#include <sstream>

#include <fmt/format.h>

#include "dtrain/common/errors.h"
#include "dtrain/common/strings.h"

namespace dtrain::launch {

std::string hostName() {
  char buf[256] = {0};
  if (::gethostname(buf, sizeof(buf) - 1) != 0) return "localhost";
  return buf;
}

std::string selfExecutable() {
  char buf[4096];
  ssize_t n = ::readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  if (n <= 0) throwErrno("readlink /proc/self/exe");
  return std::string(buf, static_cast<size_t>(n));
}

std::string newRunId() {
  unsigned char bytes[6] = {0};
  std::ifstream r("/dev/urandom", std::ios::binary);
  r.read(reinterpret_cast<char*>(bytes), sizeof(bytes));
  std::string id;
  for (unsigned char b : bytes) id += fmt::format("{:02x}", b);
  return id;
}

int pickFreePort(int avoid) {
  for (int attempt = 0; attempt < 16; ++attempt) {
    int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) throwErrno("socket");
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    addr.sin_port = 0;
    if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
      ::close(fd);
      throwErrno("bind to a free port on 127.0.0.1");
    }
    socklen_t len = sizeof(addr);
    ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
    ::close(fd);
    int port = ntohs(addr.sin_port);
    if (port != avoid) return port;
  }
  throw IoError("could not find a free TCP port on 127.0.0.1");
}

Plan makeLocalPlan(const spec::JobSpec& spec, const std::string& run_id, int master_port) {
  Plan plan;
  plan.run_id = run_id;
  plan.nnodes = 1;
  plan.world_size = spec.nproc_per_node;
  plan.local_world_size = spec.nproc_per_node;
  plan.master_addr = "127.0.0.1";
  plan.master_port = master_port ? master_port : pickFreePort(spec.rendezvous.port);
  int gpus = spec::visibleGpuCount();
  std::string host = hostName();
  for (int i = 0; i < spec.nproc_per_node; ++i) {
    WorkerSlot s;
    s.host = host;
    s.node_rank = 0;
    s.local_rank = i;
    s.global_rank = i;
    s.device = gpus > 0 ? fmt::format("cuda:{}", i % gpus) : "cpu";
    plan.workers.push_back(s);
  }
  return plan;
}

std::string formatPlan(const Plan& plan, const spec::JobSpec& spec) {
  const std::string cmd = spec::shownCommand(spec.command);
  size_t hostW = 4;
  for (const auto& w : plan.workers) hostW = std::max(hostW, w.host.size());
  std::ostringstream os;
  // Multi-node plans learn the master port (and maybe the address) at rendezvous.
  std::string master = plan.master_port ? fmt::format("{}:{}", plan.master_addr, plan.master_port)
                                        : fmt::format("{}, port chosen at start", plan.master_addr);
  os << fmt::format("job {} (run {}): {} node(s), world size {}, master {}\n", spec.name, plan.run_id, plan.nnodes,
                    plan.world_size, master);
  os << fmt::format("{:<{}}  {:>9}  {:>10}  {:>11}  {:<7}  {}\n", "host", hostW, "node_rank", "local_rank", "global_rank",
                    "device", "command");
  for (const auto& w : plan.workers)
    os << fmt::format("{:<{}}  {:>9}  {:>10}  {:>11}  {:<7}  {}\n", w.host, hostW, w.node_rank, w.local_rank,
                      w.global_rank, w.device, cmd);
  return os.str();
}

}  // namespace dtrain::launch
