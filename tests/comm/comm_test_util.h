#pragma once
// Test helper: ranks of a tcp communicator as threads of this process, meeting in a HashStore.
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "dtrain/comm/communicator.h"
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

}  // namespace dtrain::comm::testing
