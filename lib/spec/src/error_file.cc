#include "dtrain/spec/error_file.h"

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <sstream>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "dtrain/common/strings.h"

namespace dtrain::spec {

namespace {

// What is read of an error file, and kept of its message and traceback: what a person reads
// in a failure report (the summary, --summary-json, an agent's record to its launcher, which
// takes at most 2 MiB: a bigger one was dropped whole, the failure with it).
constexpr size_t kMaxFileBytes = 16u << 20;
constexpr size_t kMaxMessageBytes = 64u << 10;
constexpr size_t kMaxTracebackBytes = 64u << 10;

// The message's beginning (where it says what went wrong), then how much was cut.
std::string cutMessage(std::string m) {
  if (m.size() <= kMaxMessageBytes) return m;
  const size_t keep = utf8PrefixLength(m, kMaxMessageBytes);
  const size_t cut = m.size() - keep;
  m.resize(keep);
  return m + fmt::format(" ... ({} bytes more cut)", cut);
}

// A traceback's end (the frame that raised, and the exception), from a line's start.
std::string cutTraceback(const std::string& t) {
  if (t.size() <= kMaxTracebackBytes) return t;
  size_t from = t.size() - kMaxTracebackBytes;
  const size_t nl = t.find('\n', from);
  from = nl == std::string::npos ? from : nl + 1;
  while (from < t.size() && (static_cast<unsigned char>(t[from]) & 0xC0) == 0x80) ++from;  // (not inside a character)
  return fmt::format("(... {} bytes of the traceback cut)\n", from) + t.substr(from);
}

}  // namespace

std::optional<WorkerError> readWorkerErrorFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return std::nullopt;
  std::string text;
  char piece[1 << 16];
  while (text.size() <= kMaxFileBytes && in.read(piece, sizeof piece).gcount() > 0)
    text.append(piece, static_cast<size_t>(in.gcount()));
  if (text.find_first_not_of(" \t\r\n") == std::string::npos) return std::nullopt;
  WorkerError err;
  if (text.size() > kMaxFileBytes) {  // (not a record anyone meant: said, with its beginning)
    text.resize(utf8PrefixLength(std::string_view(text).substr(0, kMaxMessageBytes), kMaxMessageBytes));
    err.message = fmt::format("(the error file is over {} MiB; not read as a record; its beginning:) {} ...",
                              kMaxFileBytes >> 20, text);
    return err;
  }
  auto j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object() || !j.contains("message")) {
    err.message = cutMessage(std::move(text));
    return err;
  }
  const auto& m = j["message"];
  if (m.is_string()) {
    err.message = m.get<std::string>();
  } else if (m.is_object()) {
    if (m.contains("message") && m["message"].is_string()) err.message = m["message"].get<std::string>();
    if (m.contains("extraInfo") && m["extraInfo"].is_object()) {
      const auto& extra = m["extraInfo"];
      if (extra.contains("py_callstack") && extra["py_callstack"].is_string())
        err.traceback = extra["py_callstack"].get<std::string>();
    }
  } else {
    err.message = m.dump();
  }
  err.message = cutMessage(std::move(err.message));
  err.traceback = cutTraceback(err.traceback);
  return err;
}

bool writeWorkerErrorFile(const std::string& path, const WorkerError& err) {
  const auto now = std::chrono::system_clock::now().time_since_epoch();
  nlohmann::json j = {{"message",
                       {{"message", err.message},
                        {"extraInfo",
                         {{"py_callstack", err.traceback},
                          {"timestamp", std::to_string(std::chrono::duration_cast<std::chrono::seconds>(now).count())}}}}}};
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  out.flush();
  return static_cast<bool>(out);
}

void leaveWorkerError(const std::string& message) {
  if (const char* f = std::getenv("TORCHELASTIC_ERROR_FILE"); f && *f) writeWorkerErrorFile(f, {message, ""});
}

}  // namespace dtrain::spec
