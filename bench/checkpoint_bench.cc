// Checkpoint write and read-back time of the built-in trainer's format (what every rank
// waits for at a checkpoint step), for a model of N parameters: weights + SGD momentum.
// Prints one line per size: impl params bytes save_ms load_ms (medians of `reps`).
// Usage: checkpoint_bench DIR PARAMS[,PARAMS...] [reps]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <sstream>
#include <string>
#include <vector>

#include "dtrain/train/checkpoint.h"

namespace {
double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}
}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: %s DIR PARAMS[,PARAMS...] [reps]\n", argv[0]);
    return 2;
  }
  const std::string dir = argv[1];
  const int reps = argc > 3 ? std::atoi(argv[3]) : 5;
  std::stringstream list(argv[2]);
  for (std::string item; std::getline(list, item, ',');) {
    const size_t n = std::stoull(item);
    dtrain::train::TrainState s;
    s.params.resize(n);
    s.momentum.resize(n);
    for (size_t i = 0; i < n; ++i) {
      s.params[i] = static_cast<float>(i % 977) * 1e-3f;
      s.momentum[i] = static_cast<float>(i % 991) * -1e-4f;
    }
    s.config = {"model: mlp", "data: synthetic"};
    std::filesystem::remove_all(dir);
    std::vector<double> save, load;
    for (int r = 0; r < reps; ++r) {
      s.step = r + 1;
      auto t0 = std::chrono::steady_clock::now();
      dtrain::train::saveCheckpoint(dir, s, 2);
      auto t1 = std::chrono::steady_clock::now();
      auto back = dtrain::train::loadLatestCheckpoint(dir, nullptr);
      auto t2 = std::chrono::steady_clock::now();
      if (!back || back->params.size() != n) {
        std::fprintf(stderr, "checkpoint did not read back\n");
        return 1;
      }
      save.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
      load.push_back(std::chrono::duration<double, std::milli>(t2 - t1).count());
    }
    std::printf("%-8s %10zu %12zu %9.1f %9.1f\n", "dtrain", n, 2 * n * sizeof(float), median(save), median(load));
  }
  std::filesystem::remove_all(dir);
  return 0;
}
