#include "dtrain/rendezvous/rendezvous.h"

#include <algorithm>
#include <chrono>
#include <numeric>
#include <optional>
#include <thread>

#include <fmt/format.h>

#include "dtrain/common/errors.h"
#include "dtrain/common/strings.h"

namespace dtrain::rendezvous {

using Clock = std::chrono::steady_clock;

std::string encodeNode(const NodeInfo& n) { return fmt::format("{}\t{}\t{}\t{}", n.name, n.nproc, n.order, n.addr); }

NodeInfo decodeNode(const std::string& s) {
  auto parts = split(s, '\t');
  if (parts.size() != 3 && parts.size() != 4) throw PeerLostError(fmt::format("rendezvous: malformed node record '{}'", s));
  NodeInfo n;
  n.name = parts[0];
  if (parts.size() == 4) n.addr = parts[3];
  try {
    n.nproc = std::stoi(parts[1]);
    n.order = std::stoi(parts[2]);
  } catch (...) {
    throw PeerLostError(fmt::format("rendezvous: malformed node record '{}'", s));
  }
  return n;
}

Rendezvous::Rendezvous(std::shared_ptr<store::Store> store, RendezvousOptions opts, NodeInfo self)
    : store_(std::move(store)), opts_(std::move(opts)), self_(std::move(self)) {
  DTRAIN_CHECK(store_ != nullptr);
  if (opts_.min_nodes < 1 || opts_.max_nodes < opts_.min_nodes)
    throw SpecError(fmt::format("rendezvous: need 1 <= min_nodes <= max_nodes, got {}..{}", opts_.min_nodes, opts_.max_nodes));
  if (self_.name.empty() || self_.name.find('\t') != std::string::npos)
    throw SpecError("rendezvous: node name must be non-empty and contain no tab");
}

void Rendezvous::openNextRound(int closedRound) {
  // Only moves forward: several agents may call it for the same closed round.
  std::string cur = std::to_string(closedRound);
  store_->compareSet(key("open"), cur, std::to_string(closedRound + 1));
}

void Rendezvous::expect(int round, const std::vector<std::string>& names) {
  store_->set(roundKey(round, "expected"), fmt::format("{}", fmt::join(names, "\t")));
}

std::vector<std::string> Rendezvous::arrived(int round) {
  int64_t count = store_->add(roundKey(round, "count"), 0);
  std::vector<std::string> keys;
  for (int64_t i = 0; i < count; ++i) keys.push_back(roundKey(round, "node/" + std::to_string(i)));
  std::vector<std::string> out;
  if (keys.empty()) return out;
  // Three store round trips whatever the node count, when every joiner has written its
  // entry (the usual case: a joiner writes it right after taking its place); key by key
  // only while one is between the two.
  if (store_->check(keys)) {
    for (const auto& v : store_->multiGet(keys)) out.push_back(decodeNode(v).name);
    return out;
  }
  for (const auto& k : keys)
    if (store_->check({k})) out.push_back(decodeNode(store_->get(k)).name);
  return out;
}

void Rendezvous::timeout(int round, Duration waited) { throw TimeoutError(timeoutText(round, waited, opts_.min_nodes)); }

std::string Rendezvous::timeoutText(int round, Duration waited, int atLeast) {
  const std::vector<std::string> arrived = this->arrived(round);
  std::vector<std::string> expected = opts_.expected;
  if (expected.empty() && store_->check({roundKey(round, "expected")}))
    expected = split(store_->get(roundKey(round, "expected")), '\t');
  std::vector<std::string> missing;
  for (const auto& e : expected)
    if (std::find(arrived.begin(), arrived.end(), e) == arrived.end()) missing.push_back(e);
  std::string msg = fmt::format("rendezvous round {} timed out after {:.3g} s: {} of at least {} node(s) joined",
                                round, waited.count() / 1000.0, arrived.size(), atLeast);
  msg += fmt::format(" (arrived: {})", arrived.empty() ? "none" : fmt::format("{}", fmt::join(arrived, ", ")));
  if (!missing.empty()) msg += fmt::format("; not joined: {}", fmt::join(missing, ", "));
  return msg;
}

RoundResult Rendezvous::join() {
  auto start = Clock::now();
  auto deadline = start + opts_.join_timeout;
  auto& s = *store_;
  int round = static_cast<int>(std::stoll(s.compareSet(key("open"), "", "0")));
  if (opts_.round >= 0) round = opts_.round;
  auto abortIfAsked = [&] {
    if (opts_.should_abort && opts_.should_abort()) throw RendezvousAborted(fmt::format("rendezvous round {} abandoned", round));
  };
  // A round this node may not take part in, when it was told which (RendezvousOptions::round):
  // the launcher has something else for it; waited for until it says so, or the timeout.
  auto waitForWord = [&]() {
    while (true) {
      if (Clock::now() >= deadline) timeout(round, opts_.join_timeout);
      abortIfAsked();
      std::this_thread::sleep_for(opts_.poll);
    }
  };
  // A round the launcher named its members for, without this node, is not this node's (an
  // agent of a round before, not told yet that it is out): it waits for the next one.
  auto notMine = [&](int r) {
    const std::string k = roundKey(r, "expected");
    if (!s.check({k})) return false;
    const auto names = split(s.get(k), '\t');
    return std::find(names.begin(), names.end(), self_.name) == names.end();
  };
  while (true) {
    // A closed round is for the nodes already in it: aim for the next one.
    if (s.check({roundKey(round, "closed")}) || notMine(round)) {
      if (opts_.round >= 0) waitForWord();
      while (true) {
        int open = std::stoi(s.get(key("open")));
        if (open > round) {
          round = open;
          break;
        }
        if (Clock::now() >= deadline) timeout(round + 1, opts_.join_timeout);
        if (opts_.should_abort && opts_.should_abort()) throw RendezvousAborted("rendezvous abandoned");
        std::this_thread::sleep_for(opts_.poll);
      }
      continue;
    }
    // (a word from the launcher first: an agent that has one waiting takes no place it leaves)
    abortIfAsked();
    int64_t idx = s.add(roundKey(round, "count"), 1) - 1;
    s.set(roundKey(round, "node/" + std::to_string(idx)), encodeNode(self_));
    // Wait for the round to close, closing it ourselves when the rules say so.
    std::optional<Clock::time_point> lastCall;
    int64_t participants = -1;
    while (participants < 0) {
      std::string closedKey = roundKey(round, "closed");
      if (s.check({closedKey})) {
        participants = std::stoll(s.get(closedKey));
        break;
      }
      int64_t count = s.add(roundKey(round, "count"), 0);
      auto now = Clock::now();
      if (count >= opts_.min_nodes && !lastCall) lastCall = now + opts_.last_call;
      if (count >= opts_.max_nodes || (lastCall && now >= *lastCall)) {
        int64_t n = std::min<int64_t>(count, opts_.max_nodes);
        participants = std::stoll(s.compareSet(closedKey, "", std::to_string(n)));
        break;
      }
      if (now >= deadline) timeout(round, opts_.join_timeout);
      abortIfAsked();
      try {
        s.wait({closedKey}, std::min<Duration>(opts_.poll, std::chrono::duration_cast<Duration>(deadline - now)));
      } catch (const TimeoutError&) {
      }
    }
    if (idx >= participants) {  // joined too late: the loop moves to the next round
      if (opts_.round >= 0) waitForWord();
      continue;
    }

    std::vector<std::string> keys;
    for (int64_t i = 0; i < participants; ++i) keys.push_back(roundKey(round, "node/" + std::to_string(i)));
    s.wait(keys, std::chrono::duration_cast<Duration>(std::max(deadline - Clock::now(), Clock::duration(Duration(1000)))));
    std::vector<std::string> records = s.multiGet(keys);
    struct Entry {
      NodeInfo info;
      int64_t idx;
    };
    std::vector<Entry> entries;
    for (int64_t i = 0; i < participants; ++i) entries.push_back({decodeNode(records[static_cast<size_t>(i)]), i});
    // Hostfile order first, then join order for nodes not in the hostfile.
    std::stable_sort(entries.begin(), entries.end(), [](const Entry& a, const Entry& b) {
      int oa = a.info.order < 0 ? INT32_MAX : a.info.order, ob = b.info.order < 0 ? INT32_MAX : b.info.order;
      return oa != ob ? oa < ob : a.idx < b.idx;
    });
    RoundResult r;
    r.round = round;
    r.nnodes = static_cast<int>(participants);
    for (size_t i = 0; i < entries.size(); ++i) {
      if (entries[i].idx == idx) {
        r.node_rank = static_cast<int>(i);
        r.rank_offset = r.world_size;
      }
      r.world_size += entries[i].info.nproc;
      r.nodes.push_back(entries[i].info);
    }
    return r;
  }
}

HeartbeatMonitor::HeartbeatMonitor(std::shared_ptr<store::Store> store, std::string run_id, Duration timeout)
    : store_(std::move(store)), run_id_(std::move(run_id)), timeout_(timeout) {}

void HeartbeatMonitor::beat(store::Store& store, const std::string& run_id, const std::string& node) {
  store.add("rdzv/" + run_id + "/hb/" + node, 1);
}

std::string HeartbeatMonitor::counter(const std::string& node) {
  const std::string key = "rdzv/" + run_id_ + "/hb/" + node;
  return store_->check({key}) ? store_->get(key) : std::string();
}

std::vector<std::string> HeartbeatMonitor::dead(const std::vector<std::string>& nodes) {
  auto now = Clock::now();
  std::vector<std::string> keys;
  for (const auto& n : nodes) keys.push_back("rdzv/" + run_id_ + "/hb/" + n);
  std::vector<std::string> out;
  for (size_t i = 0; i < nodes.size(); ++i) {
    std::string v = store_->check({keys[i]}) ? store_->get(keys[i]) : std::string();
    auto it = std::find_if(seen_.begin(), seen_.end(), [&](const auto& p) { return p.first == nodes[i]; });
    if (it == seen_.end()) {
      seen_.push_back({nodes[i], {v, now}});
      continue;
    }
    if (it->second.value != v) {
      it->second = {v, now};
    } else if (now - it->second.since > timeout_) {
      out.push_back(nodes[i]);
    }
  }
  return out;
}

}  // namespace dtrain::rendezvous
