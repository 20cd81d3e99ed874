#include <dlfcn.h>

#include <cstdlib>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "dtrain/comm/communicator.h"
#include "dtrain/common/dynlib.h"
#include "dtrain/common/errors.h"
#include "dtrain/store/prefix_store.h"
#include "dtrain/store/tcp_store.h"

namespace dtrain::comm {

#ifdef DTRAIN_HAVE_CUDA
std::unique_ptr<Communicator> createNcclCommunicator(std::shared_ptr<store::Store> store, int rank, int size,
                                                     const CommOptions& opts);
bool ncclAvailable() { return true; }

#ifdef DTRAIN_NCCL_PLUGIN_LOADER
// The NCCL backend is libdtrain_comm_nccl.so next to the executable (see the end of
// nccl_communicator.cc for why), loaded here on first use. Thread-safe: a function-local static.
std::unique_ptr<Communicator> createNcclCommunicator(std::shared_ptr<store::Store> store, int rank, int size,
                                                     const CommOptions& opts) {
  using Factory = Communicator* (*)(const std::shared_ptr<store::Store>*, int, int, const CommOptions*);
  static const auto factory = [] {
    const char* entry = "dtrain_create_nccl_communicator";
    std::string errors;
    void* h = openLibrary(pluginCandidates("libdtrain_comm_nccl.so"), entry, &errors);
    if (!h)
      throw IoError(fmt::format("backend \"nccl\": cannot load libdtrain_comm_nccl.so (built with dtrain in CUDA "
                                "builds; needs NCCL's libnccl.so.2 and CUDA's libcudart): {}; install them or use "
                                "backend \"tcp\"",
                                errors));
    return reinterpret_cast<Factory>(::dlsym(h, entry));
  }();
  return std::unique_ptr<Communicator>(factory(&store, rank, size, &opts));
}
#endif
#else
bool ncclAvailable() { return false; }
#endif

namespace {

std::string env(const char* name, const char* hint) {
  const char* v = std::getenv(name);
  if (!v || !*v) throw SpecError(fmt::format("{} is not set; {}", name, hint));
  return v;
}

int envInt(const char* name, const char* hint) {
  std::string v = env(name, hint);
  try {
    size_t used = 0;
    int out = std::stoi(v, &used);
    if (used == v.size()) return out;
  } catch (...) {
  }
  throw SpecError(fmt::format("{}=\"{}\" is not an integer", name, v));
}

}  // namespace

int groupRank(const std::vector<int>& ranks, int rank, int size, const std::string& name) {
  if (name.empty()) throw SpecError("communicator group: the name is empty; give every group its own name");
  if (ranks.empty()) throw SpecError(fmt::format("communicator group \"{}\": the rank list is empty", name));
  std::vector<bool> seen(static_cast<size_t>(size), false);
  int mine = -1;
  for (size_t i = 0; i < ranks.size(); ++i) {
    const int r = ranks[i];
    if (r < 0 || r >= size)
      throw SpecError(fmt::format("communicator group \"{}\": rank {} is not a rank of the parent communicator (size {})",
                                  name, r, size));
    if (seen[static_cast<size_t>(r)])
      throw SpecError(fmt::format("communicator group \"{}\": rank {} is listed twice", name, r));
    seen[static_cast<size_t>(r)] = true;
    if (r == rank) mine = static_cast<int>(i);
  }
  if (mine < 0)
    throw SpecError(fmt::format("communicator group \"{}\": rank {} is not in it ({}); only the listed ranks may create it",
                                name, rank, fmt::join(ranks, ", ")));
  return mine;
}

std::unique_ptr<Communicator> createFromEnvironment(const CommOptions& opts) {
  const char* hint = "run this under 'dtrain run', which sets it for every worker";
  int rank = envInt("RANK", hint);
  int size = envInt("WORLD_SIZE", hint);
  store::TcpStoreOptions so;
  so.host = env("DTRAIN_STORE_ADDR", hint);
  so.port = envInt("DTRAIN_STORE_PORT", hint);
  so.token = env("DTRAIN_STORE_TOKEN", hint);
  so.timeout = opts.timeout;
  auto tcp = std::make_shared<store::TcpStore>(so);
  CommOptions o = opts;
  if (const char* shm = std::getenv("DTRAIN_COMM_SHM")) {
    std::string v = shm;
    if (v == "0" || v == "false" || v == "off" || v == "no") o.shm = false;
    else if (v == "1" || v == "true" || v == "on" || v == "yes" || v.empty()) o.shm = opts.shm;
    else throw SpecError(fmt::format("DTRAIN_COMM_SHM=\"{}\": expected 0 or 1", v));
  }
  if (o.advertise_addr.empty()) o.advertise_addr = tcp->localAddress();
  const char* run = std::getenv("DTRAIN_RUN_ID");
  const char* restart = std::getenv("TORCHELASTIC_RESTART_COUNT");
  const char* round = std::getenv("DTRAIN_ROUND");
  // Each attempt of each run meets in its own namespace, so a restarted job never sees the
  // addresses of the previous attempt. A membership change (a node joining) starts a new
  // round without spending a restart, hence the round too.
  auto store = std::make_shared<store::PrefixStore>(
      fmt::format("{}/{}/{}", run ? run : "run", restart ? restart : "0", round ? round : "0"), tcp);
  store->setTimeout(opts.timeout);
  if (o.backend == "tcp") return createTcpCommunicator(store, rank, size, o);
  if (o.backend == "nccl") {
#ifdef DTRAIN_HAVE_CUDA
    return createNcclCommunicator(store, rank, size, o);
#else
    throw SpecError("backend \"nccl\" is not in this build (a CPU build); rebuild with -DDTRAIN_WITH_CUDA=ON or use \"tcp\"");
#endif
  }
  throw SpecError(fmt::format("unknown backend \"{}\"; use \"tcp\" or \"nccl\"", o.backend));
}

}  // namespace dtrain::comm
