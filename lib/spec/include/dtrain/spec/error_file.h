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

// Writes `err` to path in the same format, as a Python worker's @record does: what the
// launcher's failure report and --summary-json say about the rank. Best effort (false when
// the file cannot be written): the worker is failing already, and says so on stderr too.
bool writeWorkerErrorFile(const std::string& path, const WorkerError& err);

// A failing worker of dtrain's own (the trainer, a bench rank): `message` to the error file
// its launcher named in TORCHELASTIC_ERROR_FILE, if it named one.
void leaveWorkerError(const std::string& message);

}  // namespace dtrain::spec
