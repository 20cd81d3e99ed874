#include "dtrain/store/prefix_store.h"

#include "dtrain/common/errors.h"

namespace dtrain::store {

PrefixStore::PrefixStore(std::string prefix, std::shared_ptr<Store> inner)
    : prefix_(std::move(prefix)), inner_(std::move(inner)) {
  DTRAIN_CHECK(inner_ != nullptr);
  timeout_ = inner_->timeout();
}

std::vector<std::string> PrefixStore::full(const std::vector<std::string>& keys) const {
  std::vector<std::string> out;
  out.reserve(keys.size());
  for (const auto& k : keys) out.push_back(full(k));
  return out;
}

void PrefixStore::set(const std::string& key, const Bytes& value) { inner_->set(full(key), value); }

// Waits with this store's own timeout, which may differ from the inner store's.
Bytes PrefixStore::get(const std::string& key) {
  inner_->wait({full(key)}, timeout_);
  return inner_->get(full(key));
}

int64_t PrefixStore::add(const std::string& key, int64_t delta) { return inner_->add(full(key), delta); }

Bytes PrefixStore::compareSet(const std::string& key, const Bytes& expected, const Bytes& desired) {
  return inner_->compareSet(full(key), expected, desired);
}

bool PrefixStore::check(const std::vector<std::string>& keys) { return inner_->check(full(keys)); }

void PrefixStore::wait(const std::vector<std::string>& keys, Duration timeout) { inner_->wait(full(keys), timeout); }

bool PrefixStore::deleteKey(const std::string& key) { return inner_->deleteKey(full(key)); }

int64_t PrefixStore::numKeys() { return inner_->numKeys(); }

void PrefixStore::append(const std::string& key, const Bytes& value) { inner_->append(full(key), value); }

std::vector<Bytes> PrefixStore::multiGet(const std::vector<std::string>& keys) {
  auto fk = full(keys);
  inner_->wait(fk, timeout_);
  return inner_->multiGet(fk);
}

void PrefixStore::multiSet(const std::vector<std::string>& keys, const std::vector<Bytes>& values) {
  inner_->multiSet(full(keys), values);
}

}  // namespace dtrain::store
