#include "dtrain/launch/job.h"

#include <memory>

#include <fmt/format.h>

#include "dtrain/common/errors.h"
#include "dtrain/store/tcp_store.h"
#include "dtrain/store/token.h"

namespace dtrain::launch {

RunResult runLocalJob(spec::JobSpec& spec, const std::string& run_id) {
  store::TcpStoreServerOptions so;
  so.bind = "127.0.0.1";  // every worker is local
  so.port = spec.rendezvous.port;
  so.token = store::newToken();
  std::unique_ptr<store::TcpStoreServer> owned;
  try {
    owned = std::make_unique<store::TcpStoreServer>(so);
  } catch (const IoError& e) {
    if (so.port == 0) throw;
    throw SpecError(fmt::format("{}: /rendezvous/port: {}; choose a free port, or 0 for any", spec.source.empty() ? "job" : spec.source, e.what()));
  }
  store::TcpStoreServer& server = *owned;
  server.start();
  spec.rendezvous.port = server.port();
  Plan plan = makeLocalPlan(spec, run_id);
  plan.store_addr = so.bind;
  plan.store_port = server.port();
  plan.store_token = so.token;
  return makeLocalLauncher()->run(plan, spec);
}

}  // namespace dtrain::launch
