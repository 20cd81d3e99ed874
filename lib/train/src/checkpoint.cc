#include "dtrain/train/checkpoint.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <array>
#include <cerrno>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string_view>
#include <thread>

#include <openssl/evp.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "dtrain/common/errors.h"
#include "dtrain/common/fd.h"
#include "dtrain/common/files.h"
#include "dtrain/common/memory.h"
#include "dtrain/spec/checkpoint_manifest.h"
#include "dtrain/train/pipeline.h"
#include "dtrain/train/trainer.h"
#include "diverged.h"

namespace dtrain::train {
namespace {

namespace fs = std::filesystem;
constexpr char kMagic[8] = {'D', 'T', 'R', 'C', 'K', 'P', 'T', '1'};
constexpr char kScheduleTag[8] = {'L', 'R', 'S', 'C', 'H', 'E', 'D', '1'};
constexpr char kRowsTag[8] = {'T', 'R', 'N', 'R', 'O', 'W', 'S', '1'};

template <typename T>
void put(std::string& b, const T& v) {
  b.append(reinterpret_cast<const char*>(&v), sizeof(T));
}

template <typename T>
bool get(std::string_view b, size_t& pos, T& v) {
  if (b.size() - pos < sizeof(T)) return false;
  std::memcpy(&v, b.data() + pos, sizeof(T));
  pos += sizeof(T);
  return true;
}

std::string hexToBytes(const std::string& hex) {
  std::string out;
  for (size_t i = 0; i + 1 < hex.size(); i += 2) out.push_back(static_cast<char>(std::stoi(hex.substr(i, 2), nullptr, 16)));
  return out;
}

// SHA-256 of a sequence of buffers, computed on a thread of its own while the caller reads
// or writes them: at a checkpoint step the other ranks wait for the writer anyway, so a core
// is free, and the hash (~1.7 GB/s here) no longer adds to the file's I/O. Buffers of more
// than kCopyBelow bytes must stay valid and unchanged until finish() or destruction; smaller
// ones are copied.
class BackgroundDigest {
 public:
  BackgroundDigest() : thread_([this] { run(); }) {}
  BackgroundDigest(const BackgroundDigest&) = delete;
  BackgroundDigest& operator=(const BackgroundDigest&) = delete;
  ~BackgroundDigest() {
    {
      std::lock_guard<std::mutex> lk(mu_);
      closed_ = aborted_ = true;
    }
    cv_.notify_all();
    if (thread_.joinable()) thread_.join();
  }
  void feed(const void* data, size_t bytes) {
    Piece piece;
    if (bytes < kCopyBelow) {
      piece.owned.assign(static_cast<const char*>(data), bytes);
    } else {
      piece.data = static_cast<const char*>(data);
      piece.bytes = bytes;
    }
    {
      std::lock_guard<std::mutex> lk(mu_);
      queue_.push_back(std::move(piece));
    }
    cv_.notify_all();
  }
  // Blocks until every buffer fed so far is hashed (before a fed buffer is reused).
  void drain() {
    std::unique_lock<std::mutex> lk(mu_);
    idle_.wait(lk, [&] { return queue_.empty() && !busy_; });
  }
  std::array<unsigned char, 32> finish() {
    {
      std::lock_guard<std::mutex> lk(mu_);
      closed_ = true;
    }
    cv_.notify_all();
    thread_.join();
    return digest_;
  }

 private:
  static constexpr size_t kCopyBelow = 4096;
  struct Piece {
    const char* data = nullptr;
    size_t bytes = 0;
    std::string owned;
  };
  void run() {
    std::unique_ptr<EVP_MD_CTX, void (*)(EVP_MD_CTX*)> md(EVP_MD_CTX_new(), EVP_MD_CTX_free);
    DTRAIN_CHECK(md && EVP_DigestInit_ex(md.get(), EVP_sha256(), nullptr) == 1);
    std::unique_lock<std::mutex> lk(mu_);
    while (true) {
      cv_.wait(lk, [&] { return !queue_.empty() || closed_; });
      if (aborted_) return;
      if (queue_.empty()) break;
      Piece piece = std::move(queue_.front());
      queue_.pop_front();
      busy_ = true;
      lk.unlock();
      const char* p = piece.owned.empty() ? piece.data : piece.owned.data();
      const size_t n = piece.owned.empty() ? piece.bytes : piece.owned.size();
      DTRAIN_CHECK(EVP_DigestUpdate(md.get(), p, n) == 1);
      lk.lock();
      busy_ = false;
      if (queue_.empty()) idle_.notify_all();
    }
    unsigned int len = 0;
    DTRAIN_CHECK(EVP_DigestFinal_ex(md.get(), digest_.data(), &len) == 1 && len == digest_.size());
  }

  std::mutex mu_;
  std::condition_variable cv_, idle_;
  std::deque<Piece> queue_;
  bool closed_ = false, aborted_ = false, busy_ = false;
  std::array<unsigned char, 32> digest_{};
  std::thread thread_;  // last: started once the rest is constructed
};

// The step in a checkpoint's file name "ckpt-<digits>.bin" (with `suffix` after it: ".tmp"
// for a write in progress); nullopt for any other name. (Digits alone: "ckpt-99x.bin" is no
// checkpoint of step 99.)
std::optional<long long> namedStep(const std::string& name, std::string_view suffix = "") {
  const std::string_view tail = ".bin";
  if (name.rfind("ckpt-", 0) != 0 || name.size() < 5 + tail.size() + suffix.size() + 1) return std::nullopt;
  const std::string_view rest = std::string_view(name).substr(name.size() - tail.size() - suffix.size());
  if (rest.substr(0, tail.size()) != tail || rest.substr(tail.size()) != suffix) return std::nullopt;
  const std::string digits = name.substr(5, name.size() - 5 - tail.size() - suffix.size());
  if (digits.find_first_not_of("0123456789") != std::string::npos || digits.size() > 18) return std::nullopt;
  return std::stoll(digits);
}

std::vector<std::pair<long long, fs::path>> listCheckpoints(const std::string& dir) {
  std::vector<std::pair<long long, fs::path>> out;
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec))  // (no throw on a readdir error)
    if (const auto step = namedStep(it->path().filename().string())) out.emplace_back(*step, it->path());
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  return out;
}

