#include "dtrain/train/checkpoint.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>

#include <fmt/format.h>

#include "dtrain/common/errors.h"
#include "dtrain/train/trainer.h"

namespace dtrain::train {
namespace {

namespace fs = std::filesystem;
constexpr char kMagic[8] = {'D', 'T', 'R', 'C', 'K', 'P', 'T', '1'};

template <typename T>
void put(std::string& b, const T& v) {
  b.append(reinterpret_cast<const char*>(&v), sizeof(T));
}

template <typename T>
bool get(const std::string& b, size_t& pos, T& v) {
  if (b.size() - pos < sizeof(T)) return false;
  std::memcpy(&v, b.data() + pos, sizeof(T));
  pos += sizeof(T);
  return true;
}

bool getFloats(const std::string& b, size_t& pos, std::vector<float>& v) {
  uint64_t n = 0;
  if (!get(b, pos, n) || n > (b.size() - pos) / sizeof(float)) return false;
  v.resize(n);
  std::memcpy(v.data(), b.data() + pos, n * sizeof(float));
  pos += n * sizeof(float);
  return true;
}

std::string hexToBytes(const std::string& hex) {
  std::string out;
  for (size_t i = 0; i + 1 < hex.size(); i += 2) out.push_back(static_cast<char>(std::stoi(hex.substr(i, 2), nullptr, 16)));
  return out;
}

void fsyncPath(const std::string& path, int flags) {
  int fd = ::open(path.c_str(), flags | O_CLOEXEC);
  if (fd < 0) throwErrno("open " + path);
  if (::fsync(fd) != 0) {
    ::close(fd);
    throwErrno("fsync " + path);
  }
  ::close(fd);
}

std::vector<std::pair<long long, fs::path>> listCheckpoints(const std::string& dir) {
  std::vector<std::pair<long long, fs::path>> out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    std::string name = e.path().filename().string();
    if (name.rfind("ckpt-", 0) != 0 || name.size() < 10 || name.substr(name.size() - 4) != ".bin") continue;
    try {
      out.emplace_back(std::stoll(name.substr(5, name.size() - 9)), e.path());
    } catch (...) {
    }
  }
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  return out;
}

}  // namespace

uint64_t configHash(const spec::TrainerSpec& t) {
  std::string key = fmt::format("{}|{}|{}|{}|{}|{}|{}|{}|{}", t.model.type, fmt::join(t.model.layers, ","), t.model.activation,
                                t.model.loss, t.data.type, t.data.seed, t.data.train_samples, t.optimizer.type, t.seed);
  // (learning rate, schedule and clipping may change on resume; they do not shape the state)
  std::string h = hexToBytes(sha256Hex(key.data(), key.size()));
  uint64_t v = 0;
  std::memcpy(&v, h.data(), sizeof(v));
  return v;
}

std::string saveCheckpoint(const std::string& dir, const TrainState& s, int keep) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) throw IoError(fmt::format("checkpoint: cannot create {}: {}", dir, ec.message()));
  std::string payload;
  put(payload, s.config_hash);
  put(payload, s.step);
  put(payload, s.epoch);
  put(payload, s.cursor);
  put(payload, s.world);
  put(payload, static_cast<uint64_t>(s.params.size()));
  payload.append(reinterpret_cast<const char*>(s.params.data()), s.params.size() * sizeof(float));
  put(payload, static_cast<uint64_t>(s.momentum.size()));
  payload.append(reinterpret_cast<const char*>(s.momentum.data()), s.momentum.size() * sizeof(float));
  std::string file(kMagic, sizeof(kMagic));
  put(file, static_cast<uint64_t>(payload.size()));
  file += payload;
  file += hexToBytes(sha256Hex(payload.data(), payload.size()));

  std::string path = (fs::path(dir) / fmt::format("ckpt-{:010d}.bin", s.step)).string();
  std::string tmp = path + ".tmp";
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    f.write(file.data(), static_cast<std::streamsize>(file.size()));
    if (!f) throw IoError(fmt::format("checkpoint: cannot write {}", tmp));
  }
  fsyncPath(tmp, O_RDONLY);
  if (std::rename(tmp.c_str(), path.c_str()) != 0) throwErrno("checkpoint: rename " + tmp);
  fsyncPath(dir, O_RDONLY | O_DIRECTORY);
  auto all = listCheckpoints(dir);
  for (size_t i = static_cast<size_t>(std::max(keep, 1)); i < all.size(); ++i) fs::remove(all[i].second, ec);
  return path;
}

std::optional<TrainState> loadLatestCheckpoint(const std::string& dir, const std::function<void(const std::string&)>& warn,
                                               std::string* pathOut, long long maxStep) {
  for (const auto& [step, path] : listCheckpoints(dir)) {
    if (maxStep >= 0 && step > maxStep) continue;
    std::ifstream f(path, std::ios::binary);
    std::string b((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    auto bad = [&](const std::string& why) {
      if (warn) warn(fmt::format("checkpoint {} is {}; skipping it", path.string(), why));
    };
    uint64_t len = 0;
    size_t pos = sizeof(kMagic);
    if (b.size() < sizeof(kMagic) + 8 + 32 || std::memcmp(b.data(), kMagic, sizeof(kMagic)) != 0) {
      bad("not a dtrain checkpoint or truncated");
      continue;
    }
    get(b, pos, len);
    if (len != b.size() - sizeof(kMagic) - 8 - 32) {
      bad("truncated");
      continue;
    }
    std::string payload = b.substr(pos, len);
    if (hexToBytes(sha256Hex(payload.data(), payload.size())) != b.substr(pos + len)) {
      bad("corrupt (checksum mismatch)");
      continue;
    }
    TrainState s;
    size_t p = 0;
    if (!get(payload, p, s.config_hash) || !get(payload, p, s.step) || !get(payload, p, s.epoch) ||
        !get(payload, p, s.cursor) || !get(payload, p, s.world) || !getFloats(payload, p, s.params) ||
        !getFloats(payload, p, s.momentum) || p != payload.size()) {
      bad("malformed");
      continue;
    }
    if (pathOut) *pathOut = path.string();
    return s;
  }
  return std::nullopt;
}

}  // namespace dtrain::train
