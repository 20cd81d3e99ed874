#pragma once
#include <optional>
#include <string>

namespace dtrain::spec {

// What a worker left in TORCHELASTIC_ERROR_FILE (PyTorch's @record format:
// {"message": {"message": "...", "extraInfo": {"py_callstack": "...", "timestamp": "..."}}}).
struct WorkerError {
  std::string message;
  std::string traceback;
};

// nullopt when the file is missing or empty; a file that is not valid JSON is returned
// verbatim as the message, since the worker's own words beat none.
std::optional<WorkerError> readWorkerErrorFile(const std::string& path);

}  // namespace dtrain::spec
