#include "trace.h"

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>

#include <fmt/format.h>

#include "dtrain/common/errors.h"

namespace dtrain::train::detail {

Trace::Trace(std::string path, int rank, std::string label)
    : path_(std::move(path)), rank_(rank), label_(std::move(label)) {
  if (path_.empty()) return;
  const std::filesystem::path dir = std::filesystem::path(path_).parent_path();
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec)
    throw SpecError(fmt::format("DTRAIN_TRACE_DIR: cannot create the directory \"{}\": {}; give a directory this "
                                "user can write in, or unset DTRAIN_TRACE_DIR",
                                dir.string(), ec.message()));
  const std::string tmp = path_ + ".tmp";
  {
    std::ofstream f(tmp, std::ios::trunc);
    if (!f || !f.flush()) {
      const int err = errno;
      throw SpecError(fmt::format("DTRAIN_TRACE_DIR: cannot write in \"{}\": {}; give a directory this user can "
                                  "write in, or unset DTRAIN_TRACE_DIR",
                                  dir.string(), std::strerror(err ? err : EIO)));
    }
  }
  std::remove(tmp.c_str());
}

namespace {

const char* category(const char* name) {
  const std::string n = name;
  if (n == "F" || n == "B" || n == "forward" || n == "backward") return "compute";
  if (n == "optimizer") return "optimizer";
  return "comm";
}

}  // namespace

std::string Trace::write() const {
  if (!enabled() || events_.empty()) return "";
  auto us = [](Clock::time_point t) { return std::chrono::duration<double, std::micro>(t.time_since_epoch()).count(); };
  std::string out = fmt::format(
      "{{\"displayTimeUnit\": \"ms\", \"traceEvents\": [\n{{\"name\": \"process_name\", \"ph\": \"M\", \"pid\": {}, "
      "\"args\": {{\"name\": \"rank {} ({})\"}}}},\n{{\"name\": \"process_sort_index\", \"ph\": \"M\", \"pid\": {}, "
      "\"args\": {{\"sort_index\": {}}}}}",
      rank_, rank_, label_, rank_, rank_);
  bool commLane = false;
  for (const auto& ev : events_) commLane = commLane || ev.lane == kCommLane;
  if (commLane)  // (named only where there are two rows to tell apart)
    out += fmt::format(
        ",\n{{\"name\": \"thread_name\", \"ph\": \"M\", \"pid\": {0}, \"tid\": {1}, \"args\": {{\"name\": \"training\"}}}}"
        ",\n{{\"name\": \"thread_name\", \"ph\": \"M\", \"pid\": {0}, \"tid\": {2}, \"args\": {{\"name\": "
        "\"communicator\"}}}}",
        rank_, static_cast<int>(kTrainLane), static_cast<int>(kCommLane));
  for (const auto& ev : events_) {
    std::string name = ev.micro >= 0 ? fmt::format("{} {}", ev.name, ev.micro) : std::string(ev.name);
    out += fmt::format(
        ",\n{{\"name\": \"{}\", \"cat\": \"{}\", \"ph\": \"X\", \"ts\": {:.3f}, \"dur\": {:.3f}, \"pid\": {}, \"tid\": {}, "
        "\"args\": {{\"step\": {}{}}}}}",
        name, category(ev.name), us(ev.b), us(ev.e) - us(ev.b), rank_, static_cast<int>(ev.lane), ev.step,
        ev.queued == Clock::time_point{} ? std::string() : fmt::format(", \"queued_us\": {:.3f}", us(ev.b) - us(ev.queued)));
  }
  out += "\n]}\n";
  const std::string tmp = path_ + ".tmp";
  {
    std::ofstream f(tmp, std::ios::trunc);
    f << out;
    if (!f.flush()) {
      const int err = errno;
      std::remove(tmp.c_str());
      return fmt::format("trace: cannot write {}: {}; no trace of this rank", tmp, std::strerror(err ? err : EIO));
    }
  }
  if (std::rename(tmp.c_str(), path_.c_str()) != 0) {
    const int err = errno;
    std::remove(tmp.c_str());
    return fmt::format("trace: cannot write {}: {}; no trace of this rank", path_, std::strerror(err));
  }
  return "";
}

}  // namespace dtrain::train::detail
