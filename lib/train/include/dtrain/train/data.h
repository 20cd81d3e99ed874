#pragma once
// Data sets and DistributedSampler-style sharding.
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "dtrain/spec/job_spec.h"

namespace dtrain::train {

// A data set the trainer reads by index. Thread-safety: const methods may run concurrently.
class Dataset {
 public:
  virtual ~Dataset() = default;
  virtual uint64_t size() const = 0;
  // x: inputs floats; classification: *label; regression (targets != nullptr): outputs floats.
  // A pure function of the index, safe to call from several threads at once (the batch loader
  // computes a batch's samples on several).
  virtual void sample(uint64_t index, float* x, int* label, float* targets) const = 0;
};

// The training and held-out sets of a trainer spec, checked against the model's input and
// output widths; a file is read and parsed once for the two. File data sets without an eval
// file hold out their last 10%. Throws SpecError naming the file, line and column of bad data.
struct Datasets {
  std::unique_ptr<Dataset> train, eval;
};
// `poll`, when given, is called every 65536 rows or 4 MiB of a csv file and every 4 MiB of an idx file,
// and what it throws passes through: the launcher's pre-flight gives one that throws once a
// stop signal came, so that parsing a file of several GB ends at once rather than after it.
Datasets openDatasets(const spec::TrainerSpec& t, const std::function<void()>& poll = {});

// Seeded Gaussian latents z (kLatent dims) are mapped by a fixed random linear generator
// into the input space (plus a little noise), and labelled by a fixed random teacher network
// on z: like real data, whose classes live on a low-dimensional manifold, so a student
// learns them from a modest sample. Any sample is generated from (seed, split, index)
// alone, so nothing is materialised and all ranks agree.
class SyntheticData {
 public:
  SyntheticData(int inputs, int outputs, uint64_t seed);
  // x: `inputs` floats. Classification: *label = argmax of the teacher. Regression
  // (targets != nullptr): the teacher's `outputs` values.
  void sample(uint64_t index, bool eval, float* x, int* label, float* targets = nullptr) const;

 private:
  int inputs_, outputs_;
  uint64_t seed_;
  static constexpr int kLatent = 10;
  static constexpr float kNoise = 0.1f;
  std::vector<float> gen_;      // [inputs x kLatent]
  std::vector<float> teacher_;  // [outputs x kLatent]
};

// The global order of an epoch: a pseudo-random permutation of [0, n) seeded by
// (seed, epoch), evaluated per position (a Feistel network with cycle walking), so neither
// memory nor start-up time grows with n.
class EpochOrder {
 public:
  EpochOrder(uint64_t n, uint64_t seed, uint64_t epoch);
  uint64_t operator[](uint64_t position) const;
  uint64_t size() const { return n_; }

 private:
  uint64_t feistel(uint64_t v) const;
  uint64_t n_;
  int halfBits_;
  uint64_t keys_[4];
};

// All positions at once (tests, small n).
std::vector<uint64_t> epochOrder(uint64_t n, uint64_t seed, uint64_t epoch);

}  // namespace dtrain::train
