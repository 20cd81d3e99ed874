#pragma once
// Data sets and DistributedSampler-style sharding.
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "dtrain/common/fd.h"
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
  // The rows are views of a data image (below), held once by the host, not by this process.
  bool shared = false;
  // For the trainer's log: how a worker got its file data when it was given an image ("" when
  // it was not): "mapped from this host's data image (...)", or why it parsed the files.
  std::string note;
};
// `poll`, when given, is called every 65536 rows or 4 MiB of a csv file and every 4 MiB of an idx file,
// and what it throws passes through: the launcher's pre-flight gives one that throws once a
// stop signal came, so that parsing a file of several GB ends at once rather than after it.
//
// With DTRAIN_DATA_FD set (a worker of `dtrain run`), file data comes from that data image
// when it matches this spec and its files (their identity and modification time), and from
// the files otherwise (`note` says why).
Datasets openDatasets(const spec::TrainerSpec& t, const std::function<void()>& poll = {});

// A data image: the parsed tables of a spec's data files (floats, as the trainer holds them)
// in one sealed, read-only memory file (memfd). The launcher parses the files anyway, to
// check them before any worker starts; its workers inherit the descriptor, named by
// DTRAIN_DATA_FD, and map it instead of each parsing the files again and holding its own copy:
// a host holds the data once, and workers start without the parse. Freed by the kernel when
// the launcher and its workers are gone.
inline constexpr const char* kDataImageEnv = "DTRAIN_DATA_FD";
struct DataImage {
  Fd fd;                 // invalid: no image (synthetic data, or `problem`)
  uint64_t bytes = 0;    // its size
  std::string problem;   // why a file data set got no image ("" otherwise)
  std::string fingerprint;  // what it was made from (the data fields, each file's identity and times)
};
struct SharedDatasets {
  Datasets sets;  // views of the image when there is one (the parse's own copy is freed)
  DataImage image;
};
// As openDatasets (the same errors for bad data) but never from DTRAIN_DATA_FD, and with
// makeImage, for file data, an image of it. An image that cannot be made (memfd_create
// refused, no memory) is no error: image.problem says why, and the workers parse the files.
SharedDatasets openSharedDatasets(const spec::TrainerSpec& t, const std::function<void()>& poll = {},
                                  bool makeImage = true);
// Before a restart (no worker maps `image` then): when one of `t`'s files changed since
// `image` was made from them (rewritten, replaced, gone), the image is made again from the
// files as they are now, and a line saying so is returned; "" when nothing changed or there
// is no image. Without this, each of the restart's workers would parse the files on top of
// the stale image (memory the launch's estimate did not count). A file that no longer parses
// leaves no image (`image.problem` says why): the workers parse it and say what is wrong.
std::string refreshDataImage(const spec::TrainerSpec& t, DataImage& image, const std::function<void()>& poll = {});
// The JSON path and name of the first of the spec's data files that is not a regular file (a
// pipe, a process substitution): it can be read once, so only through the launcher's image;
// empty when all are regular files (or the data is synthetic).
std::pair<std::string, std::string> onceReadableDataFile(const spec::TrainerSpec& t);
// Whether `dtrain run` makes a data image for its local workers: yes unless DTRAIN_DATA_SHARE
// is 0 (also off, false, no); throws SpecError for another value.
bool dataShareEnabled();

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
