// `dtrain run` and `dtrain validate`: a job spec (or a command) with the command line's
// overrides, resolved and checked before anything starts, then launched locally or across
// hosts; the outcome as an exit code and a --summary-json. The end of a run (its outcome decided,
// the stop signals that come after it) is this file's contract too (enterRunEnd).
#include "run_cmd.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <iterator>
#include <optional>
#include <string>
#include <vector>

#include "dtrain/common/errors.h"
#include "dtrain/common/files.h"
#include "dtrain/common/strings.h"
#include "dtrain/launch/job.h"
#include "dtrain/launch/launcher.h"
#include "dtrain/launch/multi_node.h"
#include "dtrain/launch/orphan_guard.h"
#include "dtrain/launch/output.h"
#include "dtrain/launch/plan.h"
#include "dtrain/launch/process.h"
#include "dtrain/spec/job_spec.h"
#include "dtrain/spec/summary.h"
#include "dtrain/train/checkpoint.h"
#include "dtrain/train/data.h"
#include "dtrain/train/device.h"
#include "dtrain/train/memory_estimate.h"
#include "output_file.h"
#include "version.h"

namespace dtrain::app {

void addOverrideFlags(CLI::App* cmd, RunArgs& a) {
  cmd->add_option("--nproc-per-node,--nproc_per_node", a.nproc, "Workers on this node: 1..4096 or \"auto\"");
  cmd->add_option("--max-restarts,--max_restarts", a.max_restarts, "Restarts allowed before the job fails");
  cmd->add_option("--nnodes", a.nnodes, "Elastic node range N or MIN:MAX (multi-node; default: all hosts given)");
  cmd->add_option("--log-dir,--log_dir", a.overrides.log_dir, "Directory for per-rank log files (rank_N.log)");
  // One value per --env: a vector option would otherwise swallow the spec after it.
  cmd->add_option("--env", a.overrides.env,
                  "Extra worker environment KEY=VALUE, or NAME alone for dtrain's own value of NAME (mpirun's -x "
                  "NAME; it must be set); repeatable, wins over the spec")
      ->allow_extra_args(false);
  cmd->add_option("--env-forward", a.overrides.env_forward,
                  "Also pass the launcher's variables starting with PREFIX to remote workers (repeatable; added to the "
                  "spec's env_forward)")
      ->allow_extra_args(false);
  cmd->add_option("--shutdown-timeout", a.shutdown,
                  "Seconds between the stop signal (SIGTERM, or the SIGINT/SIGHUP/SIGQUIT dtrain got) and SIGKILL at "
                  "teardown (default 30)");
  cmd->add_option("--local-ranks-filter,--local_ranks_filter", a.overrides.local_ranks_filter,
                  "Show only these local ranks on the console, e.g. 0,2 (log files still get all)");
  cmd->add_flag("--no-prefix", a.overrides.no_prefix, "Do not prefix worker lines with [rank N]");
  cmd->add_option("--hostfile", a.hostfile,
                  "Run across the hosts of this file (host slots=N, host:N, user@host; one per line)");
  cmd->add_option("--hosts", a.hosts, "Run across these hosts: h1:2,h2:2 (replaces the spec's nodes)");
  // One value per flag (as --env): "-F" alone is the option, its file the next flag's value.
  cmd->add_option(
         "--ssh-option", a.ssh_options,
         "Extra ssh argument, repeatable, after the spec's ssh.options (e.g. --ssh-option=-F --ssh-option=cfg)")
      ->allow_extra_args(false);
}

namespace {

const OutputKind kSummaryOutput{"a dtrain run summary", spec::isRunSummaryText};

double parseDoubleFlag(const std::string& flag, const std::string& v) {
  size_t used = 0;
  double out = 0;
  try {
    out = std::stod(v, &used);
  } catch (...) {
    used = 0;
  }
  // (decimal only: stod also reads hex, "inf" and "nan")
  const bool decimal = v.find_first_not_of("0123456789.eE+-") == std::string::npos;
  if (used != v.size() || v.empty() || !decimal || !std::isfinite(out))
    throw SpecError(fmt::format("{}: expected seconds, got \"{}\"", flag, v));
  return out;
}

// A directory dtrain will use or create: it, or its nearest existing ancestor, must be a
// directory this process can write. Throws SpecError naming `what`; creates nothing.
void checkCreatable(const std::string& path, const std::string& what) {
  namespace fs = std::filesystem;
  fs::path p = fs::absolute(path).lexically_normal();
  std::error_code ec;
  while (!fs::exists(p, ec) && p.has_parent_path() && p.parent_path() != p) p = p.parent_path();
  if (!fs::is_directory(p, ec))
    throw SpecError(fmt::format("{}: \"{}\" cannot be created: {} is not a directory; give a path in a directory", what,
                                path, p.string()));
  if (::access(p.c_str(), W_OK | X_OK) != 0) {
    const int err = errno;
    // (an existing directory cannot be written; a missing one cannot be created in p)
    const bool exists = p == fs::absolute(path).lexically_normal();
    throw SpecError(fmt::format("{}: \"{}\" {}: {}: {}; give a path you can write", what, path,
                                exists ? "cannot be written" : "cannot be created", p.string(), std::strerror(err)));
  }
}

// Where the log directory came from, for its messages: the flag, or the spec's field.
std::string logDirWhere(const spec::JobSpec& s, const RunArgs& a) {
  if (a.overrides.log_dir || s.source.empty() || s.source == "command line") return "--log-dir";
  return s.source + ": /log_dir";
}

// The run's outputs (log directory, summary file) are checked before anything starts, so a
// typo in a path is exit 2 at once, not a failure reported after a successful job.
void checkOutputs(const spec::JobSpec& s, const RunArgs& a) {
  if (!s.log_dir.empty()) {
    const std::string where = logDirWhere(s, a);
    checkCreatable(s.log_dir, where);
    // Another user's directory that anyone may write in, without the sticky bit (/tmp has
    // it): its files could be swapped under this run at any time.
    struct stat d {};
    if (::stat(s.log_dir.c_str(), &d) == 0 && S_ISDIR(d.st_mode) && d.st_uid != ::geteuid() && (d.st_mode & S_IWOTH) &&
        !(d.st_mode & S_ISVTX))
      throw SpecError(
          fmt::format("{}: \"{}\" belongs to another user and anyone may write in it; "
                      "its files could be replaced under this run: use a directory of your own",
                      where, s.log_dir));
    // Rank logs are appended to: one of this run's ranks left by another user, made
    // read-only, or in the way as a directory or a dangling link would fail the launch after
    // the workers' store is up (exit 1); said here instead.
    const int world = s.nodes.empty() ? s.nproc_per_node : launch::makeNodesPlan(s, "check").world_size;
    for (int r = 0; r < world; ++r) {
      const std::filesystem::path log = std::filesystem::path(s.log_dir) / fmt::format("rank_{}.log", r);
      std::error_code ec;
      const auto st = std::filesystem::symlink_status(log, ec);
      if (ec || st.type() == std::filesystem::file_type::not_found) continue;
      std::string why;
      if (st.type() == std::filesystem::file_type::symlink)
        why =
            "it is a symbolic link (rank logs are written to regular files only: a link in a shared directory "
            "would send this run's output to a file of someone else's choosing)";
      else if (st.type() == std::filesystem::file_type::directory)
        why = "it is a directory";
      else if (st.type() != std::filesystem::file_type::regular)
        why = "it is not a regular file (a FIFO would block)";
      else if (::access(log.c_str(), W_OK) != 0)
        why = std::strerror(errno);
      if (!why.empty())
        throw SpecError(
            fmt::format("{}: cannot append to {}: {}; make it writable, remove it, or use "
                        "another log_dir",
                        where, log.string(), why));
    }
  }
  // (a local job's; across hosts node 0's agent checks it where rank 0 will write)
  if (s.trainer && !s.trainer->checkpoint.dir.empty() && s.nodes.empty())
    checkCreatable(s.trainer->checkpoint.dir, s.source + ": /trainer/checkpoint/dir");
  if (!a.summary_json.empty()) app::checkOutputFile(a.summary_json, "--summary-json", kSummaryOutput);
}

// What validate and --dry-run print is their result: a stdout that cannot take it whole (a
// full disk, /dev/full, a pipe closed early) is dtrain's failure, one line and exit 1 (an OS
// failure, docs/errors.md), not an exit 0 for an answer no one saw. `what` names it.
void printResult(const std::string& text, const char* what) {
  std::cout.flush();
  if (!writeAllBlocking(STDOUT_FILENO, text))
    throw IoError(fmt::format("cannot write to stdout: {} ({} was not printed whole)", std::strerror(errno), what));
}

// A file of the run's own, removed when the run ends however it ends. With `only_holding`,
// a directory removed only while it holds nothing but that file (the log directory a run
// made for itself beside a busy log_dir, and its lock: a run refused before its launch
// leaves no empty directory behind; one that wrote logs there keeps them).
struct RemoveOnExit {
  std::string path;
  std::string only_holding;
  RemoveOnExit() = default;
  RemoveOnExit(const RemoveOnExit&) = delete;
  RemoveOnExit& operator=(const RemoveOnExit&) = delete;
  ~RemoveOnExit() {
    if (path.empty()) return;
    std::error_code ec;
    if (!only_holding.empty()) {
      std::filesystem::directory_iterator it(path, ec);
      for (; !ec && it != std::filesystem::directory_iterator(); it.increment(ec))
        if (it->path().filename() != only_holding) return;
      if (ec) return;
    }
    std::filesystem::remove_all(path, ec);  // (a file, or a directory and what it holds)
  }
};

// The name a run's private directory starts with: kRunDirStem<run id>-<pid place>-<pid>-XXXXXX
// (ownedFilePrefix, makePrivateDirectory).
constexpr const char* kRunDirStem = "dtrain-run-";

// Where a run keeps its trainer's spec snapshot, as a plan shows it: a directory of the
// run's own (made when it starts: runJob), private to the user (the spec's env may carry
// secrets from an env_file), removed when the run ends. In the temp dir (tempDirectory:
// an unusable TMPDIR is refused, naming it); for --dry-run, which writes nothing, where it
// would be, checked or not (buildSpec says what is wrong with it).
std::string trainerSpecPath(const std::string& runId, bool dryRun) {
  std::string dir;
  if (dryRun)
    tempDirectoryProblem(&dir);
  else
    dir = tempDirectory();
  return (std::filesystem::path(dir) / (ownedFilePrefix(kRunDirStem, runId) + "XXXXXX") / "spec.json").string();
}

// A command job's name, for messages ("job 'train.py' failed"): the program, or for an
// interpreter the script (or -m module) it runs, as torchrun names its jobs.
std::string jobNameOf(const std::vector<std::string>& cmd) {
  auto base = [](const std::string& p) { return p.substr(p.rfind('/') + 1); };
  const std::string prog = base(cmd.at(0));
  const bool interpreter = prog.rfind("python", 0) == 0 || prog == "sh" || prog == "bash" || prog == "perl" ||
                           prog == "ruby" || prog == "node" || prog == "Rscript";
  if (!interpreter) return prog;
  for (size_t i = 1; i < cmd.size(); ++i) {
    if ((cmd[i] == "-m" || cmd[i] == "-c") && i + 1 < cmd.size()) return cmd[i] == "-m" ? cmd[i + 1] : prog;
    if (!cmd[i].empty() && cmd[i][0] != '-') return base(cmd[i]);
  }
  return prog;
}

}  // namespace

// How to run `words` (a program, as the user gave it) with dtrain: the words after --, with
// the python3 a Python script needs (dtrain adds no interpreter, unlike torchrun) or the ./
// a script in this directory needs (it is not on PATH). For the fixes of `dtrain run x.py`
// and `dtrain run ./env.sh`.
std::vector<std::string> commandFix(std::vector<std::string> words) {
  if (words.empty()) return words;
  const std::string& first = words.front();
  std::error_code ec;
  if (std::filesystem::path(first).extension() == ".py")
    words.insert(words.begin(), "python3");
  else if (first.find('/') == std::string::npos && std::filesystem::is_regular_file(first, ec))
    words.front() = "./" + first;
  return words;
}

namespace {

// Where python's script is in `cmd` (python3 [options] SCRIPT args...), or 0 when it runs
// none that is a file: -c code, -m module, - (stdin), or an option this does not know.
size_t pythonScriptIndex(const std::vector<std::string>& cmd) {
  // (python, python3, python3.11, python3-dbg, python3.11d: not python_wrapper.sh, nor
  // python3-coverage, whose first word is no script)
  const std::string prog = std::filesystem::path(cmd.at(0)).filename().string();
  if (prog.rfind("python", 0) != 0) return 0;
  std::string rest = prog.substr(6);
  for (const char* suffix : {"-dbg", "dm", "d", "m"})
    if (rest.size() >= std::strlen(suffix) && rest.compare(rest.size() - std::strlen(suffix), std::string::npos, suffix) == 0) {
      rest.resize(rest.size() - std::strlen(suffix));
      break;
    }
  if (rest.find_first_not_of("0123456789.") != std::string::npos) return 0;
  for (size_t i = 1; i < cmd.size(); ++i) {
    const std::string& w = cmd[i];
    if (w == "--") return i + 1 < cmd.size() ? i + 1 : 0;
    if (w.empty() || w == "-") return 0;
    if (w[0] != '-') return i;
    if (w.rfind("--", 0) == 0) {  // (--version, --help: python runs nothing; others unknown)
      return 0;
    }
    // A cluster of one-letter options (-u, -OO, -uW ignore): -c and -m end the options with
    // what python runs instead of a script; -W and -X take the next word when it is theirs.
    for (size_t k = 1; k < w.size(); ++k) {
      const char o = w[k];
      if (o == 'c' || o == 'm') return 0;
      if (o == 'W' || o == 'X') {
        if (k + 1 == w.size()) ++i;
        break;
      }
      if (!std::isalpha(static_cast<unsigned char>(o))) return 0;
    }
  }
  return 0;
}

// A local job's program must be one exec can run: said here, once, with the fix (exit 2),
// rather than by every worker as exit 127 (and a restart budget spent on it). torchrun's
// habit of naming the script alone gets the python3 it needs.
void checkProgram(const spec::JobSpec& s, bool fromSpec) {
  const std::string& prog = s.command.at(0);
  const std::string where = fromSpec ? fmt::format("{}: /command/0", s.source) : std::string("the command after --");
  if (const std::string found = launch::findWorkerProgram(prog, s.env, s.cwd); !found.empty()) {
    // A script whose #! interpreter is missing: exec's ENOENT names the script, as if it
    // were the missing file.
    if (const std::string why = launch::workerShebangProblem(found, s.env, s.cwd); !why.empty())
      throw SpecError(fmt::format("{}: cannot run \"{}\": {}", where, prog, why));
    // python's script missing: every worker would exit 2 ("can't open file"), which reads as
    // dtrain's own bad-input code, after a restart budget spent on it. Said here, once.
    if (const size_t i = pythonScriptIndex(s.command); i > 0) {
      const std::filesystem::path dir = s.cwd.empty() ? std::filesystem::current_path() : std::filesystem::path(s.cwd);
      const std::filesystem::path script = dir / s.command[i];
      struct stat st {};
      if (::stat(script.c_str(), &st) != 0 && errno == ENOENT) {
        const std::string at = fromSpec ? fmt::format("{}: /command/{}", s.source, i) : where;
        throw SpecError(fmt::format("{}: {}'s script \"{}\" does not exist{}; check the path", at,
                                    std::filesystem::path(prog).filename().string(), s.command[i],
                                    s.command[i][0] == '/' ? std::string()
                                                           : fmt::format(" (relative to {})", dir.string())));
      }
    }
    return;
  }
  const std::filesystem::path dir = s.cwd.empty() ? std::filesystem::current_path() : std::filesystem::path(s.cwd);
  const std::filesystem::path file = dir / prog;
  std::error_code ec;
  const bool isFile = std::filesystem::is_regular_file(file, ec);
  const bool isDir = std::filesystem::is_directory(file, ec);
  const std::string ext = file.extension().string();
  const bool executable = isFile && ::access(file.c_str(), X_OK) == 0;
  std::string fix;
  if (isFile && ext == ".py")
    fix = fmt::format(
        "it is a Python script in {}, and dtrain runs the command as given (it adds no python, unlike "
        "torchrun): run python3 {}",
        dir.string(), prog);
  else if (executable)
    fix = fmt::format("it is not on PATH; to run the one in {}, give ./{}", dir.string(), prog);
  else if (isFile)
    fix = fmt::format("{} is not executable: chmod +x it, or run it with its interpreter (e.g. bash {})", file.string(),
                      prog);
  else if (isDir && prog.find('/') != std::string::npos)
    fix = prog[0] == '/'
              ? std::string("it is a directory, not a program; give the program's path")
              : fmt::format("it is a directory (relative to {}), not a program; give the program's path", dir.string());
  else if (prog.find('/') != std::string::npos)
    fix = prog[0] == '/' ? std::string("no such file; check the path")
                         : fmt::format("no such file (relative to {}); check the path", dir.string());
  else
    fix = fmt::format("no such program on PATH{}; check the name, or give its path",
                      launch::missingProgramHint(prog, s.env, s.cwd));
  throw SpecError(fmt::format("{}: cannot run \"{}\": {}", where, prog, fix));
}

// `dtrain run`'s stop signals, held from main()'s start until the run's outcome is decided
// (enterRunEnd; null for other commands): a SIGINT, SIGTERM or SIGHUP before any worker starts
// ends the run at the next step with its own summary (stopIfSignalled), not by the signal's
// default action, which left an earlier run's summary in place; a step that never ends is cut
// short by a second one (HeldStopSignals, until endPreflight() before the launch).
launch::HeldStopSignals* gHeldSignals = nullptr;

// A stop signal that came before the launch: the run ends with it (exit 128 + the signal).
struct StoppedBeforeLaunch {
  int sig;
};

// Ends the run, before anything starts, when a stop signal has come (between pre-flight steps:
// reading the spec and its data can take a while).
void stopIfSignalled() {
  if (!gHeldSignals) return;
  if (const int sig = gHeldSignals->stopSignal()) throw StoppedBeforeLaunch{sig};
}

// Whether a local job's workers will train on GPUs (resolveDevice's rule for rank 0, which
// every worker of the node shares): their model and activations are then device memory.
// nullopt when the device cannot be resolved ("cuda" without a usable GPU, GPUs shared): that
// error is the job's, said by its own check, not as a memory estimate on the wrong device.
std::optional<bool> workersUseGpus(const spec::TrainerSpec& t, int workers) {
  try {
    return train::resolveDevice(t.device, 0, workers).cuda;
  } catch (const SpecError&) {
    return std::nullopt;
  }
}

// The spec of `dtrain run` or `validate`, resolved and checked; `memoryLine`, when given,
// gets a trainer job's estimated memory (validate prints it).
// `jobName`, when given, gets the job's name as soon as the spec is read, for the summary of
// a run refused after that (a program that cannot run, a data file).
// `dataImage`, when given (run, not --dry-run), gets a local trainer job's data image for its
// workers (train::openSharedDatasets), when it makes one.
spec::JobSpec buildSpec(RunArgs& a, const std::string& runId, std::string* memoryLine = nullptr,
                        std::string* jobName = nullptr, train::DataImage* dataImage = nullptr) {
  spec::JobSpec s;
  if (!a.spec_path.empty() && !a.command.empty()) {
    // The word taken for the spec is most often a stray one: a second variable after --env's
    // one (`--env A=1 B=2 -- cmd`), or an option's value without its option.
    const std::string& w = a.spec_path;
    std::error_code ec;
    if (w.find('=') != std::string::npos && w.find('/') == std::string::npos && !std::filesystem::exists(w, ec))
      throw SpecError(fmt::format("\"{}\" before -- was taken for a job spec; --env takes one KEY=VALUE, so give it "
                                  "once per variable: --env {}",
                                  w, shellQuote(w)));
    if (!std::filesystem::exists(w, ec) || std::filesystem::is_directory(w, ec))  // (a spec may be <(...): /dev/fd/63)
      throw SpecError(fmt::format("unexpected word \"{}\" before --: it is no job spec, and a command goes after --; "
                                  "remove it (or give either a job spec or a command, not both)",
                                  w));
    throw SpecError(fmt::format("give either a job spec file ({}) or a command after --, not both", w));
  }
  if (!a.spec_path.empty()) {
    try {
      spec::SpecLoadOptions lo;
      lo.read_hostfile = a.hosts.empty() && a.hostfile.empty();  // (theirs replace the spec's)
      s = spec::loadJobSpec(a.spec_path, lo);
    } catch (const SpecError& e) {
      if (const auto* named = dynamic_cast<const spec::NamedSpecError*>(&e); named && jobName) *jobName = named->job();
      // torchrun's habit, `dtrain run train.py`: say how to run a command.
      const std::string ext = std::filesystem::path(a.spec_path).extension().string();
      if (ext == ".json" || std::string(e.what()).find("invalid JSON") == std::string::npos) throw;
      std::vector<std::string> fixed;
      for (const std::string& w : commandFix({a.spec_path})) fixed.push_back(shellQuote(w));
      throw SpecError(
          fmt::format("{}; job specs are JSON files: to run a program, put its command after --, e.g. "
                      "dtrain run --nproc-per-node 2 -- {}",
                      e.what(), fmt::join(fixed, " ")));
    }
  } else if (!a.command.empty()) {
    s.command = a.command;
    s.name = jobNameOf(a.command);
  } else {
    // `dtrain run --nproc-per-node job.json`: the flag took the spec for its value.
    for (const auto& [flag, value] : {std::pair<const char*, const std::string*>{"--nproc-per-node", &a.nproc},
                                      {"--nnodes", &a.nnodes},
                                      {"--max-restarts", &a.max_restarts},
                                      {"--hostfile", &a.hostfile}})
      if (value->size() > 5 && value->compare(value->size() - 5, 5, ".json") == 0)
        throw SpecError(
            fmt::format("nothing to {0}: {1} took \"{2}\" for its value; give {1} a value, e.g. "
                        "dtrain {0} {1} 2 {2}",
                        a.verb, flag, *value));
    throw SpecError(
        fmt::format("nothing to {0}; give a job spec (dtrain {0} job.json) or a command (dtrain {0} -- "
                    "python3 train.py)",
                    a.verb));
  }
  if (jobName) *jobName = s.name;
  // dtrain's own switches, read here, by agents or by workers: a bad value is said now, once,
  // not by every worker after the launch.
  for (const char* v : {"DTRAIN_COMM_SHM", "DTRAIN_COMM_CHECK", "DTRAIN_DATA_SHARE", "DTRAIN_MEMORY_CHECK"})
    (void)envSwitch(v);
  if (!a.nproc.empty()) a.overrides.nproc_per_node = a.nproc;
  if (!a.hostfile.empty()) a.overrides.hostfile = a.hostfile;
  if (!a.hosts.empty()) a.overrides.hosts = a.hosts;
  if (!a.nnodes.empty()) a.overrides.nnodes = a.nnodes;
  if (!a.max_restarts.empty())
    a.overrides.max_restarts = parseIntFlag("--max-restarts", a.max_restarts, 0, spec::kMaxRestarts);
  if (!a.shutdown.empty()) a.overrides.shutdown_timeout_s = parseDoubleFlag("--shutdown-timeout", a.shutdown);
  spec::applyOverrides(s, a.overrides);
  s.ssh.options.insert(s.ssh.options.end(), a.ssh_options.begin(), a.ssh_options.end());
  spec::resolve(s, a.overrides);
  // The temp dir takes a local job's workers' error files, and a trainer job's spec snapshot
  // and result: an unusable TMPDIR is refused by run before the data is read; validate and
  // --dry-run, which write no temp file (validate may run on another machine), say it.
  if (s.nodes.empty() || s.trainer) {
    if (!runId.empty() && !a.dry_run)
      tempDirectory();
    else if (const std::string problem = tempDirectoryProblem(); !problem.empty())
      std::cerr << "dtrain: warning: " << problem << " (run refuses it: the job's temporary files go there)\n";
  }
  if (!s.trainer && s.nodes.empty()) checkProgram(s, a.command.empty());
  // A pipeline needs whole pipelines: a world size known here that is not a multiple of the
  // stages is said once, not by every worker after the launch.
  // (Not by validate for an "auto" worker count: this machine's count says nothing of the
  // job's, and validate may run elsewhere; run and --dry-run check it.)
  if (!(runId.empty() && s.nproc_auto && s.nodes.empty())) spec::checkPipelineWorld(s, a.overrides);
  for (const auto& [about, line] : s.warnings) std::cerr << "dtrain: warning: " << line << "\n";
  // A trainer job runs the built-in trainer as every worker's command, on a snapshot of the
  // resolved spec (cmdRun writes it): absolute paths whatever `cwd` says, the overrides
  // included, and unchanged by edits to the spec file while the job runs.
  // (validate, with no run: the spec file itself, which is what `dtrain train` takes by hand)
  if (s.trainer)
    s.command = {launch::selfExecutable(), "train",
                 runId.empty() ? std::filesystem::absolute(a.spec_path).string() : trainerSpecPath(runId, a.dry_run)};
  // A trainer's data files are read once here, so that bad data is a clear error (exit 2)
  // before any worker starts.
  if (s.trainer) {
    // (before the data sets below: this process's copy of them is gone before any worker
    // starts, and must not count against the workers' memory)
    const MemoryAvailability availability = memoryAvailability();
    const uint64_t available = availability.bytes;
    // (the held-out set checked too; a stop signal ends a long parse at once)
    // A local job's workers map this parse (the data image) rather than each parsing the
    // files again; validate and --dry-run estimate what run would do.
    // (the switch is read for a multi-node job too: a bad value is said here, and the
    // launcher passes it on to every node's agent, whose environment is not this one)
    const bool shareSwitch = train::dataShareEnabled();
    const bool share = s.nodes.empty() && shareSwitch;
    // A pipe (mkfifo, a process substitution) is read once, here: only the data image can
    // carry it to the workers, who would otherwise each wait for data that never comes.
    // (validate and --dry-run read it once and start nothing)
    const auto [pipePointer, pipePath] = train::onceReadableDataFile(*s.trainer);
    const bool pipeMatters = !pipePointer.empty() && !runId.empty() && !a.dry_run;
    auto refusePipe = [&](const std::string& why) {
      throw SpecError(fmt::format("{}: {}: \"{}\" is not a regular file (a pipe?) and can be read only once, and {}; "
                                  "give a regular file",
                                  s.source, pipePointer, pipePath, why));
    };
    // (before reading it: a pipe no one writes yet would hold the refusal until someone did)
    if (pipeMatters && !s.nodes.empty()) refusePipe("the hosts of a multi-node job each read the data files");
    if (pipeMatters && !shareSwitch) refusePipe("with DTRAIN_DATA_SHARE=0 every worker reads the data files itself");
    train::SharedDatasets parsed = train::openSharedDatasets(*s.trainer, stopIfSignalled, share && dataImage);
    const std::unique_ptr<train::Dataset>&trainSet = parsed.sets.train, &evalSet = parsed.sets.eval;
    if (dataImage) *dataImage = std::move(parsed.image);
    if (pipeMatters && dataImage && !dataImage->fd)
      refusePipe(fmt::format("the launcher could not share its parse with the workers ({})", dataImage->problem));
    if (dataImage && !dataImage->problem.empty())
      std::cerr << "dtrain: warning: each worker parses the data files itself: the launcher could not share its "
                   "parse ("
                << dataImage->problem << ")\n";
    // One global batch must fit in the training set: said here, not by every worker after
    // the launch. Local jobs only (a multi-node world is settled by the rendezvous).
    const auto& t = *s.trainer;
    if (s.nodes.empty()) {
      const uint64_t world = static_cast<uint64_t>(s.nproc_per_node);  // (resolved: "auto" is a count now)
      const uint64_t stages = static_cast<uint64_t>(std::max(1, t.parallel.pipeline_stages));
      const uint64_t global = static_cast<uint64_t>(t.batch_size) * (world / stages);
      // A job this host cannot hold is said here, with the numbers and the field to change,
      // rather than as a worker's allocation failure (memory_estimate.h: what the trainers
      // allocate, against the memory available now).
      train::MemoryLayout layout;
      layout.world = layout.workers = static_cast<int>(world);
      const std::optional<bool> gpu = workersUseGpus(t, layout.workers);
      layout.gpu = gpu.value_or(false);
      if (t.data.type != "synthetic") layout.data_rows = trainSet->size() + evalSet->size();
      layout.data_shared = t.data.type != "synthetic" && share && (!dataImage || dataImage->fd);
      layout.eval_rows = static_cast<long long>(evalSet->size());
      layout.checkpoint_to_read = !t.checkpoint.dir.empty() && train::holdsCheckpointFiles(t.checkpoint.dir);
      // (no device: that error is the job's, said by its own check)
      const bool enforce = gpu.has_value() && train::memoryCheckEnforced();
      train::MemoryEstimate need;
      bool fits = true;
      try {
        need = train::checkHostMemory(t, layout, enforce ? availability : MemoryAvailability{}, s.source);
        fits = !available || need.host <= available;
        if (!fits && gpu.has_value())  // (DTRAIN_MEMORY_CHECK=0)
          std::cerr << fmt::format(
              "dtrain: warning: {}: this job needs about {} of memory on this host, more than "
              "the {} {}; not refused (DTRAIN_MEMORY_CHECK=0)\n",
              s.source, formatBytes(need.host), formatBytes(available), availability.describe());
      } catch (const SpecError& e) {
        // validate may run on another machine than the job's (a login node): the job's host
        // may have the memory. Said, with the numbers; run and --dry-run refuse it here.
        if (!runId.empty()) throw;
        need = train::estimateMemory(t, layout);
        fits = false;
        std::cerr << "dtrain: warning: " << e.what() << " (run refuses it on a host like this one)\n";
      }
      if (memoryLine)
        *memoryLine =
            fmt::format("about {} on this host ({} worker{}){}{}", formatBytes(need.host), world, world == 1 ? "" : "s",
                        available ? fmt::format(", {} available", formatBytes(available)) : "",
                        fits ? "" : ": more than this host has");
      if (world % stages == 0 && trainSet->size() < global)
        throw SpecError(
            fmt::format("{}: /trainer/batch_size: the training set ({} samples) is smaller than one global "
                        "batch ({} = batch_size {} x {} data-parallel workers); use more samples, a smaller "
                        "batch or fewer workers",
                        s.source, trainSet->size(), global, t.batch_size, world / stages));
    }
  }
  return s;
}

// The end of a run, from when its outcome is decided (the launch returned or threw, or the
// run ended before any worker started: an error, a stop, a refused command line) until dtrain
// exits. The contract:
// - a stop signal from then on (a late second Ctrl-C; timeout(1)'s SIGTERM, which reaches
//   dtrain's whole process group) changes nothing of the outcome: not the exit code, not the
//   verdict, not the summary. It is said on stderr (once), never lost and never the signal's
//   default action.
// - it cuts short what may block for good: the wait for a stalled console (the rest of the
//   output is left unwritten; a console that still takes output gets 0.2 s to finish) and a
//   --summary-json written in place (a FIFO no one reads, a stalled /dev/stdout): dtrain then
//   exits at once with the exit code decided.
// - a summary file (a regular file) is written whole, signals held, before those waits.
// How: the stop signals are blocked from the start of the end (enterRunEnd) on, so none is
// lost or takes its default action, and taken with sigtimedwait where the end waits
// (lateStopCame). An in-place write cannot be polled for them: around it they are unblocked
// with a handler that _exits with the decided code (async-signal-safe; the orphan guard removes
// the run's private directory, the kernel releases the locks).
volatile sig_atomic_t gEndExitCode = 0;
bool gInRunEnd = false;
int gLateStop = 0;  // the first stop signal that came in the end, 0 for none
std::optional<std::chrono::steady_clock::time_point> gLateStopAt;

constexpr int kStopSignals[] = {SIGINT, SIGTERM, SIGHUP, SIGQUIT};

sigset_t stopSignals() {
  sigset_t set;
  sigemptyset(&set);
  for (int sig : kStopSignals) sigaddset(&set, sig);
  return set;
}

// Says a late stop signal, once: it changes nothing. `launched`: false for one that came
// while a pre-flight step ran that then failed (the failure ended the run first).
void sayLateStop(int sig, bool launched = true) {
  if (gLateStop) return;
  gLateStop = sig;
  gLateStopAt = std::chrono::steady_clock::now();
  launch::console().write(
      STDERR_FILENO,
      launched ? fmt::format("dtrain: {} after the job had ended; the outcome stands\n", signalName(sig))
               : fmt::format("dtrain: {} while the job was being checked, and the check failed first; the outcome "
                             "stands\n",
                             signalName(sig)));
}

// A second Ctrl-C during the run killed the workers "now" (RunResult::killed_now): a console
// that does not take dtrain's last lines holds dtrain no longer than after a stop signal in
// the end (flushConsole), unsaid (the run said it). Only that wait: a summary written in
// place is still written.
std::optional<std::chrono::steady_clock::time_point> gKilledNowAt;
void stopAskedTwice() { gKilledNowAt = std::chrono::steady_clock::now(); }

}  // namespace

// The outcome is decided: exit code `code` (entered again, the code is updated: a summary that
// could not be written makes a success exit 1). Only for `dtrain run`.
void enterRunEnd(int code) {
  gEndExitCode = code;
  if (gInRunEnd) return;
  gInRunEnd = true;
  const sigset_t stops = stopSignals();
  ::sigprocmask(SIG_BLOCK, &stops, nullptr);
  // (blocked first: what the held handlers took since the launch ended, or while a failing
  // pre-flight step ended, is said; one that comes from now on stays pending)
  if (gHeldSignals) {
    const bool launched = gHeldSignals->launched();
    gHeldSignals->takeUnasked([launched](int sig) { sayLateStop(sig, launched); });
    gHeldSignals->release();
  }
}

namespace {

// Whether a stop signal has come in the end of the run (taking those pending). Outside it (the
// other commands: an agent, a trainer), whether one is pending, held blocked.
bool lateStopCame() {
  const sigset_t stops = stopSignals();
  if (!gInRunEnd) {
    sigset_t pending;
    sigemptyset(&pending);
    ::sigpending(&pending);
    return std::any_of(std::begin(kStopSignals), std::end(kStopSignals),
                       [&](int sig) { return sigismember(&pending, sig) == 1; });
  }
  const timespec now{0, 0};
  int sig;
  while ((sig = ::sigtimedwait(&stops, nullptr, &now)) > 0) sayLateStop(sig);
  return gLateStop != 0;
}

}  // namespace

// Waits until dtrain's console has written out what it holds (the end of a run's output, a
// verdict), however long a stalled reader takes: dtrain's last lines, written as any program
// writes them, after the workers are gone. True when done; false when a stop signal
// (SIGINT, SIGTERM, SIGHUP: timeout(1), a second Ctrl-C) cut the wait short (see the end of
// a run above): then dtrain gives the rest up and ends, with the job's exit code.
bool flushConsole() {
  return launch::console().flush([] {
    if (gKilledNowAt && std::chrono::steady_clock::now() - *gKilledNowAt >= std::chrono::milliseconds(200))
      return true;
    if (!lateStopCame()) return false;
    if (!gInRunEnd) return true;
    return std::chrono::steady_clock::now() - *gLateStopAt >= std::chrono::milliseconds(200);
  });
}

namespace {

void exitWithDecidedCode(int) { ::_exit(gEndExitCode); }

// Writes a --summary-json's `text`. A regular file is replaced whole, signals held. A pipe,
// a FIFO or an inherited descriptor is written in place, where the write may block for good:
// there a stop signal before or during it ends dtrain with the decided exit code (the end of a
// run, above). False when one came before. Throws writeOutputFile's IoError.
bool writeSummaryText(const std::string& path, const std::string& text) {
  // (a summary is written in place only once the outcome is decided)
  if (!gInRunEnd || !(isSpecialOutput(path) || inheritedOutputFd(path) >= 0)) {
    writeOutputFile(path, text);
    return true;
  }
  if (lateStopCame()) return false;
  struct sigaction ends {
  }, old[std::size(kStopSignals)];
  ends.sa_handler = exitWithDecidedCode;
  sigemptyset(&ends.sa_mask);
  const int* sigs = kStopSignals;
  for (size_t i = 0; i < std::size(kStopSignals); ++i) {
    ::sigaction(sigs[i], nullptr, &old[i]);
    if (old[i].sa_handler != SIG_IGN) ::sigaction(sigs[i], &ends, nullptr);  // (nohup's SIGHUP stays ignored)
  }
  const sigset_t stops = stopSignals();
  ::sigprocmask(SIG_UNBLOCK, &stops, nullptr);
  struct Reblock {
    const sigset_t& stops;
    const struct sigaction* old;
    const int* sigs;
    ~Reblock() {
      ::sigprocmask(SIG_BLOCK, &stops, nullptr);
      for (size_t i = 0; i < std::size(kStopSignals); ++i) ::sigaction(sigs[i], &old[i], nullptr);
    }
  } reblock{stops, old, sigs};
  writeOutputFile(path, text);
  return true;
}

// Writes the --summary-json of a run; false (said on stderr) when it cannot. A summary in
// place that a stop signal cut short (the end of a run, above) is not a failure: true.
bool writeSummary(const RunArgs& a, const spec::RunSummary& sum) {
  try {
    writeSummaryText(a.summary_json, spec::toJson(sum));
    return true;
  } catch (const std::exception& e) {
    // (after a run, behind what its console still holds)
    launch::console().write(STDERR_FILENO, fmt::format("dtrain: error: --summary-json: {}\n", oneLine(e.what())));
    return false;
  }
}

// `summaryRefused`: set when the --summary-json path itself was refused (nothing is written
// there then).
int runJob(RunArgs& a, const std::string& runId, std::chrono::steady_clock::time_point started, std::string& jobName,
           bool& summaryRefused) {
  // An earlier run's summary must not outlive this run's start: if dtrain is stopped or
  // SIGKILLed (or the machine lost) before the outcome is written, a script would read that
  // run's outcome as this one's. So the path is checked, and a regular file says "running",
  // first, before the spec and its data are read; the outcome replaces it (a pipe or
  // /dev/stdout, written in place, gets the outcome only).
  const bool summaryInPlace =
      !a.summary_json.empty() && (isSpecialOutput(a.summary_json) || inheritedOutputFd(a.summary_json) >= 0);
  auto writeRunning = [&](const std::string& job) {
    if (a.summary_json.empty() || summaryInPlace || a.dry_run) return;
    spec::RunSummary sum;
    sum.job = job;
    sum.run_id = runId;
    sum.running = true;
    writeSummary(a, sum);
  };
  if (!a.summary_json.empty() && !a.dry_run) {
    try {
      app::checkOutputFile(a.summary_json, "--summary-json", kSummaryOutput);
    } catch (const SpecError&) {
      summaryRefused = true;
      throw;
    }
    writeRunning("");
  }
  stopIfSignalled();
  train::DataImage dataImage;  // (held until the job ends: every attempt's workers map it)
  spec::JobSpec s = buildSpec(a, runId, nullptr, &jobName, a.dry_run ? nullptr : &dataImage);
  stopIfSignalled();
  bool multiNode = !s.nodes.empty();
  checkOutputs(s, a);
  writeRunning(s.name);  // (now with the job's name)
  // Asking for GPUs on a machine without them is bad input, said before anything starts, and
  // by --dry-run, whose plan would otherwise show the CPU (multi-node: each node checks its
  // own). (validate does not: a spec is often checked on a machine other than the job's.)
  if (s.trainer && s.trainer->device == "cuda" && s.nodes.empty()) {
#ifndef DTRAIN_HAVE_CUDA
    throw SpecError(
        fmt::format("{}: /trainer/device: \"cuda\" but this dtrain is a CPU build; use \"auto\" or \"cpu\", "
                    "or a CUDA build",
                    s.source));
#else
    if (spec::visibleGpuCount() == 0)
      throw SpecError(
          fmt::format("{}: /trainer/device: \"cuda\" but no GPU is visible here (check the driver and "
                      "CUDA_VISIBLE_DEVICES); use \"auto\" or \"cpu\"",
                      s.source));
#endif
  }
  if (a.dry_run) {
    // A preview: the real run picks its own run id and free master port when it starts.
    launch::Plan plan = multiNode ? launch::makeNodesPlan(s, runId) : launch::makeLocalPlan(s, runId);
    plan.master_port = 0;
    plan.run_id = "id chosen at start";
    printResult(launch::formatPlan(plan, s), "the plan");
    if (!a.summary_json.empty())
      std::cerr << fmt::format("dtrain: warning: --summary-json {}: not written by --dry-run (nothing runs)\n",
                               a.summary_json);
    return kExitOk;
  }
  RemoveOnExit ownLogDir;  // (before logLock: removed, when unused, after the lock is let go)
  ownLogDir.only_holding = ".dtrain-logs.lock";
  Fd logLock;  // held until the job ends: the rank logs and metrics in log_dir are this run's
  if (!s.log_dir.empty()) {
    std::error_code ec;
    std::filesystem::create_directories(s.log_dir, ec);
    if (ec) throw SpecError(fmt::format("{}: cannot create \"{}\": {}", logDirWhere(s, a), s.log_dir, ec.message()));
    // Runs at once on one log_dir (CI jobs of one spec) would append to the same rank_N.log,
    // line by line, and rewrite each other's metrics.svg: the later one writes in a
    // directory of its own run id instead, and says so. (Runs one after another keep
    // appending to the same files, each after its header line.)
    DirectoryLock lock = tryLockDirectory(s.log_dir, ".dtrain-logs.lock");
    if (lock.busy) {
      const std::string own = (std::filesystem::path(s.log_dir) / runId).string();
      std::filesystem::create_directories(own, ec);
      if (ec) throw SpecError(fmt::format("{}: cannot create \"{}\": {}", logDirWhere(s, a), own, ec.message()));
      std::cerr << fmt::format(
          "dtrain: warning: log_dir (--log-dir) \"{}\" is in use by another dtrain run ({}); this "
          "run's logs go to {}\n",
          s.log_dir, lock.holder.empty() ? "its lock is held" : lock.holder, own);
      s.log_dir = own;
      ownLogDir.path = own;
      lock = tryLockDirectory(own, ".dtrain-logs.lock");
    }
    logLock = std::move(lock.fd);  // (a file system without flock: no lock, as before)
  }
  // Checkpoints: created and tried here, with the newest one's config, so that a directory
  // rank 0 cannot write is not found at the first save (or at the end, the whole run lost),
  // and an old config's checkpoint is one line, not a refusal on every restart.
  Fd checkpointLock;  // held until the job ends (restarts included): one job per directory
  if (s.trainer && s.nodes.empty()) checkpointLock = train::prepareCheckpointDir(*s.trainer, s.source);
  stopIfSignalled();
  // The trainer's spec snapshot and the outcome rank 0 leaves for the summary, in a directory
  // of this run's own (makePrivateDirectory): their names in /tmp were the run id's, which any
  // user reads in ps, so another user could plant a link there (the outcome was written
  // through it) or a file of their own (the run failed, or wrote its env's secrets into it).
  // Its name carries this process's pid (ownedFilePrefix), so that the next trainer run of this
  // user removes it when this one died without its cleanup, its guard with it (a cgroup's
  // kill, a pre-flight ended by a second Ctrl-C); meanwhile a guard of its own removes it if
  // dtrain is killed, over the whole run: the launcher's guards live only while workers run,
  // not in a restart's back-off, and a multi-node launch has none on this host.
  std::string resultFile;
  RemoveOnExit runDir;
  std::optional<launch::OrphanGuard> runDirGuard;  // (released before runDir goes: declared after it)
  if (s.trainer) {
    removeStaleOwnedFiles(tempDirectory(), {kRunDirStem});
    runDirGuard.emplace();
    runDir.path = makePrivateDirectory(ownedFilePrefix(kRunDirStem, runId));
    runDirGuard->removeIfKilled(runDir.path);
    if (!multiNode) {  // (each node's agent writes its own from what the launcher sends)
      spec::JobSpec shipped = s;
      shipped.command.clear();
      s.command.back() = (std::filesystem::path(runDir.path) / "spec.json").string();
      writePrivateFile(s.command.back(), spec::serializeForNode(shipped));
    }
    resultFile = (std::filesystem::path(runDir.path) / "result.json").string();
    s.env["DTRAIN_RESULT_FILE"] = resultFile;
  }
  // The last look before the launch; a signal from here on is the launch's (its handling
  // nests in the held signals' and reads what they hold), which stops the workers it started.
  stopIfSignalled();
  if (gHeldSignals) gHeldSignals->endPreflight();
  launch::RunResult r;
  if (multiNode) {
    launch::MultiNodeOptions mo;
    mo.version = app::versionString();
    mo.result_file = resultFile;
    mo.data_share = !s.trainer || train::dataShareEnabled();  // (checked in buildSpec)
    mo.memory_check = train::memoryCheckEnforced();
    s.env.erase("DTRAIN_RESULT_FILE");  // each node's agent picks its own; rank 0's comes back
    r = launch::runMultiNodeJob(s, runId, mo);
  } else {
    launch::LocalJobOptions lo;
    lo.remove_if_killed = {runDir.path};
    if (checkpointLock) lo.refuse_restart = [&] { return train::checkpointLockLost(*s.trainer, checkpointLock); };
    if (dataImage.fd) {
      lo.inherit_fds.emplace_back(train::kDataImageEnv, dataImage.fd.get());
      lo.refresh_fds = [&](int attempt) {
        if (const std::string changed = train::refreshDataImage(*s.trainer, dataImage); !changed.empty())
          launch::console().write(STDERR_FILENO, fmt::format("dtrain: restart {}: {}\n", attempt, changed));
        std::vector<std::pair<std::string, int>> fds;
        if (dataImage.fd) fds.emplace_back(train::kDataImageEnv, dataImage.fd.get());
        return fds;
      };
    }
    r = launch::runLocalJob(s, runId, lo);
  }
  // The job is over, its outcome decided: a signal from now on (a late second Ctrl-C;
  // timeout(1) sends its SIGTERM to its process group as well as to dtrain) changes nothing
  // and cuts short only the waits that may block for good (enterRunEnd).
  enterRunEnd(r.exit_code);
  if (r.killed_now) stopAskedTwice();
  // The verdict first: it is the job's, whatever becomes of the summary file after it.
  std::string verdict;
  if (r.first_failure >= 0 || !r.failure_message.empty()) verdict = launch::formatFailure(r, s);
  if (r.received_signal && r.stopped_during.empty())  // else said in the headline above
    verdict += fmt::format("dtrain: stopped by {}; exit code {}\n", signalName(r.received_signal), r.exit_code);
  if (r.teardown_signal)
    verdict += fmt::format("dtrain: {} during the teardown after the failure: {}; exit code {}, the failure's\n",
                           signalName(r.teardown_signal),
                           r.teardown_signal == SIGINT ? "the workers still running were killed at once"
                                                       : "the teardown went on as it was",
                           r.exit_code);
  // Behind the workers' lines the console may still hold (launch::Console): written out by
  // main() before dtrain exits.
  launch::console().write(STDERR_FILENO, verdict);
  if (!a.summary_json.empty()) {
    spec::RunSummary sum;
    sum.job = s.name;
    sum.run_id = runId;
    sum.exit_code = r.exit_code;
    sum.restarts = r.restarts;
    sum.events = r.events;
    sum.succeeded = r.exit_code == 0;
    sum.wall_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
    if (r.received_signal) sum.stopped_by = signalName(r.received_signal);
    if (!verdict.empty()) {
      sum.error = verdict.substr(0, verdict.find('\n'));
      if (sum.error.rfind("dtrain: ", 0) == 0) sum.error.erase(0, 8);
    }
    for (const auto& w : r.workers)
      sum.ranks.push_back({w.global_rank, w.local_rank, w.host, w.exit_code, w.signal ? signalName(w.signal) : "",
                           w.stopped_by_dtrain, w.lost});
    if (!resultFile.empty()) sum.trainer = spec::readTrainerOutcome(resultFile);
    // A job that succeeded but could not leave its summary is a failure of dtrain's (exit 1);
    // a failed job keeps its own exit code.
    // A pipe or /dev/stdout may be the console's: the summary comes after what it holds.
    // A FIFO nobody reads would block the write for good: a stop signal cuts either wait
    // short, and dtrain ends with the job's exit code (enterRunEnd).
    if (summaryInPlace && !flushConsole()) return r.exit_code;
    if (!writeSummary(a, sum) && r.exit_code == 0) {
      enterRunEnd(kExitFailure);
      return kExitFailure;
    }
  }
  return r.exit_code;
}

}  // namespace

// The --summary-json of a run that ended before any worker started: status failed, the
// exit code and the error (`stoppedBy`: the signal that stopped it, "" for none). Best effort:
// the error is said on stderr anyway.
void writeFailedSummary(const std::string& path, const std::string& job, const std::string& runId, int code,
                        const std::string& what, double wallS, const std::string& stoppedBy) {
  // (not over a file that is no summary: a run refused for its --summary-json path itself, a
  // job spec given as one, says so and leaves it)
  if (path.empty() || !replaceableOutput(path, kSummaryOutput)) return;
  spec::RunSummary sum;
  sum.job = job;
  sum.run_id = runId;
  sum.exit_code = code;
  sum.stopped_by = stoppedBy;
  // One line, as the field promises: a table of lines (pre-flight's, one per host) joined.
  // ("...remote host(s):\n  a (hostfile:1) ...\n  b ..." -> "...remote host(s): a ...; b ...")
  for (const auto& l : split(what, '\n')) {
    const std::string t = trim(l);  // (and ssh's CRLF)
    if (t.empty()) continue;
    if (!sum.error.empty()) sum.error += sum.error.back() == ':' ? " " : "; ";
    sum.error += t;
  }
  sum.wall_s = wallS;
  try {
    writeSummaryText(path, spec::toJson(sum));
  } catch (const std::exception&) {
  }
}

namespace {

// A dtrain run started by a worker of another (a script worker running a job of its own)
// inherited that job's data image and DTRAIN_DATA_FD: neither is this job's. Its workers get
// this job's image, or none (they parse the files), never the outer one by accident.
void dropInheritedDataImage() {
  const char* v = std::getenv(train::kDataImageEnv);
  if (!v) return;
  char* end = nullptr;
  const long fd = std::strtol(v, &end, 10);
  if (end != v && *end == '\0' && fd > STDERR_FILENO && fd < INT_MAX)
    ::fcntl(static_cast<int>(fd), F_SETFD, FD_CLOEXEC);
  ::unsetenv(train::kDataImageEnv);
}

}  // namespace

// `dtrain run`. A run that ends before its workers start (a bad spec, a program that cannot
// run, a port in use) still writes its --summary-json, status failed with the error, so that
// a script never reads an earlier run's file as this one's.
int runCommand(RunArgs& a) {
  dropInheritedDataImage();
  const std::string runId = launch::newRunId();
  const auto started = std::chrono::steady_clock::now();
  std::string jobName;
  bool summaryRefused = false;
  auto early = [&](int code, const std::string& what, const std::string& stoppedBy = "") {
    // (a preview writes no outcome, failed or not: nothing ran; a path refused gets nothing)
    if (a.dry_run || summaryRefused) return;
    writeFailedSummary(a.summary_json, jobName, runId, code, what,
                       std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count(), stoppedBy);
  };
  // Each way out decides the outcome first (enterRunEnd): a stop signal from then on changes
  // nothing, and cuts short only the waits that may block for good.
  try {
    const int rc = runJob(a, runId, started, jobName, summaryRefused);
    enterRunEnd(rc);
    return rc;
  } catch (const StoppedBeforeLaunch& stop) {
    // As a stop during the run ends (exit 128 + the signal, said on stderr), with nothing to
    // tear down.
    const int code = 128 + stop.sig;
    enterRunEnd(code);
    const std::string what = fmt::format("stopped by {} before any worker started", signalName(stop.sig));
    launch::console().write(STDERR_FILENO, fmt::format("dtrain: {}; exit code {}\n", what, code));
    early(code, what, signalName(stop.sig));
    return code;
  } catch (const SpecError& e) {
    enterRunEnd(kExitUsage);
    early(kExitUsage, e.what());
    throw;
  } catch (const std::exception& e) {
    enterRunEnd(kExitFailure);
    early(kExitFailure, e.what());
    throw;
  }
}

void holdRunStopSignals(launch::HeldStopSignals* held) { gHeldSignals = held; }

int validateCommand(RunArgs& a) {
  std::string memory;
  spec::JobSpec s = buildSpec(a, "", &memory);
  checkOutputs(s, a);
  std::string out =
      (a.spec_path.empty() ? std::string("the command after --") : a.spec_path) + ": OK\n" + spec::describe(s);
  if (!memory.empty()) out += "  memory:           " + memory + "\n";
  printResult(out, "the resolved spec");
  return kExitOk;
}

}  // namespace dtrain::app