// The names in the directory open as `dirFd` (the descriptor stays the caller's); empty when
// it cannot be read.
std::vector<std::string> entriesAt(int dirFd) {
  std::vector<std::string> out;
  const int fd = ::fcntl(dirFd, F_DUPFD_CLOEXEC, 0);
  if (fd < 0) return out;
  DIR* d = ::fdopendir(fd);
  if (!d) {
    ::close(fd);
    return out;
  }
  ::rewinddir(d);  // (the duplicate shares its offset with dirFd: start over)
  while (const dirent* e = ::readdir(d)) out.emplace_back(e->d_name);
  ::closedir(d);
  return out;
}

// The cheap test of a file named like a checkpoint, for pruning: our magic and a length field
// that matches the file's size. (The checksum is read on resume; reading every kept file in
// full at every save would cost more than the save.)
bool looksLikeCheckpointAt(int dirFd, const std::string& name) {
  // (a regular file, through a symbolic link as a path would go, before it is opened: a FIFO
  // or a device is not opened at all; non-blocking all the same, should one take its place)
  struct stat st {};
  if (::fstatat(dirFd, name.c_str(), &st, 0) != 0 || !S_ISREG(st.st_mode)) return false;
  Fd fd(::openat(dirFd, name.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC));
  if (!fd || ::fstat(fd.get(), &st) != 0 || !S_ISREG(st.st_mode)) return false;
  char head[sizeof(kMagic) + 8];
  if (::pread(fd.get(), head, sizeof(head), 0) != static_cast<ssize_t>(sizeof(head))) return false;
  uint64_t len = 0;
  std::memcpy(&len, head + sizeof(kMagic), sizeof(len));
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  return std::memcmp(head, kMagic, sizeof(kMagic)) == 0 && size >= sizeof(head) + 32 && len == size - sizeof(head) - 32;
}

void putString(std::string& b, const std::string& v) {
  put(b, static_cast<uint64_t>(v.size()));
  b += v;
}

bool getString(std::string_view b, size_t& pos, std::string& v) {
  uint64_t n = 0;
  if (!get(b, pos, n) || n > b.size() - pos) return false;
  v = std::string(b.substr(pos, n));
  pos += n;
  return true;
}

// The "part: " of a configDescription() entry.
std::string partName(const std::string& d) { return d.substr(0, d.find(':')); }

std::string fixText(const spec::TrainerSpec& t) {
  // All of them: the next older checkpoint was written by the same config, so removing only
  // the newest would just move the refusal to it.
  return t.parallel.pipeline_stages > 1
             ? fmt::format("use another /trainer/checkpoint/dir, or remove all the checkpoints in {} (its stage-*/ "
                           "directories and manifest.json: the older ones are from the same config too)",
                           t.checkpoint.dir)
             : fmt::format("use another /trainer/checkpoint/dir, or remove all the checkpoints in {} (every ckpt-*.bin: "
                           "the older ones are from the same config too)",
                           t.checkpoint.dir);
}

}  // namespace

uint64_t configHash(const spec::TrainerSpec& t) {
  std::string key = fmt::format("{}|{}|{}|{}|{}|{}|{}|{}|{}", t.model.type, fmt::join(t.model.layers, ","), t.model.activation,
                                t.model.loss, t.data.type, t.data.seed, t.data.train_samples, t.optimizer.type, t.seed);
  // (learning rate, schedule and clipping may change on resume; they do not shape the state)
  // File data: which files, read how. Appended only for them, so that synthetic-data
  // checkpoints written before keep their hash. (The eval set shapes no state.)
  if (t.data.type != "synthetic")
    key += fmt::format("|{}|{}|{}|{}", t.data.path, t.data.labels_path, t.data.label_column, t.data.header ? 1 : 0);
  std::string h = hexToBytes(sha256Hex(key.data(), key.size()));
  uint64_t v = 0;
  std::memcpy(&v, h.data(), sizeof(v));
  return v;
}

std::vector<std::string> configDescription(const spec::TrainerSpec& t) {
  const auto& d = t.data;
  std::string data;
  if (d.type == "synthetic")
    data = fmt::format("synthetic, {} train samples, seed {}", d.train_samples, d.seed);
  else if (d.type == "csv")
    data = fmt::format("csv {}{}, label column {}, {}, seed {}", d.path, d.labels_path.empty() ? "" : ", labels " + d.labels_path,
                       d.label_column, d.header ? "header" : "no header", d.seed);
  else
    data = fmt::format("{} {}, labels {}, seed {}", d.type, d.path, d.labels_path, d.seed);
  return {fmt::format("model: {} {}, {}, {}", t.model.type, fmt::join(t.model.layers, "-"), t.model.activation, t.model.loss),
          "data: " + data, "optimizer: " + t.optimizer.type, fmt::format("seed: {}", t.seed)};
}

