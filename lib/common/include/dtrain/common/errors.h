#pragma once
// Error policy (docs/errors.md): typed exceptions for what can happen at run time,
// DTRAIN_CHECK for invariants that only a bug can break. Every exception that reaches
// main() is printed as one line and mapped to an exit code by exitCodeFor().
#include <new>
#include <stdexcept>
#include <string>
#include <utility>

namespace dtrain {

// Bad user input: spec, hostfile, CLI flags. Exit code 2.
class SpecError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// An operating-system call failed (fork, pipe, open, ...). Exit code 1.
class IoError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class TimeoutError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class PeerLostError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// An allocation that failed where std::bad_alloc would say nothing of it: device memory
// (cudaMalloc), page-locked host memory (cudaMallocHost). A std::bad_alloc, so that one
// handler takes every allocation failure; what() names the call, the size and the device.
class AllocationError : public std::bad_alloc {
 public:
  AllocationError(std::string what, bool device) : what_(std::move(what)), device_(device) {}
  const char* what() const noexcept override { return what_.c_str(); }
  // True for device memory (the GPU's), false for host memory.
  bool device() const { return device_; }

 private:
  std::string what_;
  bool device_;
};

// Broken invariant: a bug in dtrain. Exit code 1 with file:line.
class InternalError : public std::logic_error {
 public:
  using std::logic_error::logic_error;
};

// Throws IoError with strerror(errno) appended.
[[noreturn]] void throwErrno(const std::string& what);

[[noreturn]] void checkFailed(const char* expr, const char* file, int line);

inline constexpr int kExitOk = 0;
inline constexpr int kExitFailure = 1;
inline constexpr int kExitUsage = 2;

}  // namespace dtrain

#define DTRAIN_CHECK(cond) \
  do {                     \
    if (!(cond)) ::dtrain::checkFailed(#cond, __FILE__, __LINE__); \
  } while (0)
