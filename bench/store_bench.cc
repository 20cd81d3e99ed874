// Store benchmark: N client processes each doing M set+get pairs on their own keys against
// one TcpStoreServer. Prints one line per run:
//   impl clients pairs ops_per_s p50_us p99_us
// (an op is one request: a pair is two). Run through bench/store_bench.sh, which runs
// PyTorch's TCPStore the same way in the same run.
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "dtrain/store/tcp_store.h"
#include "dtrain/store/token.h"

using namespace dtrain::store;
using Clock = std::chrono::steady_clock;

int main(int argc, char** argv) {
  int clients = argc > 1 ? std::atoi(argv[1]) : 8;
  int pairs = argc > 2 ? std::atoi(argv[2]) : 2000;
  TcpStoreServerOptions so;
  so.token = newToken();
  // Bound now, served from a thread started only after every fork(): a child forked while
  // the server thread holds a lock (malloc's, say) would deadlock.
  TcpStoreServer server(so);
  std::vector<int> readFds;
  std::vector<pid_t> pids;
  for (int c = 0; c < clients; ++c) {
    int p[2];
    if (pipe(p) != 0) return 1;
    pid_t pid = fork();
    if (pid == 0) {
      close(p[0]);
      TcpStoreOptions o;
      o.port = server.port();
      o.token = so.token;
      TcpStore s(o);
      s.add("ready", 1);
      s.wait({"go"});
      std::vector<float> lat;
      lat.reserve(static_cast<size_t>(pairs) * 2);
      std::string value(64, 'v');
      auto t0 = Clock::now();
      for (int i = 0; i < pairs; ++i) {
        std::string key = "c" + std::to_string(c) + "/" + std::to_string(i % 100);
        auto a = Clock::now();
        s.set(key, value);
        auto b = Clock::now();
        s.get(key);
        auto e = Clock::now();
        lat.push_back(std::chrono::duration<float, std::micro>(b - a).count());
        lat.push_back(std::chrono::duration<float, std::micro>(e - b).count());
      }
      double total = std::chrono::duration<double>(Clock::now() - t0).count();
      (void)!write(p[1], &total, sizeof(total));
      (void)!write(p[1], lat.data(), lat.size() * sizeof(float));
      _exit(0);
    }
    close(p[1]);
    readFds.push_back(p[0]);
    pids.push_back(pid);
  }
  server.start();
  TcpStoreOptions o;
  o.port = server.port();
  o.token = so.token;
  TcpStore ctl(o);
  while (ctl.add("ready", 0) < clients) usleep(1000);
  auto start = Clock::now();
  ctl.set("go", "1");
  std::vector<float> all;
  for (int fd : readFds) {
    double total;
    if (read(fd, &total, sizeof(total)) != sizeof(total)) return 1;
    std::vector<float> lat(static_cast<size_t>(pairs) * 2);
    size_t want = lat.size() * sizeof(float), got = 0;
    char* dst = reinterpret_cast<char*>(lat.data());
    while (got < want) {
      ssize_t n = read(fd, dst + got, want - got);
      if (n <= 0) return 1;
      got += static_cast<size_t>(n);
    }
    all.insert(all.end(), lat.begin(), lat.end());
    close(fd);
  }
  double wall = std::chrono::duration<double>(Clock::now() - start).count();
  for (pid_t p : pids) waitpid(p, nullptr, 0);
  std::sort(all.begin(), all.end());
  double opsPerS = static_cast<double>(all.size()) / wall;
  std::printf("%-8s %7d %7d %12.0f %8.1f %8.1f\n", "dtrain", clients, pairs, opsPerS, all[all.size() / 2],
              all[all.size() * 99 / 100]);
  return 0;
}