namespace {

// Reads one checkpoint file straight into its TrainState, hashing as it goes (on a thread of
// its own): the weights are read into their vectors, not through a copy of the whole file (a
// 200 MB checkpoint took 1.5 s through one). Returns "" or why the file cannot be used.
// peek: the header and the config only, the weights skipped and the checksum not verified
// (what the launcher's pre-check needs of a checkpoint); *counts = the two arrays' lengths.
// namedStep: the step its name says (listCheckpoints), which the file must hold: a copy of
// an older checkpoint under a newer name would be resumed from, and the newer ones pruned.
std::string readCheckpointFile(const fs::path& path, TrainState& s, bool peek = false,
                               std::array<uint64_t, 2>* counts = nullptr, long long namedStep = -1) {
  // (non-blocking: a FIFO named like a checkpoint would block the open until a writer came)
  Fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK));
  if (!fd) return "not readable";
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) return "not readable";
  if (!S_ISREG(st.st_mode)) return "not a regular file";
  ::fcntl(fd.get(), F_SETFL, ::fcntl(fd.get(), F_GETFL) & ~O_NONBLOCK);
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  uint64_t left = 0;  // payload bytes not read yet
  // (declared before the digest: destroyed after its thread is done with them)
  std::string rest;
  std::array<char, 65536> buf;
  std::optional<BackgroundDigest> digest;
  bool hashing = false;  // the payload is; the header and the checksum are not
  if (!peek) digest.emplace();
  auto readRaw = [&](void* dst, size_t n) {
    char* p = static_cast<char*>(dst);
    while (n > 0) {
      const ssize_t got = ::read(fd.get(), p, std::min<size_t>(n, 8u << 20));
      if (got < 0 && errno == EINTR) continue;
      if (got <= 0) return false;
      if (hashing && digest) digest->feed(p, static_cast<size_t>(got));  // hashed while the next chunk is read
      p += got;
      n -= static_cast<size_t>(got);
    }
    return true;
  };
  // A payload piece: within what the length field promised, and hashed.
  auto read = [&](void* dst, size_t n) {
    if (n > left || !readRaw(dst, n)) return false;
    left -= n;
    return true;
  };
  char head[sizeof(kMagic) + 8];
  if (size < sizeof(head) + 32 || !readRaw(head, sizeof(head)) || std::memcmp(head, kMagic, sizeof(kMagic)) != 0)
    return "not a dtrain checkpoint or truncated";
  std::memcpy(&left, head + sizeof(kMagic), sizeof(left));
  if (left != size - sizeof(head) - 32) return "truncated";
  hashing = true;
  size_t which = 0;
  auto floats = [&](std::vector<float>& v) {
    uint64_t n = 0;
    if (!read(&n, sizeof(n)) || n > left / sizeof(float)) return false;
    if (counts) (*counts)[which++] = n;
    if (peek) {
      left -= n * sizeof(float);
      return ::lseek(fd.get(), static_cast<off_t>(n * sizeof(float)), SEEK_CUR) >= 0;
    }
    // (huge pages: faulting in a fresh 7.5 MB vector 4 KiB at a time took 23 ms here, twice
    // the read of the file into it)
    assignFresh(v, n);
    return read(v.data(), n * sizeof(float));
  };
  bool ok = read(&s.config_hash, sizeof(s.config_hash)) && read(&s.step, sizeof(s.step)) &&
            read(&s.epoch, sizeof(s.epoch)) && read(&s.cursor, sizeof(s.cursor)) && read(&s.world, sizeof(s.world)) &&
            floats(s.params) && floats(s.momentum);
  // The config's description, in files written since it was kept.
  if (ok) {
    rest.resize(left);
    ok = read(rest.data(), rest.size());
  }
  if (!peek) {
    // The checksum decides first: a damaged file is "corrupt", whatever its fields read as.
    // Fields that overran the payload leave the rest of it to hash.
    while (left > 0) {
      const size_t n = std::min<uint64_t>(left, buf.size());
      if (!read(buf.data(), n)) return "truncated";
      digest->drain();  // (buf is read into again)
    }
    unsigned char want[32];
    const auto sum = digest->finish();
    digest.reset();
    hashing = false;
    if (!readRaw(want, sizeof(want)) || std::memcmp(want, sum.data(), sizeof(want)) != 0)
      return "corrupt (checksum mismatch)";
  }
  if (!ok) return "malformed";
  // (a header with a valid checksum is still not trusted: a step below 0 or beyond any run
  // would name files "ckpt--000000001.bin" or pass for a completed job)
  // (every epoch takes a step at least, and the trainer counts epochs in an int)
  if (s.step < 0 || s.step > (1ll << 53) || s.epoch < 0 || s.epoch > s.step + 1 || s.epoch > INT32_MAX || s.world < 1 ||
      s.world > (1ll << 24))
    return fmt::format("malformed (step {}, epoch {}, world size {}: out of range)", s.step, s.epoch, s.world);
  if (namedStep >= 0 && s.step != namedStep)
    return fmt::format("malformed (named for step {}, it holds step {}: a copy of another checkpoint?)", namedStep,
                       s.step);
  // The writer refuses weights that are not finite: a file holding them is not its own.
  if (!peek && (!detail::allFinite(s.params.data(), s.params.size()) ||
                !detail::allFinite(s.momentum.data(), s.momentum.size())))
    return "malformed (weights or optimizer state that are not finite numbers)";
  size_t p = 0;
  uint64_t parts = 0;
  ok = rest.empty() || (get(std::string_view(rest), p, parts) && parts <= 64);
  for (uint64_t i = 0; ok && i < parts; ++i) ok = getString(rest, p, s.config.emplace_back());
  // Sections: tag, length, bytes.
  while (ok && p < rest.size()) {
    char tag[8];
    uint64_t n = 0;
    ok = get(std::string_view(rest), p, tag) && get(std::string_view(rest), p, n) && n <= rest.size() - p;
    if (!ok) break;
    const std::string_view body = std::string_view(rest).substr(p, n);
    if (std::memcmp(tag, kScheduleTag, sizeof(tag)) == 0) {
      ScheduleState& sc = s.schedule.emplace();
      size_t q = 0;
      ok = get(body, q, sc.samples) && get(body, q, sc.reference_batch) && get(body, q, sc.global_batch) &&
           get(body, q, sc.anchor_samples) && get(body, q, sc.anchor_progress) && q == body.size();
    } else if (std::memcmp(tag, kRowsTag, sizeof(tag)) == 0) {
      size_t q = 0;
      ok = get(body, q, s.train_rows) && q == body.size() && s.train_rows > 0;
    }
    p += n;
  }
  if (!ok || p != rest.size()) return "malformed";
  return "";
}

