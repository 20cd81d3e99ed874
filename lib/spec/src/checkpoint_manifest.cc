#include "dtrain/spec/checkpoint_manifest.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <fmt/format.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "dtrain/common/errors.h"
#include "dtrain/common/fd.h"

namespace dtrain::spec {
namespace {

constexpr const char* kFormat = "dtrain-pipeline-checkpoint/1";
// A manifest names one file per stage: a few KiB even for hundreds of stages.
constexpr off_t kMaxManifestBytes = 1 << 20;

void fsyncPath(const std::string& path, int flags) {
  int fd = ::open(path.c_str(), flags | O_CLOEXEC);
  if (fd < 0) throwErrno("checkpoint manifest: open " + path);
  int rc = ::fsync(fd);
  ::close(fd);
  if (rc != 0) throwErrno("checkpoint manifest: fsync " + path);
}

}  // namespace

void writePipelineManifest(const std::string& path, const PipelineManifest& m, int dirFd) {
  nlohmann::json j = {{"format", kFormat},
                      {"step", m.step},
                      {"epoch", m.epoch},
                      {"cursor", m.cursor},
                      {"world", m.world},
                      {"stages", m.stages},
                      {"stage_layers", m.stage_layers},
                      {"config_hash", m.config_hash},
                      {"files", m.files}};
  const std::string tmp = path + ".tmp";
  const std::string text = j.dump(2) + "\n";
  // (through the directory held open, when given: the file's name in it)
  const std::string name = std::filesystem::path(path).filename().string(), tmpName = name + ".tmp";
  const int at = dirFd >= 0 ? dirFd : AT_FDCWD;
  const std::string& tmpAt = dirFd >= 0 ? tmpName : tmp;
  // With write(2), not a stream: a full disk is said as the OS says it ("No space left on
  // device", which checkpointWriteRefusal puts first), and a failed write leaves no partial
  // file behind (an ofstream said only "cannot write" and left the .tmp).
  try {
    Fd fd(::openat(at, tmpAt.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0666));
    if (!fd) throwErrno("checkpoint manifest: cannot create " + tmp);
    for (size_t done = 0; done < text.size();) {
      const ssize_t w = ::write(fd.get(), text.data() + done, text.size() - done);
      if (w < 0 && errno == EINTR) continue;
      if (w <= 0) throwErrno("checkpoint manifest: cannot write " + tmp);
      done += static_cast<size_t>(w);
    }
    if (::fsync(fd.get()) != 0) throwErrno("checkpoint manifest: fsync " + tmp);
    fd.reset();
    if (::renameat(at, tmpAt.c_str(), at, (dirFd >= 0 ? name : path).c_str()) != 0)
      throwErrno("checkpoint manifest: rename " + tmp);
  } catch (...) {
    ::unlinkat(at, tmpAt.c_str(), 0);
    throw;
  }
  if (dirFd >= 0) {
    if (::fsync(dirFd) != 0) throwErrno("checkpoint manifest: fsync " + std::filesystem::path(path).parent_path().string());
    return;
  }
  std::string dir = std::filesystem::path(path).parent_path().string();
  fsyncPath(dir.empty() ? "." : dir, O_RDONLY | O_DIRECTORY);
}

std::optional<PipelineManifest> readPipelineManifest(const std::string& path) {
  auto bad = [&](const std::string& why) {
    return SpecError(
        fmt::format("{}: {}; remove it (the stage checkpoints are found without it) or use another "
                    "/trainer/checkpoint/dir",
                    path, why));
  };
  // Non-blocking, a regular file, of a manifest's size: a FIFO under the name blocked the
  // launcher's pre-check (and the trainer) until a writer came; /dev/zero read until memory
  // ran out.
  Fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK));
  if (!fd) return std::nullopt;
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) return std::nullopt;
  if (!S_ISREG(st.st_mode)) throw bad("not a regular file");
  if (st.st_size > kMaxManifestBytes)
    throw bad(fmt::format("{} bytes, more than a manifest's {} at most", st.st_size, kMaxManifestBytes));
  std::string text(static_cast<size_t>(st.st_size), '\0');
  size_t got = 0;
  while (got < text.size()) {
    const ssize_t n = ::read(fd.get(), text.data() + got, text.size() - got);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) throw bad(fmt::format("cannot be read: {}", std::strerror(errno)));
    if (n == 0) break;
    got += static_cast<size_t>(n);
  }
  text.resize(got);
  auto j = nlohmann::json::parse(text, nullptr, false);
  if (j.is_discarded())
    throw bad(text.empty() ? std::string("empty (a save cut short?)")
                           : std::string("not valid JSON (damaged, or a save cut short?)"));
  if (!j.is_object()) throw bad("not a JSON object");
  if (!j.contains("format") || j["format"] != kFormat) throw bad(fmt::format("/format is not \"{}\"", kFormat));
  PipelineManifest m;
  const char* field = "";
  try {
    field = "step";
    m.step = j.at(field).get<long long>();
    field = "epoch";
    m.epoch = j.at(field).get<long long>();
    field = "cursor";
    m.cursor = j.at(field).get<uint64_t>();
    field = "world";
    m.world = j.at(field).get<int>();
    field = "stages";
    m.stages = j.at(field).get<int>();
    field = "stage_layers";
    m.stage_layers = j.at(field).get<std::vector<int>>();
    field = "config_hash";
    m.config_hash = j.at(field).get<std::string>();
    field = "files";
    m.files = j.at(field).get<std::vector<std::string>>();
  } catch (const nlohmann::json::exception&) {
    throw bad(fmt::format("/{} is missing or has the wrong type", field));
  }
  if (m.stages < 2)
    throw bad(fmt::format("/stages is {}: a manifest ties a pipeline's stages (2 or more) together", m.stages));
  if ( static_cast<int>(m.stage_layers.size()) != m.stages ||
      static_cast<int>(m.files.size()) != m.stages)
    throw bad("/stages, /stage_layers and /files disagree");
  return m;
}

}  // namespace dtrain::spec
