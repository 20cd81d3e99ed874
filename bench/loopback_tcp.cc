// Physical reference for the all-reduce tables: single-stream TCP bandwidth over loopback
// (one sender thread, one receiver thread, 1 MiB writes). Prints GB/s.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <thread>
#include <vector>

int main(int argc, char** argv) {
  size_t total = (argc > 1 ? std::atoll(argv[1]) : 2048) << 20;
  int l = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  bind(l, reinterpret_cast<sockaddr*>(&a), sizeof(a));
  listen(l, 1);
  socklen_t len = sizeof(a);
  getsockname(l, reinterpret_cast<sockaddr*>(&a), &len);
  std::thread sender([&] {
    int s = socket(AF_INET, SOCK_STREAM, 0);
    connect(s, reinterpret_cast<sockaddr*>(&a), sizeof(a));
    std::vector<char> buf(1 << 20, 'x');
    for (size_t sent = 0; sent < total;) {
      ssize_t n = send(s, buf.data(), buf.size(), 0);
      if (n <= 0) break;
      sent += static_cast<size_t>(n);
    }
    close(s);
  });
  int c = accept(l, nullptr, nullptr);
  std::vector<char> buf(1 << 20);
  auto start = std::chrono::steady_clock::now();
  size_t got = 0;
  while (true) {
    ssize_t n = recv(c, buf.data(), buf.size(), 0);
    if (n <= 0) break;
    got += static_cast<size_t>(n);
  }
  double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  sender.join();
  std::printf("loopback single-stream TCP: %.3f GB/s\n", static_cast<double>(got) / s / 1e9);
  return 0;
}