// checkpointMismatch() of a checkpoint whose arrays hold nParams and nState floats (read, or
// only counted by a peek).
std::string mismatchText(const spec::TrainerSpec& t, const TrainState& s, uint64_t nParams, uint64_t nState,
                         const std::string& path, size_t params) {
  const bool adam = t.optimizer.type == "adamw";
  const bool sizesAgree = params == 0 || (nParams == params && nState == params * (adam ? 2 : 1));
  if (s.config_hash == configHash(t) && sizesAgree) return "";
  std::string what;
  if (!s.config.empty()) {
    // Both descriptions: name each part that differs, with both values.
    const auto mine = configDescription(t);
    std::vector<std::string> diffs;
    for (const auto& m : mine)
      for (const auto& c : s.config)
        if (partName(c) == partName(m) && c != m)
          diffs.push_back(fmt::format("the {} changed (checkpoint: {}; this spec: {})", partName(m),
                                      c.substr(partName(c).size() + 2), m.substr(partName(m).size() + 2)));
    what = fmt::format("{}", fmt::join(diffs, "; "));
  } else if (params > 0 && nParams != params) {
    what = fmt::format("the model changed (the checkpoint holds {} parameters, this spec's model has {})", nParams, params);
  } else if (params > 0 && nState != params * (adam ? 2 : 1)) {
    what = fmt::format("the optimizer changed (the checkpoint holds {} state, this spec uses {})",
                       nState == 2 * nParams ? "adamw" : "sgd", t.optimizer.type);
  }
  if (what.empty()) what = "the model, data, optimizer or seed changed";
  return fmt::format("the newest checkpoint {} (step {}) was written by a different trainer config: {}", path, s.step, what);
}

}  // namespace

std::string checkpointMismatch(const spec::TrainerSpec& t, const TrainState& s, const std::string& path, size_t params) {
  return mismatchText(t, s, s.params.size(), s.momentum.size(), path, params);
}

namespace {

// A layout in words: what wrote a directory, and what this job is.
std::string layoutWords(int stages, const std::vector<int>& stageLayers, bool writer) {
  if (stages <= 1)
    return writer ? "the data-parallel trainer (pipeline_stages 1)" : "data-parallel (pipeline_stages 1)";
  return stageLayers.empty()
             ? fmt::format("a pipeline of {} stages", stages)
             : fmt::format("a pipeline of {} stages with layers per stage [{}]", stages, fmt::join(stageLayers, ", "));
}

// The spec settings of a layout, for the fix.
std::string layoutSettings(int stages, const std::vector<int>& stageLayers) {
  if (stages <= 1) return "pipeline_stages 1";
  return stageLayers.empty()
             ? fmt::format("pipeline_stages {}", stages)
             : fmt::format("pipeline_stages {} with stage_layers [{}]", stages, fmt::join(stageLayers, ", "));
}

// The newest intact checkpoint in `dir` (its checksum verified: junk named like one, or a
// damaged one, is no evidence of another job); nullopt when there is none.
std::optional<std::pair<long long, std::string>> newestIntact(const std::string& dir) {
  for (const auto& [step, path] : listCheckpoints(dir)) {
    TrainState st;
    if (readCheckpointFile(path, st, false, nullptr, step).empty()) return std::make_pair(st.step, path.string());
  }
  return std::nullopt;
}

// DIR's stage directories of a pipeline: stages -> the stage numbers found (stage-<p>-of-<P>).
std::map<int, std::vector<int>> stageDirectories(const std::string& dir) {
  std::map<int, std::vector<int>> out;
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    int p = 0, n = 0, used = 0;
    if (std::sscanf(name.c_str(), "stage-%d-of-%d%n", &p, &n, &used) != 2 || used != static_cast<int>(name.size()) ||
        p < 0 || n < 1 || p >= n || name != fmt::format("stage-{}-of-{}", p, n))
      continue;
    std::error_code dec;
    if (it->is_directory(dec)) out[n].push_back(p);
  }
  for (auto& [n, stages] : out) std::sort(stages.begin(), stages.end());
  return out;
}

}  // namespace

