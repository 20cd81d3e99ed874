#pragma once
// Checkpoints of the built-in trainer. A file holds everything that shapes the rest of the
// run: weights, optimizer state, epoch, the global sample cursor within the epoch, step and
// a hash of the config. The data order and samples are functions of (seed, epoch, index),
// so there is no RNG state to save.
//
// Format (native byte order; same architecture to resume):
//   "DTRCKPT1" | u64 payload bytes | payload | SHA-256 of payload (32 bytes)
// Written atomically: a temporary file, fsync, rename, fsync of the directory.
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "dtrain/spec/job_spec.h"

namespace dtrain::train {

struct TrainState {
  uint64_t config_hash = 0;
  long long step = 0;      // global steps done
  long long epoch = 0;     // epoch to continue in
  uint64_t cursor = 0;     // samples of that epoch's order already used (all ranks)
  long long world = 0;     // world size that wrote it (information)
  std::vector<float> params, momentum;
};

// Hash of the settings a checkpoint must agree with (model, data, optimizer kind, seeds);
// batch size and world size may change between runs.
uint64_t configHash(const spec::TrainerSpec& t);

// Writes dir/ckpt-<step>.bin and keeps the newest `keep` checkpoints. Returns the path.
std::string saveCheckpoint(const std::string& dir, const TrainState& s, int keep = 3);

// The newest checkpoint that reads back intact; damaged ones are reported through `warn`
// and skipped, never loaded. nullopt when there is none. maxStep >= 0: the newest at or
// before that step (the pipeline trainer's stages agree on a common step this way).
std::optional<TrainState> loadLatestCheckpoint(const std::string& dir, const std::function<void(const std::string&)>& warn,
                                               std::string* path = nullptr, long long maxStep = -1);

}  // namespace dtrain::train
