#pragma once
// Reading the files a user points dtrain at (job spec, hostfile, env file) without trusting
// what they are: a regular file, or a pipe such as bash's <(...), read to the end, but never
// more than a limit, so /dev/zero or a runaway generator ends in a SpecError, not in
// exhausted memory.
#include <cstddef>
#include <string>

namespace dtrain::spec::detail {

// Far above any real spec, hostfile or env file (the largest spec in configs/ is ~2 KiB).
inline constexpr size_t kMaxInputBytes = 16u << 20;

struct InputFile {
  enum class Status { kOk, kMissing, kDenied, kDirectory, kTooLarge, kReadError };
  Status status = Status::kOk;
  std::string text;    // kOk: the whole content
  std::string reason;  // otherwise: what went wrong, in words (strerror, or the size)
};

// Opens `path` (blocking: a named pipe waits for its writer, as cat would) and reads it whole,
// up to maxBytes.
InputFile readInputFile(const std::string& path, size_t maxBytes = kMaxInputBytes);

// readInputFile's text, or a SpecError "<path>: ..." saying what is wrong with the `what`
// ("job spec") and, for a file of the wrong kind, `give` ("give a job spec file (.json)").
std::string readInputOrThrow(const std::string& path, const char* what, const char* give);

}  // namespace dtrain::spec::detail
