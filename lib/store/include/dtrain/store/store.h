#pragma once
// The rendezvous key-value store: the control plane for bootstrap, peer exchange and
// rendezvous rounds. Keys and values are binary-safe byte strings.
//
// Thread-safety: every Store implementation may be called from many threads at once.
#include <chrono>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace dtrain::store {

using Bytes = std::string;
using Duration = std::chrono::milliseconds;

// Wait forever.
inline constexpr Duration kNoTimeout{-1};
inline constexpr Duration kDefaultTimeout{std::chrono::seconds(300)};

// A store operation that cannot succeed: add() on a value that is not an integer,
// mismatched multiSet sizes, a server's typed error reply.
class StoreError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// The store refused the request as given and changed nothing: sending it again cannot
// succeed, so callers treat it as bad input (`dtrain store` exits 2), not as a failure.
class RequestRefusedError : public StoreError {
 public:
  using StoreError::StoreError;
};

// add() on a value that is not a decimal integer (wire NOT_INTEGER).
class NotIntegerError : public RequestRefusedError {
 public:
  using RequestRefusedError::RequestRefusedError;
};

// add() whose result would not fit in int64 (wire OUT_OF_RANGE). Refused rather than
// wrapped: a counter that silently turns negative breaks every rank that reads it.
class OutOfRangeError : public RequestRefusedError {
 public:
  using RequestRefusedError::RequestRefusedError;
};

class Store {
 public:
  virtual ~Store() = default;

  virtual void set(const std::string& key, const Bytes& value) = 0;
  // Waits up to timeout() for the key, then returns its value. Throws TimeoutError.
  virtual Bytes get(const std::string& key) = 0;
  // Adds delta to the integer stored at key (absent = 0) and returns the new value.
  virtual int64_t add(const std::string& key, int64_t delta) = 0;
  // c10d semantics: absent key and empty `expected` -> set `desired`; current == expected
  // -> set `desired`; returns the value now stored (or `expected` when absent and not set).
  virtual Bytes compareSet(const std::string& key, const Bytes& expected, const Bytes& desired) = 0;
  // True when every key exists; never waits.
  virtual bool check(const std::vector<std::string>& keys) = 0;
  // Waits until every key exists. Throws TimeoutError naming the missing keys.
  virtual void wait(const std::vector<std::string>& keys, Duration timeout) = 0;
  void wait(const std::vector<std::string>& keys) { wait(keys, timeout_); }
  // True when the key existed.
  virtual bool deleteKey(const std::string& key) = 0;
  virtual int64_t numKeys() = 0;
  // Appends to the value at key (absent = empty).
  virtual void append(const std::string& key, const Bytes& value) = 0;
  // Waits for all keys (timeout()), then returns their values in order.
  virtual std::vector<Bytes> multiGet(const std::vector<std::string>& keys) = 0;
  virtual void multiSet(const std::vector<std::string>& keys, const std::vector<Bytes>& values) = 0;

  void setTimeout(Duration t) { timeout_ = t; }
  Duration timeout() const { return timeout_; }

 protected:
  Duration timeout_ = kDefaultTimeout;
};

// "timed out after 1.5 s waiting for key 'a'" (or "keys 'a', 'b'").
std::string describeWaitTimeout(Duration waited, const std::vector<std::string>& missing);

// Parses the decimal integer add() stores. Throws NotIntegerError naming the key.
int64_t parseCounter(const std::string& key, const Bytes& value);

// add()'s arithmetic, shared by every Store (HashStore, the TCP server) so that they refuse
// the same requests: the counter at `key` (`current`, nullptr when absent = 0) plus delta.
// Throws NotIntegerError or OutOfRangeError naming the key; the caller then stores nothing.
int64_t addToCounter(const std::string& key, const Bytes* current, int64_t delta);

}  // namespace dtrain::store