std::string checkpointLayoutMismatch(const spec::TrainerSpec& t, const std::function<void(const std::string&)>& warn) {
  const std::string& dir = t.checkpoint.dir;
  if (dir.empty()) return "";
  const int P = std::max(1, t.parallel.pipeline_stages);
  std::vector<int> mine;
  if (P > 1) {
    const std::vector<int> first = partitionStages(t.model.layers, P, t.parallel.stage_layers);
    for (int s = 0; s < P; ++s) mine.push_back(first[static_cast<size_t>(s) + 1] - first[static_cast<size_t>(s)]);
  }
  const std::string manifestPath = (fs::path(dir) / "manifest.json").string();
  std::optional<spec::PipelineManifest> manifest;
  try {
    manifest = spec::readPipelineManifest(manifestPath);
  } catch (const SpecError& e) {
    if (warn && P > 1) warn(fmt::format("{}; resuming from the stage checkpoints alone", e.what()));
  }
  auto refusal = [&](const std::string& file, long long step, int stages, const std::vector<int>& layers,
                     const std::string& remove) {
    return fmt::format(
        "{} (step {}) was written by {}, this job is {}; checkpoints resume only in the layout that "
        "wrote them: use another /trainer/checkpoint/dir, or {} (the layout they were written with), "
        "or remove them ({})",
        file, step, layoutWords(stages, layers, true), layoutWords(P, mine, false), layoutSettings(stages, layers),
        remove);
  };
  auto pipelineFiles = [&](int stages) {
    return fmt::format("the stage-*-of-{}/ directories{} in {}", stages,
                       manifest && manifest->stages == stages ? " and manifest.json" : "", dir);
  };
  // A pipeline's manifest names its layout: another stage count or partition (with the same
  // stage count its stage directories are this job's names, holding other layers).
  if (P > 1 && manifest && (manifest->stages != P || manifest->stage_layers != mine))
    return refusal(manifestPath, manifest->step, manifest->stages, manifest->stage_layers,
                   pipelineFiles(manifest->stages));
  // The other layout's intact checkpoints: the newest of each kind found.
  struct Other {
    std::string file, remove;
    long long step;
    int stages;
    std::vector<int> layers;
  };
  std::vector<Other> others;
  // The data-parallel trainer's checkpoints, in a pipeline job's directory.
  if (P > 1)
    if (auto found = newestIntact(dir))
      others.push_back({found->second, fmt::format("every ckpt-*.bin in {}", dir), found->first, 1, {}});
  // Stage directories of another stage count (a data-parallel job: any), manifest or not (a
  // run stopped before its first manifest).
  bool ownStages = false;
  for (const auto& [stages, present] : stageDirectories(dir)) {
    for (int p : present) {
      auto found = newestIntact(fmt::format("{}/stage-{}-of-{}", dir, p, stages));
      if (!found) continue;
      if (stages == P) {
        ownStages = true;
        continue;
      }
      const std::vector<int> layers = manifest && manifest->stages == stages ? manifest->stage_layers : std::vector<int>{};
      others.push_back({found->second, pipelineFiles(stages), found->first, stages, layers});
      break;
    }
  }
  if (others.empty()) return "";
  // This job's own checkpoints are there too (a directory from before this check, where
  // both layouts trained): it resumes from them, and the others are left alone, said once.
  const bool own = P > 1 ? ownStages : newestIntact(dir).has_value();
  if (own) {
    if (warn)
      for (const auto& o : others)
        warn(fmt::format("{} (step {}) was written by {}; left alone: this job ({}) resumes from its own checkpoints "
                         "there (remove {} to tidy the directory)",
                         o.file, o.step, layoutWords(o.stages, o.layers, true), layoutWords(P, mine, false), o.remove));
    return "";
  }
  const Other& o = others.front();
  return refusal(o.file, o.step, o.stages, o.layers, o.remove);
}

std::string checkpointLayoutRefusal(const std::string& detail) {
  return "trainer: /trainer/parallel/pipeline_stages: " + detail;
}

std::string stageFilesLost(const spec::TrainerSpec& t, const std::vector<bool>& heldNone) {
  const int P = static_cast<int>(heldNone.size());
  if (t.checkpoint.dir.empty() || P < 2 || std::all_of(heldNone.begin(), heldNone.end(), [](bool b) { return b; }))
    return "";
  const std::string manifestPath = (fs::path(t.checkpoint.dir) / "manifest.json").string();
  std::optional<spec::PipelineManifest> m;
  try {
    m = spec::readPipelineManifest(manifestPath);
  } catch (const SpecError&) {
    return "";  // (said by checkpointLayoutMismatch; the stage files decide)
  }
  if (!m || m->stages != P || m->step <= 0 || static_cast<int>(m->files.size()) != P) return "";
  for (int p = 0; p < P; ++p) {
    if (!heldNone[static_cast<size_t>(p)]) continue;
    const fs::path file = fs::path(t.checkpoint.dir) / m->files[static_cast<size_t>(p)];
    std::error_code ec;
    return fmt::format(
        "{} says every stage wrote step {}, but stage {} holds no intact checkpoint now ({} is {}): restore "
        "it, or remove the stage-*-of-{}/ directories and manifest.json in {} to start from step 0",
        manifestPath, m->step, p, file.string(), fs::exists(file, ec) ? "damaged" : "missing", P, t.checkpoint.dir);
  }
  return "";
}

