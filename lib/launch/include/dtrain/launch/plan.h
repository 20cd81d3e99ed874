#pragma once
#include <map>
#include <string>
#include <vector>

#include "dtrain/spec/job_spec.h"

namespace dtrain::launch {

// Where one worker runs and who it is.
struct WorkerSlot {
  std::string host;
  int node_rank = 0;
  int local_rank = 0;
  int global_rank = 0;
  std::string device;  // "cuda:0" or "cpu"
};

struct Plan {
  std::string run_id;
  int round = 0;  // rendezvous round: a new one per restart or membership change
  int nnodes = 1;
  int world_size = 0;
  int local_world_size = 0;
  std::string master_addr;
  int master_port = 0;
  // dtrain's own store for this job (port 0: none, as in --dry-run). The token reaches
  // workers only through their environment.
  std::string store_addr;
  int store_port = 0;
  std::string store_token;
  std::vector<WorkerSlot> workers;
};

// One node: this host, spec.nproc_per_node workers. spec must be resolved.
// master_port 0 means "pick a free one now" (never spec.rendezvous.port).
Plan makeLocalPlan(const spec::JobSpec& spec, const std::string& run_id, int master_port = 0);

// The `--dry-run` table: host, node rank, local rank, global rank, device, command.
std::string formatPlan(const Plan& plan, const spec::JobSpec& spec);

// A TCP port free on 127.0.0.1 when handed out, never equal to `avoid`.
int pickFreePort(int avoid);

// A fresh run id: 12 hex digits from /dev/urandom.
std::string newRunId();

std::string hostName();

// Absolute path of the running dtrain binary (/proc/self/exe), for workers that are dtrain
// itself (trainer, bench). Throws IoError.
std::string selfExecutable();

}  // namespace dtrain::launch
