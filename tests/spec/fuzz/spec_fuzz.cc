// Fuzz target for everything a user types that lib/spec reads: job spec JSON, hostfiles,
// --hosts lists, env files and the CLI overrides. Any bytes must either parse or throw
// SpecError (the one-line "file: /path: problem; fix" error); any other exception, a crash
// or a sanitizer report is a bug. A spec that parses and resolves must also survive the
// trip to a remote node: serializeForNode's text parses again to the same job.
// Built as a libFuzzer binary with -DDTRAIN_FUZZ=ON (clang); otherwise linked with
// tests/store/fuzz/replay_main.cc, which ctest uses to replay the corpus on every run.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>
#include <string_view>
#include <vector>

#include "dtrain/common/errors.h"
#include "dtrain/spec/job_spec.h"
#include "node_checks.h"

namespace {

using namespace dtrain;
using namespace dtrain::spec;

[[noreturn]] void bug(const char* where, const std::exception* e) {
  std::fprintf(stderr, "spec_fuzz: %s threw %s\n", where, e ? e->what() : "a non-std exception");
  __builtin_trap();
}

template <typename F>
void expectSpecErrorOnly(const char* where, F&& f) {
  try {
    f();
  } catch (const SpecError&) {
  } catch (const std::exception& e) {
    bug(where, &e);
  } catch (...) {
    bug(where, nullptr);
  }
}

std::vector<std::string> lines(std::string_view s) {
  std::vector<std::string> out;
  size_t pos = 0;
  while (pos <= s.size()) {
    size_t nl = s.find('\n', pos);
    if (nl == std::string_view::npos) nl = s.size();
    out.emplace_back(s.substr(pos, nl - pos));
    pos = nl + 1;
  }
  return out;
}

// "O\n" + up to 6 lines: nproc, nnodes, local_ranks_filter, hosts, env K=V, max_restarts;
// an empty line leaves that override unset.
void fuzzOverrides(std::string_view body) {
  auto ls = lines(body);
  ls.resize(6);
  Overrides o;
  if (!ls[0].empty()) o.nproc_per_node = ls[0];
  if (!ls[1].empty()) o.nnodes = ls[1];
  if (!ls[2].empty()) o.local_ranks_filter = ls[2];
  if (!ls[3].empty()) o.hosts = ls[3];
  if (!ls[4].empty()) o.env.push_back(ls[4]);
  if (!ls[5].empty()) o.max_restarts = static_cast<int>(std::strtol(ls[5].c_str(), nullptr, 10));
  expectSpecErrorOnly("applyOverrides", [&] {
    JobSpec spec = parseJobSpec(R"({"command": ["true"], "nproc_per_node": 2})", "fuzz.json");
    applyOverrides(spec, o);
    resolve(spec);
    (void)describe(spec);
  });
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const bool noDns = (detail::setNameLookups(false), true);  // random names stay off the network
  (void)noDns;
  std::string text(reinterpret_cast<const char*>(data), size);
  if (text.rfind("O\n", 0) == 0) {
    fuzzOverrides(std::string_view(text).substr(2));
    return 0;
  }
  expectSpecErrorOnly("parseHostfile", [&] { (void)parseHostfile(text, "fuzz.hosts"); });
  expectSpecErrorOnly("parseHostList", [&] { (void)parseHostList(text); });
  expectSpecErrorOnly("parseEnvFile", [&] { (void)parseEnvFile(text, "fuzz.env"); });
  JobSpec spec;
  bool ok = false;
  expectSpecErrorOnly("parseJobSpec", [&] {
    spec = parseJobSpec(text, "fuzz.json");
    resolve(spec);
    (void)describe(spec);
    ok = true;
  });
  if (!ok || !spec.nodes.empty()) return 0;  // nodes never travel: agents get single-node specs
  std::string shipped;
  try {
    shipped = serializeForNode(spec);
    JobSpec again = parseJobSpec(shipped, "fuzz.json");
    resolve(again);
    // What a node runs is the launcher's job, less what only the launcher uses.
    JobSpec expected = spec;
    expected.env_file.clear();
    expected.hostfile.clear();
    expected.ssh = again.ssh;
    expected.env_forward = again.env_forward;
    if (!(again == expected)) {
      std::fprintf(stderr, "spec_fuzz: the spec a node gets differs from the launcher's:\n%s\n", shipped.c_str());
      __builtin_trap();
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "spec_fuzz: a spec that parsed did not survive serializeForNode:\n%s\n", shipped.c_str());
    bug("serializeForNode round trip", &e);
  }
  return 0;
}
