#pragma once
// Test helpers: ranks of a tcp communicator as threads of this process, meeting in a HashStore.
#include <chrono>
#include <functional>
#include <future>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "dtrain/comm/communicator.h"
#include "dtrain/common/errors.h"
#include "dtrain/store/hash_store.h"

namespace dtrain::comm::testing {

// Runs fn(comm) on n ranks, each in its own thread with its own communicator; returns each
// rank's error ("" when fn returned normally).
inline std::vector<std::string> runRanks(int n, const std::function<void(Communicator&)>& fn, const CommOptions& o) {
  auto store = std::make_shared<store::HashStore>();
  std::vector<std::thread> ts;
  std::vector<std::string> errors(static_cast<size_t>(n));
  for (int r = 0; r < n; ++r)
    ts.emplace_back([&, r] {
      try {
        auto c = createTcpCommunicator(store, r, n, o);
        fn(*c);
      } catch (const std::exception& e) {
        errors[static_cast<size_t>(r)] = e.what();
      }
    });
  for (auto& t : ts) t.join();
  return errors;
}

// A Store that forwards every call to `inner`; a test overrides the calls it intercepts.
class ForwardingStore : public store::Store {
 public:
  explicit ForwardingStore(std::shared_ptr<store::Store> inner) : inner_(std::move(inner)) {}
  void set(const std::string& key, const store::Bytes& value) override { inner_->set(key, value); }
  store::Bytes get(const std::string& key) override { return inner_->get(key); }
  int64_t add(const std::string& key, int64_t delta) override { return inner_->add(key, delta); }
  store::Bytes compareSet(const std::string& key, const store::Bytes& e, const store::Bytes& d) override {
    return inner_->compareSet(key, e, d);
  }
  bool check(const std::vector<std::string>& keys) override { return inner_->check(keys); }
  void wait(const std::vector<std::string>& keys, store::Duration t) override { inner_->wait(keys, t); }
  using store::Store::wait;
  bool deleteKey(const std::string& key) override { return inner_->deleteKey(key); }
  int64_t numKeys() override { return inner_->numKeys(); }
  void append(const std::string& key, const store::Bytes& value) override { inner_->append(key, value); }
  std::vector<store::Bytes> multiGet(const std::vector<std::string>& keys) override { return inner_->multiGet(keys); }
  void multiSet(const std::vector<std::string>& keys, const std::vector<store::Bytes>& values) override {
    inner_->multiSet(keys, values);
  }

 protected:
  std::shared_ptr<store::Store> inner_;
};

// What lostRankRun saw: each rank's error ("" for the lost rank and ranks that succeeded),
// how long each rank's failing operation took, and the job's stored first failure.
struct LostRankRun {
  std::vector<std::string> errors;
  std::vector<std::chrono::steady_clock::duration> took;
  std::string firstFailure;
};

// n ranks set up a communicator; then rank `victim` either stays connected but never joins
// `op` (stop: as if SIGSTOPped; its threads end once every other rank is done) or leaves
// (closes its communicator: as if killed); the others run op(comm) once. `store` may wrap the
// HashStore the ranks meet in (nullptr: the HashStore itself).
inline LostRankRun lostRankRun(int n, int victim, bool stop, const CommOptions& o,
                               const std::function<void(Communicator&)>& op,
                               std::shared_ptr<store::Store> store = nullptr) {
  auto hash = std::make_shared<store::HashStore>();
  if (!store) store = hash;
  LostRankRun out{std::vector<std::string>(static_cast<size_t>(n)),
                  std::vector<std::chrono::steady_clock::duration>(static_cast<size_t>(n)), ""};
  std::promise<void> othersDone;
  auto done = othersDone.get_future().share();
  std::vector<std::future<void>> others;
  std::vector<std::thread> ts;
  for (int r = 0; r < n; ++r) {
    std::promise<void> finished;
    if (r != victim) others.push_back(finished.get_future());
    ts.emplace_back([&, r, finished = std::move(finished)]() mutable {
      try {
        auto c = createTcpCommunicator(store, r, n, o);
        if (r == victim) {
          if (stop) done.wait();
          return;
        }
        auto start = std::chrono::steady_clock::now();
        try {
          op(*c);
        } catch (const std::exception& e) {
          out.errors[static_cast<size_t>(r)] = e.what();
        }
        out.took[static_cast<size_t>(r)] = std::chrono::steady_clock::now() - start;
      } catch (const std::exception& e) {
        out.errors[static_cast<size_t>(r)] = std::string("set-up: ") + e.what();
      }
      finished.set_value();
    });
  }
  for (auto& f : others) f.wait();
  othersDone.set_value();
  for (auto& t : ts) t.join();
  const std::string key = "comm/" + o.name + "/failure";
  if (hash->check({key})) out.firstFailure = hash->get(key);
  return out;
}

// A pipeline of point-to-point transfers round the ring, 0 -> 1 -> ... -> n-1 -> 0, of
// `bytes` each (larger than socket buffers and channels: each rank waits on its neighbour).
inline void p2pRing(Communicator& c, size_t bytes) {
  const int r = c.rank(), n = c.size();
  std::vector<char> b(bytes);
  if (r == 0) {
    c.send(b.data(), b.size(), 1);
    c.recv(b.data(), b.size(), n - 1);
  } else {
    c.recv(b.data(), b.size(), r - 1);
    c.send(b.data(), b.size(), (r + 1) % n);
  }
}

}  // namespace dtrain::comm::testing
