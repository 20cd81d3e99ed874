#include "dtrain/spec/error_file.h"

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

namespace dtrain::spec {

std::optional<WorkerError> readWorkerErrorFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return std::nullopt;
  std::stringstream ss;
  ss << in.rdbuf();
  std::string text = ss.str();
  if (text.find_first_not_of(" \t\r\n") == std::string::npos) return std::nullopt;
  WorkerError err;
  auto j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object() || !j.contains("message")) {
    err.message = text;
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
