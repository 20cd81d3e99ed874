// Test helper: one rank that runs allreduces (or broadcasts from rank 0) in a loop until told
// to stop (file), printing "ready <transport>" after the first one and the error when a
// collective fails (exit 3).
// Usage: comm_worker SECONDS_TIMEOUT STOP_FILE [allreduce|broadcast]   (environment as under dtrain run)
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "dtrain/comm/communicator.h"

int main(int argc, char** argv) {
  using namespace dtrain::comm;
  if (argc < 3) return 2;
  CommOptions o;
  o.timeout = Duration(static_cast<long long>(std::atof(argv[1]) * 1000));
  std::string stop = argv[2];
  const std::string op = argc > 3 ? argv[3] : "allreduce";
  if (op != "allreduce" && op != "broadcast") return 2;
  try {
    auto c = createFromEnvironment(o);
    std::vector<float> v(256 * 1024, 1.0f);
    bool ready = false;
    while (access(stop.c_str(), F_OK) != 0) {
      float expect = 1.0f;
      if (op == "allreduce") {
        std::fill(v.begin(), v.end(), 1.0f);
        c->allreduce(v.data(), v.size(), DataType::kFloat32, ReduceOp::kSum);
        expect = static_cast<float>(c->size());
      } else {
        std::fill(v.begin(), v.end(), c->rank() == 0 ? 1.0f : 0.0f);
        c->broadcast(v.data(), v.size(), DataType::kFloat32, 0);
      }
      if (v[0] != expect || v.back() != expect) {
        std::fprintf(stderr, "rank %d: wrong result %f\n", c->rank(), v[0]);
        return 4;
      }
      if (!ready) {
        std::printf("ready %s\n", c->transport());
        std::fflush(stdout);
        ready = true;
      }
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 3;
  }
}
