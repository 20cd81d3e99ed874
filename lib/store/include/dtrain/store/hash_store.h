#pragma once
#include <condition_variable>
#include <mutex>
#include <unordered_map>

#include "dtrain/store/store.h"

namespace dtrain::store {

// In-memory store for tests and for in-process use. One mutex; waiters sleep on a
// condition variable that every write notifies.
class HashStore final : public Store {
 public:
  HashStore() = default;
  HashStore(const HashStore&) = delete;
  HashStore& operator=(const HashStore&) = delete;

  void set(const std::string& key, const Bytes& value) override;
  Bytes get(const std::string& key) override;
  int64_t add(const std::string& key, int64_t delta) override;
  Bytes compareSet(const std::string& key, const Bytes& expected, const Bytes& desired) override;
  bool check(const std::vector<std::string>& keys) override;
  void wait(const std::vector<std::string>& keys, Duration timeout) override;
  using Store::wait;
  bool deleteKey(const std::string& key) override;
  int64_t numKeys() override;
  void append(const std::string& key, const Bytes& value) override;
  std::vector<Bytes> multiGet(const std::vector<std::string>& keys) override;
  void multiSet(const std::vector<std::string>& keys, const std::vector<Bytes>& values) override;

 private:
  void waitLocked(std::unique_lock<std::mutex>& lock, const std::vector<std::string>& keys, Duration timeout);

  std::mutex mu_;
  std::condition_variable cv_;
  std::unordered_map<std::string, Bytes> map_;
};

}  // namespace dtrain::store
