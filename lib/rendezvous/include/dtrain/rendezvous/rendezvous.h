#pragma once
// Rendezvous rounds on top of a Store, in the spirit of torchelastic's c10d rendezvous but
// with plain text state (no pickles). Every participant of round N learns the same node
// order, world size and per-node worker counts.
//
// Keys (under "rdzv/<run_id>/"):
//   r/<N>/count        add() counter: arrival index of each joiner
//   r/<N>/node/<i>     "<name>\t<nproc>\t<order>\t<addr>" of the i-th joiner
//   r/<N>/closed       compareSet() once: the number of participants (first closer wins)
//   open               the round late joiners should aim for (bumped by openNextRound)
//   r/<N>/expected     the names of the nodes meant to join round N, tab-separated (expect):
//                      a timeout names those that did not
//   hb/<name>          heartbeat counter of a node
//
// Thread-safety: a Rendezvous object is used by one thread; the store may be shared.
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "dtrain/store/store.h"

namespace dtrain::rendezvous {

using store::Duration;

struct NodeInfo {
  std::string name;  // unique per node (host name, or host:agent id)
  int nproc = 1;     // workers on this node
  int order = -1;    // position in the hostfile; -1 = rank by join order
  std::string addr;  // how other nodes reach this one ("" = unknown)
};

struct RendezvousOptions {
  std::string run_id = "default";
  int min_nodes = 1;
  int max_nodes = 1;
  Duration join_timeout{std::chrono::seconds(600)};
  // Once min_nodes have joined, wait this long for more before closing the round.
  Duration last_call{std::chrono::seconds(1)};
  // Names of nodes expected (hostfile); only used to say who is missing on a timeout.
  std::vector<std::string> expected;
  Duration poll{std::chrono::milliseconds(20)};
  // Polled while waiting for the round to close; true abandons the join (RendezvousAborted).
  std::function<bool()> should_abort;
  // >= 0: join exactly this round (the launcher's word); one that closed without this node
  // is waited out (should_abort, the timeout), never left for a later round of its own
  // accord. -1: the open round, and the next one when it closed first.
  int round = -1;
};

// join() gave up because should_abort said so (the caller has something better to do).
class RendezvousAborted : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct RoundResult {
  int round = 0;
  int node_rank = 0;
  int nnodes = 0;
  int world_size = 0;
  int rank_offset = 0;           // global rank of this node's local rank 0
  std::vector<NodeInfo> nodes;   // in node-rank order
};

class Rendezvous {
 public:
  Rendezvous(std::shared_ptr<store::Store> store, RendezvousOptions opts, NodeInfo self);

  // Joins the open round and blocks until it closes. A node that arrives after the round
  // closed (or when it is full) waits for the next round. Throws TimeoutError naming who
  // did and did not arrive.
  RoundResult join();

  // Opens the next round (elastic restart); joiners of a closed round move there.
  void openNextRound(int closedRound);
  // Records the nodes meant to join `round` (the launcher's word): a joiner's timeout then
  // says which of them did not join (besides RendezvousOptions::expected).
  void expect(int round, const std::vector<std::string>& names);
  // The names of the nodes that have joined `round` so far, in join order.
  std::vector<std::string> arrived(int round);
  // What a timeout of `round` after `waited` says: how many of at least `atLeast` joined,
  // who, and who of those expected (expect(), RendezvousOptions::expected) did not.
  std::string timeoutText(int round, Duration waited, int atLeast);

 private:
  std::string key(const std::string& k) const { return "rdzv/" + opts_.run_id + "/" + k; }
  std::string roundKey(int r, const std::string& k) const { return key("r/" + std::to_string(r) + "/" + k); }
  [[noreturn]] void timeout(int round, Duration waited);

  std::shared_ptr<store::Store> store_;
  RendezvousOptions opts_;
  NodeInfo self_;
};

// Heartbeats: each agent bumps its counter; a monitor declares a node dead when its counter
// has not moved for `timeout` on the monitor's own clock (no cross-host clock comparison).
class HeartbeatMonitor {
 public:
  HeartbeatMonitor(std::shared_ptr<store::Store> store, std::string run_id, Duration timeout);
  static void beat(store::Store& store, const std::string& run_id, const std::string& node);
  // Reads every node's counter; returns the names silent for longer than the timeout.
  std::vector<std::string> dead(const std::vector<std::string>& nodes);
  // A node's counter as it stands ("" before its first beat): whether an agent started
  // again has begun to beat is told by a change from what it was at the start.
  std::string counter(const std::string& node);

 private:
  struct Seen {
    std::string value;
    std::chrono::steady_clock::time_point since;
  };
  std::shared_ptr<store::Store> store_;
  std::string run_id_;
  Duration timeout_;
  std::vector<std::pair<std::string, Seen>> seen_;
};

std::string encodeNode(const NodeInfo& n);
NodeInfo decodeNode(const std::string& s);

}  // namespace dtrain::rendezvous
