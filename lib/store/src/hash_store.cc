#include "dtrain/store/hash_store.h"

#include <fmt/format.h>

#include "dtrain/common/errors.h"

namespace dtrain::store {

void HashStore::set(const std::string& key, const Bytes& value) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    map_[key] = value;
  }
  cv_.notify_all();
}

void HashStore::waitLocked(std::unique_lock<std::mutex>& lock, const std::vector<std::string>& keys,
                           Duration timeout) {
  auto ready = [&] {
    for (const auto& k : keys)
      if (!map_.count(k)) return false;
    return true;
  };
  if (timeout < Duration::zero()) {
    cv_.wait(lock, ready);
    return;
  }
  if (!cv_.wait_for(lock, timeout, ready)) {
    std::vector<std::string> missing;
    for (const auto& k : keys)
      if (!map_.count(k)) missing.push_back(k);
    throw TimeoutError(describeWaitTimeout(timeout, missing));
  }
}

Bytes HashStore::get(const std::string& key) {
  std::unique_lock<std::mutex> lock(mu_);
  waitLocked(lock, {key}, timeout_);
  return map_.at(key);
}

int64_t HashStore::add(const std::string& key, int64_t delta) {
  int64_t v;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = map_.find(key);
    v = addToCounter(key, it == map_.end() ? nullptr : &it->second, delta);
    map_[key] = std::to_string(v);
  }
  cv_.notify_all();
  return v;
}

Bytes HashStore::compareSet(const std::string& key, const Bytes& expected, const Bytes& desired) {
  Bytes result;
  bool changed = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = map_.find(key);
    if (it == map_.end()) {
      if (expected.empty()) {
        map_[key] = desired;
        result = desired;
        changed = true;
      } else {
        result = expected;
      }
    } else if (it->second == expected) {
      it->second = desired;
      result = desired;
      changed = true;
    } else {
      result = it->second;
    }
  }
  if (changed) cv_.notify_all();
  return result;
}

bool HashStore::check(const std::vector<std::string>& keys) {
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& k : keys)
    if (!map_.count(k)) return false;
  return true;
}

void HashStore::wait(const std::vector<std::string>& keys, Duration timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  waitLocked(lock, keys, timeout);
}

bool HashStore::deleteKey(const std::string& key) {
  std::lock_guard<std::mutex> lock(mu_);
  return map_.erase(key) > 0;
}

int64_t HashStore::numKeys() {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int64_t>(map_.size());
}

void HashStore::append(const std::string& key, const Bytes& value) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    map_[key] += value;
  }
  cv_.notify_all();
}

std::vector<Bytes> HashStore::multiGet(const std::vector<std::string>& keys) {
  std::unique_lock<std::mutex> lock(mu_);
  waitLocked(lock, keys, timeout_);
  std::vector<Bytes> out;
  out.reserve(keys.size());
  for (const auto& k : keys) out.push_back(map_.at(k));
  return out;
}

void HashStore::multiSet(const std::vector<std::string>& keys, const std::vector<Bytes>& values) {
  if (keys.size() != values.size())
    throw StoreError(fmt::format("multiSet: {} keys but {} values", keys.size(), values.size()));
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (size_t i = 0; i < keys.size(); ++i) map_[keys[i]] = values[i];
  }
  cv_.notify_all();
}

}  // namespace dtrain::store