Fd prepareCheckpointDir(const spec::TrainerSpec& t, const std::string& source, double lockWaitS) {
  const std::string& dir = t.checkpoint.dir;
  if (dir.empty()) return Fd();
  const std::string where = fmt::format("{}: /trainer/checkpoint/dir", source.empty() ? "job" : source);
  const std::string fix = "give a directory that can be written (on node 0's host, where rank 0 writes checkpoints)";
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec || !fs::is_directory(dir)) {
    // Say which part of the path is in the way, as the user would look for it.
    fs::path p = fs::path(dir).lexically_normal();
    std::error_code ec2;
    while (!fs::exists(p, ec2) && p.has_parent_path() && p.parent_path() != p) p = p.parent_path();
    const std::string why = fs::exists(p, ec2) && !fs::is_directory(p, ec2) ? p.string() + " is not a directory"
                            : ec                                         ? ec.message()
                                                                         : "not a directory";
    throw SpecError(fmt::format("{}: cannot create \"{}\": {}; {}", where, dir, why, fix));
  }
  // Creatable is not writable (a read-only mount, another user's directory, /proc): a file is
  // made and removed, as a checkpoint's temporary file would be.
  const std::string probe = (fs::path(dir) / fmt::format(".dtrain-write-check-{}", ::getpid())).string();
  const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) throw SpecError(fmt::format("{}: cannot write in \"{}\": {}; {}", where, dir, std::strerror(errno), fix));
  ::close(fd);
  ::unlink(probe.c_str());
  // One job per directory, for the whole job (the caller keeps the lock; tryLockDirectory).
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(static_cast<long>(lockWaitS * 1000));
  DirectoryLock lock = tryLockDirectory(dir);
  while (lock.busy && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    lock = tryLockDirectory(dir);
  }
  if (lock.open_failed) throw SpecError(fmt::format("{}: {}; {}", where, lock.unsupported, fix));
  if (!lock.unsupported.empty()) {
    // A file system without flock (Lustre without -o flock, NFSv3 without lockd): no lock
    // rather than no job. Said once.
    fmt::print(stderr, "dtrain: warning: {}: {}; running without the one-job-per-directory check\n", where,
               lock.unsupported);
    return Fd();
  }
  if (lock.busy)
    throw SpecError(fmt::format("{}: \"{}\" is in use by another dtrain job ({}); two jobs writing one checkpoint "
                                "directory would overwrite and prune each other's checkpoints: wait for that job to end "
                                "or stop it, or use another /trainer/checkpoint/dir",
                                where, dir, lock.holder.empty() ? "its lock is held" : lock.holder));
  // Checkpoints of another layout would not be found (a fresh start beside them) or would be
  // refused by the trainer: said here, before the config of this layout's own.
  if (const std::string why = checkpointLayoutMismatch(t); !why.empty())
    throw SpecError(fmt::format("{}: /trainer/parallel/pipeline_stages: {}", source.empty() ? "job" : source, why));
  // A checkpoint of another config would be refused by rank 0 on every attempt: said here.
  const int stages = std::max(1, t.parallel.pipeline_stages);
  size_t params = 0;
  if (stages == 1)
    for (size_t i = 0; i + 1 < t.model.layers.size(); ++i)
      params += static_cast<size_t>(t.model.layers[i]) * static_cast<size_t>(t.model.layers[i + 1]) +
                static_cast<size_t>(t.model.layers[i + 1]);
  // The newest checkpoint whose header and config read back, peeked at: its weights are
  // neither read nor hashed here (rank 0 does that on resume), which for a large model
  // would add seconds to every launch.
  for (int p = 0; p < stages; ++p) {
    const std::string d = stages == 1 ? dir : fmt::format("{}/stage-{}-of-{}", dir, p, stages);
    for (const auto& [step, path] : listCheckpoints(d)) {
      TrainState st;
      std::array<uint64_t, 2> counts{};
      if (!readCheckpointFile(path, st, /*peek=*/true, &counts, step).empty()) continue;
      if (mismatchText(t, st, counts[0], counts[1], path.string(), params).empty()) break;
      // A refusal is made on a verified file only: a damaged one (its config hash hit) is
      // skipped, as rank 0 would skip it, for the next.
      TrainState full;
      if (!readCheckpointFile(path, full, false, nullptr, step).empty()) continue;
      const std::string why = checkpointMismatch(t, full, path.string(), params);
      if (!why.empty()) throw SpecError(fmt::format("{}: {}; {}", where, why, fixText(t)));
      break;
    }
  }
  // Stages that each hold steps, none of them in common, would be refused by the trainer on
  // every rank (pipeline.cc): said here. (A stage with none starts all over: fine.)
  if (stages > 1) {
    // (peeked first; a refusal is made on files read whole only, as the trainer reads them: a
    // stage whose files are all damaged holds none, and every stage then starts over)
    auto heldSteps = [&](bool peek) {
      std::vector<std::vector<long long>> held(static_cast<size_t>(stages));
      for (int p = 0; p < stages; ++p)
        for (const auto& [step, path] : listCheckpoints(fmt::format("{}/stage-{}-of-{}", dir, p, stages))) {
          TrainState st;
          if (readCheckpointFile(path, st, peek, nullptr, step).empty()) held[static_cast<size_t>(p)].push_back(step);
        }
      return held;
    };
    auto noCommonStep = [&](const std::vector<std::vector<long long>>& held) {
      if (!std::all_of(held.begin(), held.end(), [](const auto& h) { return !h.empty(); })) return false;
      for (long long step : held.front())
        if (std::all_of(held.begin(), held.end(),
                        [&](const auto& h) { return std::find(h.begin(), h.end(), step) != h.end(); }))
          return false;
      return true;
    };
    std::vector<std::vector<long long>> held = heldSteps(true);
    bool whole = false;  // held is of files read whole
    auto readWhole = [&] {
      if (!whole) held = heldSteps(false);
      whole = true;
    };
    // A stage holding none while the manifest says it wrote a step: its files were lost.
    auto lost = [&] {
      std::vector<bool> none;
      for (const auto& h : held) none.push_back(h.empty());
      return stageFilesLost(t, none);
    };
    if (!lost().empty()) {
      readWhole();
      if (const std::string why = lost(); !why.empty()) throw SpecError(fmt::format("{}: {}", where, why));
    }
    if (noCommonStep(held)) readWhole();
    if (noCommonStep(held)) {
      std::string each;
      for (int p = 0; p < stages; ++p)
        each += fmt::format("{}stage {} at step {}", p == 0 ? "" : ", ", p,
                            *std::max_element(held[static_cast<size_t>(p)].begin(), held[static_cast<size_t>(p)].end()));
      throw SpecError(fmt::format("{}: the stage checkpoints in {} have no step in common ({}); remove them or use "
                                  "another /trainer/checkpoint/dir",
                                  where, dir, each));
    }
  }
  return std::move(lock.fd);
}

std::string checkpointLockLost(const spec::TrainerSpec& t, const Fd& lock) {
  if (!lock || t.checkpoint.dir.empty()) return "";
  const PathHold hold = pathStillNames(lock, (fs::path(t.checkpoint.dir) / ".dtrain.lock").string());
  if (hold == PathHold::kSame) return "";
  // The directory still there: the lock file alone was removed (it outlives the jobs that
  // held it and looks stale), or the directory was removed and made again.
  std::error_code ec;
  if (fs::is_directory(t.checkpoint.dir, ec))
    return fmt::format(
        "not restarted: {}/.dtrain.lock, the lock that keeps one job per directory, was removed or replaced while "
        "the job ran (the file alone, or with its directory, whose checkpoints are then gone): another job may be "
        "writing in {} now, and restarted workers would overwrite and prune its checkpoints: run the job again "
        "once no other job uses the directory, or set another /trainer/checkpoint/dir",
        t.checkpoint.dir, t.checkpoint.dir);
  const bool removed = hold == PathHold::kRemoved || hold == PathHold::kReplaced;
  return fmt::format(
      "not restarted: /trainer/checkpoint/dir {} was {} while the job ran; the checkpoints in it are gone for this "
      "job, and restarted workers would make it again without the lock that keeps one job per directory: run the "
      "job again, or set another /trainer/checkpoint/dir",
      t.checkpoint.dir, removed ? "removed" : "moved away or replaced");
}

