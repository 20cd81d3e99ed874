#include <dlfcn.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cstdlib>
#include <map>

#include "detail/rank_list.h"
#include "dtrain/comm/communicator.h"
#include "dtrain/common/dynlib.h"
#include "dtrain/common/errors.h"
#include "dtrain/common/strings.h"
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
      throw IoError(
          fmt::format("backend \"nccl\": cannot load libdtrain_comm_nccl.so ({}); it is built beside the "
                      "dtrain binary in CUDA builds (copy it along with dtrain, also to ssh.dtrain_path on "
                      "remote hosts) and needs NCCL (libnccl.so.2) and CUDA's runtime; or train on the CPU "
                      "(trainer.device \"cpu\", bench --backend tcp)",
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

std::string agreeOnBackend(store::Store& store, int rank, int size, const CommOptions& opts) {
  if (size <= 1) return opts.backend;
  const std::string prefix = "comm/" + opts.name + "/backend/";
  // A rank that never comes (not started, or failed before it got here) is named, not the
  // store key the others waited for.
  auto timedOut = [&](const TimeoutError& e) {
    std::vector<int> missing;
    try {
      for (int r = 0; r < size; ++r)
        if (!store.check({prefix + std::to_string(r)})) missing.push_back(r);
    } catch (const std::exception&) {
    }
    if (missing.empty()) throw e;
    return PeerLostError(fmt::format("communicator \"{}\" set-up on rank {}: lost rank {}: rank{} {} did not join "
                                     "(not started, or failed before it): {}",
                                     opts.name, rank, missing.front(), missing.size() == 1 ? "" : "s",
                                     detail::rankList(missing), e.what()));
  };
  // An offer: the backend, and "+tcp" when this rank accepts tcp instead.
  const std::string offer = opts.backend + (opts.tcp_fallback && opts.backend != "tcp" ? "+tcp" : "");
  store.set(prefix + std::to_string(rank), offer);
  if (rank == 0) {
    std::vector<std::string> keys;
    for (int r = 0; r < size; ++r) keys.push_back(prefix + std::to_string(r));
    std::vector<std::string> offers;
    try {
      offers = store.multiGet(keys);
    } catch (const TimeoutError& e) {
      throw timedOut(e);
    }
    std::map<std::string, std::vector<int>> byBackend;  // backend -> ranks asking for it
    bool allAcceptTcp = true;
    for (int r = 0; r < size; ++r) {
      const std::string& o = offers[static_cast<size_t>(r)];
      const size_t plus = o.find('+');
      byBackend[o.substr(0, plus)].push_back(r);
      allAcceptTcp = allAcceptTcp && (plus != std::string::npos || o == "tcp");
    }
    std::string decision;
    if (byBackend.size() == 1) {
      decision = byBackend.begin()->first;
    } else if (allAcceptTcp) {
      decision = "tcp";
    } else {
      std::string who;
      for (const auto& [b, rs] : byBackend)
        who += fmt::format("{}{} {} \"{}\"", who.empty() ? "" : "; ", rs.size() == 1 ? "rank" : "ranks",
                           detail::rankList(rs), b);
      decision = fmt::format(
          "!communicator \"{}\": the ranks ask for different backends ({}), and NCCL ranks "
          "cannot meet TCP ranks; give every rank a GPU, or use the CPU (trainer.device \"cpu\", "
          "backend \"tcp\") on all",
          opts.name, who);
    }
    store.set(prefix + "decision", decision);
  }
  std::string decision;
  try {
    decision = store.get(prefix + "decision");
  } catch (const TimeoutError& e) {
    throw timedOut(e);
  }
  if (!decision.empty() && decision[0] == '!') throw SpecError(decision.substr(1));
  return decision;
}

std::unique_ptr<Communicator> createFromEnvironment(const CommOptions& opts) {
  const char* hint = "run this under 'dtrain run', which sets it for every worker";
  // A DTRAIN_STORE_ADDR left in a shell (exported from a worker's environment, or by hand for
  // `dtrain store`) makes `dtrain train` take itself for a worker of a run: say that variable.
  if (const char* rankVar = std::getenv("RANK"); (!rankVar || !*rankVar) && std::getenv("DTRAIN_STORE_ADDR"))
    throw SpecError(
        "RANK is not set, but DTRAIN_STORE_ADDR is, as for a worker of 'dtrain run': unset "
        "DTRAIN_STORE_ADDR (left over from another run?) to train alone, or run this under 'dtrain run'");
  int rank = envInt("RANK", hint);
  int size = envInt("WORLD_SIZE", hint);
  store::TcpStoreOptions so;
  so.host = env("DTRAIN_STORE_ADDR", hint);
  so.port = envInt("DTRAIN_STORE_PORT", hint);
  so.token = env("DTRAIN_STORE_TOKEN", hint);
  so.timeout = opts.timeout;
  auto tcp = std::make_shared<store::TcpStore>(so);
  CommOptions o = opts;
  if (envSwitch("DTRAIN_COMM_SHM") == false) o.shm = false;  // (1 leaves opts.shm as it is)
  if (envSwitch("DTRAIN_COMM_CHECK") == true) o.check = true;
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
  if (o.backend != "tcp" && o.backend != "nccl")
    throw SpecError(fmt::format("unknown backend \"{}\"; use \"tcp\" or \"nccl\"", o.backend));
  o.backend = agreeOnBackend(*store, rank, size, o);
  if (o.backend == "tcp") return createTcpCommunicator(store, rank, size, o);
#ifdef DTRAIN_HAVE_CUDA
  return createNcclCommunicator(store, rank, size, o);
#else
  throw SpecError(
      "backend \"nccl\" is not in this build (a CPU build); rebuild with -DDTRAIN_WITH_CUDA=ON or use \"tcp\"");
#endif
}

}  // namespace dtrain::comm
