#pragma once
#include <memory>

#include "dtrain/store/store.h"

namespace dtrain::store {

// Namespaces every key as "<prefix>/<key>" (per job, per round). numKeys() counts the whole
// underlying store, as c10d's PrefixStore does. Shares ownership of the inner store.
class PrefixStore final : public Store {
 public:
  PrefixStore(std::string prefix, std::shared_ptr<Store> inner);

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
  std::string full(const std::string& key) const { return prefix_ + "/" + key; }
  std::vector<std::string> full(const std::vector<std::string>& keys) const;

  std::string prefix_;
  std::shared_ptr<Store> inner_;
};

}  // namespace dtrain::store