std::string checkpointRefusal(const spec::TrainerSpec& t, const std::string& detail) {
  return fmt::format("trainer: {}; {}", detail, fixText(t));
}

std::string resumeLine(const std::string& path, const int64_t header[5], int world, bool complete,
                       const spec::TrainerSpec& t) {
  if (complete)
    return fmt::format("resuming from {}: step {}, which completes the job ({}); nothing left to train (written by {} "
                       "workers, now {})",
                       path, header[1],
                       t.max_steps > 0 && header[1] >= t.max_steps ? fmt::format("max_steps {}", t.max_steps)
                                                                   : fmt::format("{} epoch{}", t.epochs, t.epochs == 1 ? "" : "s"),
                       header[4], world);
  return fmt::format("resuming from {}: step {}, epoch {}, sample {} of the epoch (written by {} workers, now {})", path,
                     header[1], header[2] + 1, header[3], header[4], world);
}

std::string saveCheckpoint(const std::string& dir, const TrainState& s, int keep,
                           const std::function<void(const std::string&)>& warn, const std::function<void()>& progress) {
  return saveCheckpoint(dir, CheckpointView{s.config_hash, s.step, s.epoch, s.cursor, s.world, s.params, s.momentum, s.config,
                                            s.schedule, s.train_rows},
                        keep, warn, progress);
}

std::string saveCheckpoint(const std::string& dir, const CheckpointView& s, int keep,
                           const std::function<void(const std::string&)>& warn, const std::function<void()>& progress) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) throw IoError(fmt::format("checkpoint: cannot create {}: {}", dir, ec.message()));
  Fd dirFd(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (!dirFd) throwErrno("checkpoint: cannot open " + dir);
  return saveCheckpointAt(dirFd.get(), dir, s, keep, warn, progress);
}

std::string saveCheckpointAt(int dirFd, const std::string& dir, const CheckpointView& s, int keep,
                             const std::function<void(const std::string&)>& warn,
                             const std::function<void()>& progress) {
  // Hashed (on a thread of its own) and written from the pieces' own buffers: no copy of the
  // weights is made.
  // (Assembled in one string first, the 15 MB checkpoint of a 1.9M-parameter model cost
  // ~250 ms in copies and page faults of fresh buffers, stalling every rank; now ~30 ms.)
  std::string head, mid, tail;
  put(head, s.config_hash);
  put(head, s.step);
  put(head, s.epoch);
  put(head, s.cursor);
  put(head, s.world);
  put(head, static_cast<uint64_t>(s.params.size()));
  put(mid, static_cast<uint64_t>(s.momentum.size()));
  put(tail, static_cast<uint64_t>(s.config.size()));
  for (const auto& c : s.config) putString(tail, c);
  if (s.schedule) {
    tail.append(kScheduleTag, sizeof(kScheduleTag));
    put(tail, uint64_t{5 * 8});
    put(tail, s.schedule->samples);
    put(tail, s.schedule->reference_batch);
    put(tail, s.schedule->global_batch);
    put(tail, s.schedule->anchor_samples);
    put(tail, s.schedule->anchor_progress);
  }
  if (s.train_rows > 0) {
    tail.append(kRowsTag, sizeof(kRowsTag));
    put(tail, uint64_t{8});
    put(tail, s.train_rows);
  }
  struct Piece {
    const char* data;
    size_t bytes;
  };
  const Piece pieces[] = {{head.data(), head.size()},
                          {reinterpret_cast<const char*>(s.params.data()), s.params.size() * sizeof(float)},
                          {mid.data(), mid.size()},
                          {reinterpret_cast<const char*>(s.momentum.data()), s.momentum.size() * sizeof(float)},
                          {tail.data(), tail.size()}};
  uint64_t payloadBytes = 0;
  for (const auto& pc : pieces) payloadBytes += pc.bytes;
  BackgroundDigest digest;  // hashed while the pieces are written
  for (const auto& pc : pieces) digest.feed(pc.data, pc.bytes);
  std::string front(kMagic, sizeof(kMagic));
  put(front, payloadBytes);

  const std::string name = fmt::format("ckpt-{:010d}.bin", s.step), tmpName = name + ".tmp";
  const std::string path = checkpointPath(dir, s.step), tmp = path + ".tmp";
  Fd fd(::openat(dirFd, tmpName.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0666));
  if (!fd) throwErrno("checkpoint: cannot create " + tmp);
  try {  // a failed write (a full disk) leaves no partial file taking space
    auto writeOut = [&](const char* p, size_t n) {
      // In chunks, with `progress` between them: a large model's write is not a silence.
      constexpr size_t kChunk = 64u << 20;
      while (n > 0) {
        const ssize_t w = ::write(fd.get(), p, std::min(n, kChunk));
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) throwErrno("checkpoint: cannot write " + tmp);
        p += w;
        n -= static_cast<size_t>(w);
        if (progress) progress();
      }
    };
    writeOut(front.data(), front.size());
    for (const auto& pc : pieces) writeOut(pc.data, pc.bytes);
    const auto sum = digest.finish();
    writeOut(reinterpret_cast<const char*>(sum.data()), sum.size());
    if (::fsync(fd.get()) != 0) throwErrno("checkpoint: fsync " + tmp);
    fd.reset();
  } catch (...) {
    ::unlinkat(dirFd, tmpName.c_str(), 0);
    throw;
  }
  if (::renameat(dirFd, tmpName.c_str(), dirFd, name.c_str()) != 0) throwErrno("checkpoint: rename " + tmp);
  if (::fsync(dirFd) != 0) throwErrno("checkpoint: fsync " + dir);
  // Prune: only files that are checkpoints count toward `keep` and may go; the one just
  // written always stays. Anything else named like one (junk, another tool's file) is left
  // alone: counting it deleted every real checkpoint right after it was written. So are
  // checkpoints of later steps than this one: this run resumed from an older step, so the
  // resume skipped them (damaged, or another config's), and counted as the newest they took
  // the place of this run's own (3 damaged files kept, and every good one but the newest
  // deleted). (A pipeline stage sent back to the stages' common step writes those steps again.)
  static std::mutex warnedMu;
  static std::set<std::string> warned;
  const std::vector<std::string> names = entriesAt(dirFd);
  std::vector<std::pair<long long, std::string>> kept;
  for (const auto& n : names)
    if (const auto step = namedStep(n)) kept.emplace_back(*step, n);
  std::sort(kept.begin(), kept.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  int valid = 0;
  for (const auto& [step, file] : kept) {
    if (file == name) {
      ++valid;
      continue;
    }
    if (!looksLikeCheckpointAt(dirFd, file)) {
      const std::string shown = (fs::path(dir) / file).string();
      std::lock_guard<std::mutex> lk(warnedMu);
      if (warn && warned.insert(shown).second)
        warn(fmt::format("{} is named like a checkpoint but is not a dtrain checkpoint (or is truncated); it is not "
                         "counted among the {} kept and is left alone: remove it if it is not needed",
                         shown, std::max(keep, 1)));
      continue;
    }
    if (step > s.step) continue;
    if (++valid > std::max(keep, 1)) ::unlinkat(dirFd, file.c_str(), 0);
  }
  // A write cut short (the writer killed mid-write: a restart, a lost node) leaves its
  // ckpt-<step>.bin.tmp behind, as large as a checkpoint. One of an older step than this one
  // can never be completed by a writer of this job: the writer of a directory is one rank,
  // and steps only grow.
  // Best effort: the checkpoint is durable already, so no error here fails the save.
  for (const auto& n : names)
    if (const auto step = namedStep(n, ".tmp"); step && *step < s.step) ::unlinkat(dirFd, n.c_str(), 0);
  return path;
}

