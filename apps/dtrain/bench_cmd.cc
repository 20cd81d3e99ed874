#include "bench_cmd.h"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <new>
#include <tuple>

#include "dtrain/comm/bench.h"
#include "dtrain/comm/communicator.h"
#include "dtrain/common/errors.h"
#include "dtrain/common/strings.h"
#include "dtrain/launch/job.h"
#include "dtrain/launch/multi_node.h"
#include "dtrain/launch/output.h"
#include "dtrain/launch/plan.h"
#include "dtrain/spec/error_file.h"
#include "dtrain/spec/job_spec.h"
#include "output_file.h"
#include "version.h"

namespace dtrain::app {
namespace {

struct BenchArgs {
  std::vector<std::pair<CLI::App*, comm::Collective>> subs;
  std::string nproc = "2";
  std::string backend = "tcp";
  std::string minBytes = "4K", maxBytes = "64M";
  // (as text: parseIntFlag says which flag and its range, where CLI11 said "Could not convert")
  std::string factorText = "2", itersText = "20", warmupText = "5";
  size_t factor = 2;
  int iters = 20, warmup = 5;
  std::string dtype = "float", op = "sum";
  std::string json;
  double timeout_s = 120;
  bool worker = false;
  std::string hostfile, hosts;
  std::vector<std::string> ssh_options;
};

BenchArgs gArgs;

// A value's SpecError, said after the flag that gave it (as every other flag's is).
template <typename F>
auto withFlag(const char* flag, F parse) {
  try {
    return parse();
  } catch (const SpecError& e) {
    throw SpecError(fmt::format("{}: {}", flag, e.what()));
  }
}

comm::BenchOptions benchOptions(comm::Collective c) {
  auto& a = gArgs;
  comm::BenchOptions o;
  o.collective = c;
  o.min_bytes = parseSize(a.minBytes, "-b/--minbytes");
  o.max_bytes = parseSize(a.maxBytes, "-e/--maxbytes");
  if (o.min_bytes == 0 || o.min_bytes > o.max_bytes)
    throw SpecError(fmt::format("-b/-e: need 0 < minbytes <= maxbytes, got {} and {}", a.minBytes, a.maxBytes));
  o.dtype = withFlag("-d/--datatype", [&] { return comm::parseDataType(a.dtype); });
  // A size below one element measures nothing: -e 3 with floats was an empty table, "OK" and
  // exit 0 (and -b 3 quietly started at 4).
  const size_t es = comm::elementSize(o.dtype);
  for (const auto& [flag, given, bytes] :
       {std::tuple{"-b/--minbytes", a.minBytes, o.min_bytes}, std::tuple{"-e/--maxbytes", a.maxBytes, o.max_bytes}})
    if (bytes < es)
      throw SpecError(
          fmt::format("{}: {} is less than one {} ({} bytes), the smallest size measured; give {} or "
                      "more",
                      flag, given, comm::name(o.dtype), es, es));
  a.factor = static_cast<size_t>(parseIntFlag("-f/--stepfactor", a.factorText, 2, 1 << 20));
  a.iters = parseIntFlag("-n/--iters", a.itersText, 1, 1000000000);
  a.warmup = parseIntFlag("-w/--warmup_iters", a.warmupText, 0, 1000000000);
  // (its ranks read them: said once, here)
  for (const char* v : {"DTRAIN_COMM_SHM", "DTRAIN_COMM_CHECK"}) (void)envSwitch(v);
  if (a.backend != "tcp" && a.backend != "nccl")
    throw SpecError(fmt::format("--backend: expected tcp or nccl, got \"{}\"", a.backend));
  // (from 1 ms: below, the communicator's millisecond deadline was 0 and every rank failed at
  // once, "timed out after 0 s")
  if (!(a.timeout_s >= 0.001 && a.timeout_s <= 86400.0 * 365))
    throw SpecError(fmt::format("--timeout: expected seconds from 0.001 up to a year, got {}", a.timeout_s));
  o.factor = a.factor;
  o.iters = a.iters;
  o.warmup = a.warmup;
  o.op = withFlag("-o/--op", [&] { return comm::parseReduceOp(a.op); });
  return o;
}

// Writes --json whole (writeOutputFile: a regular file is replaced, never torn, since it is
// rewritten after every row and a signal may cut one short; a pipe or /dev/stdout, which
// checkOutputFile accepts, is written in place).
void writeBenchJson(const std::string& path, const std::string& text) {
  try {
    writeOutputFile(path, text);
  } catch (const IoError& e) {
    throw IoError(fmt::format("--json: {}", e.what()));
  }
}

int worker(comm::Collective c) {
  auto& a = gArgs;
  comm::BenchOptions o = benchOptions(c);
  // DTRAIN_DEBUG_BENCH_CORRUPT=RANK (fault injection, for tests): that rank alters one value
  // of each size's verified result, so the #wrong count and the exit status can be checked
  // through the binary.
  if (const char* corrupt = std::getenv("DTRAIN_DEBUG_BENCH_CORRUPT"); corrupt && *corrupt)
    o.corrupt_rank = static_cast<int>(parseInteger(corrupt, "DTRAIN_DEBUG_BENCH_CORRUPT", 0, 1 << 20));
  // Across hosts, each host's ranks check their own memory (the launcher checked its own).
  if (auto problem = comm::benchMemoryProblem(o, envIndex("LOCAL_WORLD_SIZE", 1), comm::physicalMemoryBytes());
      !problem.empty())
    throw SpecError(problem);
  // Rank 0 writes --json on its own host: checked there, before the ranks meet, so that a
  // path that cannot be written, or someone's file that it would replace, ends the job at
  // once with exit 2 (across hosts the launcher cannot look at rank 0's files).
  if (!a.json.empty() && envIndex("RANK", 0) == 0)
    checkOutputFile(a.json, "--json", {"a dtrain bench --json file", comm::isBenchJsonText});
  comm::CommOptions co;
  co.backend = a.backend;
  co.timeout = comm::Duration(static_cast<long long>(a.timeout_s * 1000));
  auto comm = comm::createFromEnvironment(co);
  // Rank 0 prints the table as it goes, a row per size as soon as it is measured (as
  // nccl-tests does): a long sweep shows progress, and an interrupted one keeps its rows.
  const bool printer = comm->rank() == 0;
  // With the JSON on stdout (--json -), the table goes to stderr: stdout is then one JSON
  // document a pipe can parse.
  std::ostream& table = !a.json.empty() && inheritedOutputFd(a.json) == STDOUT_FILENO ? std::cerr : std::cout;
  // (the table's header and the JSON say the same)
  const std::string transport = c == comm::Collective::kSendRecv ? comm->p2pTransport() : comm->transport();
  if (printer) table << comm::formatBenchHeader(o, comm->size(), comm->backend(), transport) << std::flush;
  std::vector<comm::BenchRow> rows, done;
  try {
    rows = comm::runBench(*comm, o, [&](const comm::BenchRow& r) {
      if (!printer) return;
      table << comm::formatBenchRow(r, o) << std::flush;
      // --json keeps what was measured, as the table does: rewritten after each row
      // ("complete": false until the sweep ends), so a sweep stopped by SIGINT or SIGTERM
      // (or killed) leaves every row it finished. Only a file can be rewritten: a pipe or
      // /dev/stdout gets the one document at the end.
      if (!a.json.empty() && !isSpecialOutput(a.json)) {
        done.push_back(r);
        writeBenchJson(a.json, comm::benchJson(done, o, comm->size(), comm->backend(), transport, false));
      }
    });
  } catch (const std::bad_alloc&) {
    // The memory check passed but the memory was not there (other processes use it).
    throw IoError(fmt::format("rank {}: out of memory for the buffers of a size up to {} bytes; lower -e/--maxbytes",
                              comm->rank(), o.max_bytes));
  }
  long long wrong = 0;
  for (const auto& r : rows) wrong += r.wrong;
  if (printer) {
    table << comm::formatBenchFooter(rows) << std::flush;
    if (!a.json.empty())
      writeBenchJson(a.json, comm::benchJson(rows, o, comm->size(), comm->backend(), transport, true));
  }
  // Rank 0 holds every rank's count (summed) and reports it; were the other ranks to exit 1
  // too, the first of them would have the launcher stop rank 0 before its footer and final
  // JSON were written.
  return printer && wrong ? 1 : 0;
}

int launch(comm::Collective c, CLI::App* sub) {
  auto& a = gArgs;
  benchOptions(c);  // refuse bad flags before starting anything
  // --json "" (an unset variable) would otherwise mean "no JSON" (--hosts "": run here)
  // and say nothing; refused as for run's path options.
  for (const char* name : {"--json", "--hostfile", "--hosts", "--nproc-per-node"}) {
    const CLI::Option* o = sub->get_option_no_throw(name);
    if (!o || o->count() == 0) continue;
    const auto& given = o->results();
    if (std::any_of(given.begin(), given.end(), [](const std::string& v) { return v.empty(); }))
      throw SpecError(
          fmt::format("{}: the value is empty (an unset variable?); give a value or leave the option out", name));
  }
  // NCCL is checked here, once, rather than by every rank after the launch. Multi-node
  // pre-flight requires the same build on every host, so a CPU build is refused for all;
  // GPUs are counted here for local ranks (each remote host's ranks find their own).
  if (a.backend == "nccl") {
#ifndef DTRAIN_HAVE_CUDA
    throw SpecError(
        "--backend: nccl needs a CUDA build of dtrain, and this is a CPU build (dtrain --version says "
        "which); use --backend tcp");
#endif
  }
  if (!a.json.empty() && a.hostfile.empty() && a.hosts.empty()) {
    checkOutputFile(a.json, "--json", {"a dtrain bench --json file", comm::isBenchJsonText});  // local ranks: rank 0 writes it here
  }
  // -o is the reduction of allreduce; elsewhere it would be ignored, and a table run with
  // "-o max" that measured no max would say nothing of it.
  if (c != comm::Collective::kAllreduce) {
    const CLI::Option* o = sub->get_option_no_throw("--op");
    if (o && o->count() > 0)
      throw SpecError(fmt::format(
          "-o/--op: bench {} has no reduction; -o applies to bench allreduce only, leave it out", comm::name(c)));
  }
  spec::JobSpec s;
  s.name = fmt::format("bench-{}", comm::name(c));
  s.command = {launch::selfExecutable(),
               "bench",
               sub->get_name(),
               "--worker",
               "--backend",
               a.backend,
               "-b",
               a.minBytes,
               "-e",
               a.maxBytes,
               "-f",
               std::to_string(a.factor),
               "-n",
               std::to_string(a.iters),
               "-w",
               std::to_string(a.warmup),
               "-d",
               a.dtype,
               "-o",
               a.op,
               "--timeout",
               fmt::format("{}", a.timeout_s)};
  if (!a.json.empty()) {
    s.command.push_back("--json");
    s.command.push_back(a.json);
  }
  spec::Overrides ov;
  // Given, --nproc-per-node is an override like run's (a host's slots that disagree are
  // refused); else 2 ranks is the default, for the hosts without slots.
  const CLI::Option* nprocOpt = sub->get_option_no_throw("--nproc-per-node");
  if (nprocOpt && nprocOpt->count() > 0)
    ov.nproc_per_node = a.nproc;
  else
    s.nproc_per_node = 2;
  if (!a.hostfile.empty()) ov.hostfile = a.hostfile;
  if (!a.hosts.empty()) ov.hosts = a.hosts;
  spec::applyOverrides(s, ov);
  s.ssh.options = a.ssh_options;
  s.prefix_output = false;
  s.console_ranks = {0};
  s.shutdown_timeout_s = 5;
  s.env["OMP_NUM_THREADS"] = "1";
  spec::resolve(s, ov);
  if (s.nodes.empty() && a.backend == "nccl") {
    const int gpus = spec::visibleGpuCount();
    if (gpus == 0)
      throw SpecError(
          "--backend: nccl needs a GPU, and none is visible here (check the driver and "
          "CUDA_VISIBLE_DEVICES); use --backend tcp");
    // NCCL refuses two ranks of one communicator on the same GPU.
    if (s.nproc_per_node > gpus)
      throw SpecError(
          fmt::format("--nproc-per-node: {} ranks with --backend nccl need a GPU each, and {} {} visible "
                      "here; use --nproc-per-node {} or fewer",
                      s.nproc_per_node, gpus, gpus == 1 ? "is" : "are", gpus));
  }
  if (s.nodes.empty()) {
    if (auto problem = comm::benchMemoryProblem(benchOptions(c), s.nproc_per_node, comm::physicalMemoryBytes());
        !problem.empty())
      throw SpecError(problem);
  }
  // The resolved count ("02", "auto" or hosts' slots, not the flag's text); unknown (0) where
  // "auto" is counted on each host (the workers check it there).
  int world = 0;
  for (const auto& node : s.nodes) world += node.slots > 0 ? node.slots : s.nproc_per_node;
  if (s.nodes.empty()) world = s.nproc_per_node;
  if (s.nproc_auto && std::any_of(s.nodes.begin(), s.nodes.end(), [](const auto& n) { return n.slots == 0; }))
    world = 0;
  if (c == comm::Collective::kSendRecv && world != 0 && world != 2)
    throw SpecError(s.nodes.empty()
                        ? fmt::format("--nproc-per-node: bench sendrecv is a 2-rank ping-pong, got {}; use "
                                      "--nproc-per-node 2", world)
                        : fmt::format("{}: bench sendrecv is a 2-rank ping-pong, and these hosts have {} slots in all; "
                                      "give 2 (e.g. --hosts h1:1,h2:1)",
                                      a.hosts.empty() ? "--hostfile" : "--hosts", world));
  if (c == comm::Collective::kAllgather) {
    const comm::BenchOptions o = benchOptions(c);
    if (world > 0 && o.max_bytes < comm::elementSize(o.dtype) * static_cast<size_t>(world))
      throw SpecError(comm::allgatherTooSmall(o, world));
  }
  launch::RunResult r;
  if (!s.nodes.empty()) {
    // Across hosts: one agent per host over ssh, as dtrain run does; rank 0 (node 0)
    // prints the table (and writes --json on its host).
    launch::MultiNodeOptions mo;
    mo.version = versionString();
    r = launch::runMultiNodeJob(s, launch::newRunId(), mo);
  } else {
    r = launch::runLocalJob(s, launch::newRunId());
  }
  // (behind the workers' lines the console may still hold; written out before dtrain exits)
  if (r.first_failure >= 0 || !r.failure_message.empty())
    launch::console().write(STDERR_FILENO, launch::formatFailure(r, s));
  // The table is bench's result: one that did not reach stdout whole is a failure, not an
  // "OK" no one saw (exit 1, as any OS failure; a failed job keeps its own code). Known once
  // the console has written it out.
  launch::console().flush();
  if (const int err = launch::console().firstError(STDOUT_FILENO)) {
    launch::console().write(STDERR_FILENO, fmt::format("dtrain: error: cannot write to stdout: {} (the table was not "
                                                       "printed whole)\n",
                                                       std::strerror(err)));
    if (r.exit_code == 0) return kExitFailure;
  }
  return r.exit_code;
}

}  // namespace

void addBenchCommands(CLI::App& app) {
  auto& a = gArgs;
  auto* bench = app.add_subcommand("bench", "Benchmarks: collectives and send/recv across ranks (nccl-tests style)");
  bench->require_subcommand(1);
  for (auto c : {comm::Collective::kAllreduce, comm::Collective::kBroadcast, comm::Collective::kAllgather,
                 comm::Collective::kSendRecv}) {
    auto* sub = bench->add_subcommand(
        comm::name(c),
        c == comm::Collective::kSendRecv
            ? std::string("Benchmark send/recv (2-rank ping-pong, time = half the round trip) and verify the payloads")
            : fmt::format("Benchmark {} and verify its results", comm::name(c)));
    sub->add_option("--nproc-per-node,--nproc_per_node", a.nproc, "Ranks to launch (default 2)");
    sub->add_option("--backend", a.backend, "tcp or nccl (default tcp)");
    sub->add_option("-b,--minbytes", a.minBytes, "Smallest size (default 4K)");
    sub->add_option("-e,--maxbytes", a.maxBytes, "Largest size (default 64M)");
    sub->add_option("-f,--stepfactor", a.factorText, "Size multiplier between rows (default 2)");
    sub->add_option("-n,--iters", a.itersText, "Timed iterations per size (default 20)");
    sub->add_option("-w,--warmup_iters", a.warmupText, "Warm-up iterations per size (default 5)");
    sub->add_option("-d,--datatype", a.dtype, "float, double, int32, int64, bfloat16, half (default float)");
    auto* op = sub->add_option("-o,--op", a.op, "sum, avg, min, max (default sum)");
    if (c != comm::Collective::kAllreduce) op->group("");  // (no reduction: hidden, still passed to the ranks)
    sub->add_option("--json", a.json, "Also write the results as JSON to this file; - for stdout")
        // ("-" is stdout, as for run's --summary-json: it made a file named "-")
        ->transform([](const std::string& v) { return v == "-" ? std::string("/dev/stdout") : v; });
    sub->add_option("--timeout", a.timeout_s, "Seconds before a stuck collective fails (default 120)");
    sub->add_option("--hostfile", a.hostfile, "Run the ranks across the hosts of this file (slots = ranks per host)");
    sub->add_option("--hosts", a.hosts, "Run the ranks across these hosts: h1:1,h2:1");
    sub->add_option("--ssh-option", a.ssh_options,
                    "Extra ssh argument for --hostfile/--hosts, repeatable (e.g. --ssh-option=-F --ssh-option=cfg)")
        ->allow_extra_args(false);
    sub->add_flag("--worker", a.worker, "(internal) run as one rank under dtrain run")->group("");
    a.subs.emplace_back(sub, c);
  }
}

int runBenchCommand() {
  for (auto& [sub, c] : gArgs.subs) {
    if (!sub->parsed()) continue;
    if (!gArgs.worker) return launch(c, sub);
    try {
      return worker(c);
    } catch (const std::exception& e) {
      // Under dtrain run, the error file is what the failure's headline and summary say of
      // this rank (before: "rank 0 exited with code 1" and nothing more); main says it on
      // stderr.
      spec::leaveWorkerError(e.what());
      throw;
    }
  }
  return -1;
}

}  // namespace dtrain::app
