#pragma once
#include <memory>
#include <string>

#include "dtrain/launch/launcher.h"
#include "dtrain/spec/job_spec.h"

namespace dtrain::store {
class TcpStoreServer;
}

namespace dtrain::launch {

// Starts the job's store on `bind` at spec.rendezvous.port (0 = a free one; the chosen port
// is written back) with a fresh token. A busy configured port is a SpecError naming the
// field. The server serves on its own thread until destroyed.
struct JobStore {
  std::unique_ptr<store::TcpStoreServer> server;
  std::string bind;
  std::string token;
  JobStore();
  JobStore(JobStore&&) noexcept;
  JobStore& operator=(JobStore&&) noexcept;
  ~JobStore();
};
JobStore startJobStore(spec::JobSpec& spec, const std::string& bind);

// Runs a resolved single-node job: hosts its store on loopback (port spec.rendezvous.port,
// 0 = a free one; the chosen port is written back), launches the workers with the store's
// endpoint and a fresh token in their environment, and waits for them.
// remove_if_killed: files of the run's own that the caller removes at its end (see
// LocalRunOptions).
RunResult runLocalJob(spec::JobSpec& spec, const std::string& run_id, const std::vector<std::string>& remove_if_killed = {});

}  // namespace dtrain::launch