std::string checkpointPath(const std::string& dir, long long step) {
  return (fs::path(dir) / fmt::format("ckpt-{:010d}.bin", step)).string();
}

std::string resumeFile(const spec::TrainerSpec& t, long long step) {
  const std::string& dir = t.checkpoint.dir;
  if (dir.empty()) return "";
  return t.parallel.pipeline_stages > 1 ? (fs::path(dir) / "manifest.json").string() : checkpointPath(dir, step);
}

bool holdsCheckpointFiles(const std::string& dir) {
  if (!listCheckpoints(dir).empty()) return true;
  for (const auto& [stages, present] : stageDirectories(dir))
    for (int p : present)
      if (!listCheckpoints(fmt::format("{}/stage-{}-of-{}", dir, p, stages)).empty()) return true;
  return false;
}

std::string checkpointWriteRefusal(const std::string& dir, long long step, const std::string& error) {
  // saveCheckpoint's errors read "checkpoint: <what> <path>: <OS error>": the OS error first,
  // what failed after it.
  std::string what = error;
  for (const char* prefix : {"checkpoint manifest: ", "checkpoint: "})
    if (what.rfind(prefix, 0) == 0) {
      what.erase(0, std::char_traits<char>::length(prefix));
      break;
    }
  const size_t colon = what.rfind(": ");
  const std::string os = colon == std::string::npos ? what : what.substr(colon + 2);
  const std::string detail = colon == std::string::npos ? std::string() : fmt::format(" ({})", what.substr(0, colon));
  return fmt::format("trainer: /trainer/checkpoint/dir: cannot write the checkpoint of step {} in {}: {}{}; the "
                     "checkpoints written there before are intact: free space on it (or make it writable again) and "
                     "run the job again to resume from the newest, or set another /trainer/checkpoint/dir",
                     step, dir, os, detail);
}

std::string trainRowsMismatch(const spec::TrainerSpec& t, uint64_t rows, uint64_t checkpointRows,
                              const std::string& checkpoint) {
  if (checkpointRows == 0 || checkpointRows == rows) return "";
  const std::string why =
      t.data.type == "synthetic"
          ? std::string("the data changed")
          : t.data.eval_path.empty()
                ? fmt::format("{} changed, or /trainer/data/eval_path was removed (without it the last 10% of the "
                              "file is held out for evaluation)",
                              t.data.path)
                : fmt::format("{} changed, or /trainer/data/eval_path was added (with it the whole file trains)",
                              t.data.path);
  return fmt::format("trainer: /trainer/data: the training set has {} rows, and {} was written when it had {}: {}; "
                     "each epoch's order is a permutation of the rows, so resuming would repeat and skip samples: "
                     "use the data as it was, or another /trainer/checkpoint/dir to start over",
                     rows, checkpoint, checkpointRows, why);
}

std::optional<TrainState> loadLatestCheckpoint(const std::string& dir, const std::function<void(const std::string&)>& warn,
                                               std::string* pathOut, long long maxStep) {
  for (const auto& [step, path] : listCheckpoints(dir)) {
    if (maxStep >= 0 && step > maxStep) continue;
    TrainState s;
    if (const std::string why = readCheckpointFile(path, s, false, nullptr, step); !why.empty()) {
      if (warn) warn(fmt::format("checkpoint {} is {}; skipping it", path.string(), why));
      continue;
    }
    if (pathOut) *pathOut = path.string();
    return s;
  }
  return std::nullopt;
}

}  // namespace dtrain::train
