#pragma once
// The per-node agent (`dtrain agent`): started by the launcher on every node (over ssh for
// remote ones, as a child for local ones), it joins the job's rendezvous through the
// launcher's store, spawns this node's workers with the torchrun environment, streams their
// output and exits back to the launcher (docs: lib/launch agent_protocol.h), and tears them
// down when told to or when the launcher is gone (stdin EOF, store unreachable).
#include <string>
#include <vector>

namespace dtrain::agent {

struct AgentOptions {
  std::string store_addr;   // "" = the launcher as this host sees it (SSH_CONNECTION's client)
  int store_port = 0;
  std::string run_id;
  std::string node;         // node name, unique in the job (the hostfile's host)
  int order = -1;           // position in the hostfile: node rank of the first round
  int nnodes = 1;           // nodes the round waits for
  int nproc = 0;            // workers here; 0 = the spec's nproc_per_node ("auto" resolved here)
  std::vector<int> gpus;    // CUDA_VISIBLE_DEVICES for the workers; empty = leave as is
  std::string address;      // how other nodes reach this one; "" = learned from the connection
  // A host coming back: connect, say "W", and join only when the launcher says "restart".
  bool wait = false;
  // The launcher's stdout and stderr are one file: workers get one pipe for both (ordered).
  bool merge_output = false;
  // Make a data image of this host's data files for its workers (train/data.h): the
  // launcher's DTRAIN_DATA_SHARE, not this host's environment.
  bool data_share = true;
  // Refuse a trainer job this host cannot hold before the rendezvous (the launcher's
  // DTRAIN_MEMORY_CHECK, not this host's environment).
  bool memory_check = true;
  // Extra seconds this node waits for a round to form, past the spec's rendezvous.timeout_s:
  // an elastic job's launcher decides at the timeout itself whether the round goes on
  // without the nodes that did not join, so the joined ones must still be waiting then.
  double join_grace_s = 0;
  // Give up when the store has been unreachable this long (the launcher is gone).
  double store_lost_s = 5;
};

// Runs the node to completion; returns the process exit code (the first failing worker's,
// 2 for a bad spec, 1 for other agent failures). Reads the token from stdin first.
int runAgent(const AgentOptions& opts);

}  // namespace dtrain::agent
