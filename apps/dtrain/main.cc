// Thin main: parses the command line and calls into the libraries. Every error that can
// reach here is printed as one "dtrain: error: ..." line and mapped to an exit code
// (docs/errors.md).
#include <fcntl.h>
#include <signal.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <optional>
#include <string>
#include <vector>

#include "agent_cmd.h"
#include "bench_cmd.h"
#include "dtrain/common/errors.h"
#include "dtrain/common/fd_limit.h"
#include "dtrain/common/strings.h"
#include "dtrain/launch/job.h"
#include "dtrain/launch/multi_node.h"
#include "dtrain/launch/output.h"
#include "dtrain/spec/job_spec.h"
#include "run_cmd.h"
#include "store_cmd.h"
#include "train_cmd.h"
#include "version.h"

namespace {

using namespace dtrain;
using app::RunArgs;

// What dtrain does instead of another launcher's option it does not take: "<flag> is a
// torchrun option; <what to do>" (torchrun's, mpirun's, horovodrun's or the DeepSpeed
// launcher's own spelling, or dashed); "" for other words. Options dtrain shares
// (--nproc_per_node, --nnodes, --max_restarts, --log_dir, --hostfile, --hosts) never get here.
std::string foreignFlagHint(const std::string& flag) {
  std::string f =
      flag.substr(flag.find_first_not_of('-') == std::string::npos ? flag.size() : flag.find_first_not_of('-'));
  std::replace(f.begin(), f.end(), '-', '_');
  struct Hint {
    const char* launcher;
    std::vector<std::string> names;
    std::string what;
  };
  static const char* kTorchrun = "a torchrun option";
  static const std::vector<Hint> kMpiHints = {
      {"an mpirun/horovodrun option (the total number of processes)",
       {"np", "n", "num_proc", "nproc"},
       "dtrain counts workers per host: --nproc-per-node N on one host; across hosts each host's slots (--hosts "
       "h1:2,h2:2 or slots=N in a --hostfile), the total being their sum"},
      {"an mpirun/horovodrun option",
       {"H", "host"},
       "give the hosts with their workers as --hosts h1:2,h2:2 (or --hostfile FILE, one host slots=N per line)"},
      {"an mpirun option",
       {"x"},
       "use --env KEY=VALUE, or --env NAME to pass on dtrain's own value of NAME (repeatable)"},
      {"an mpirun option",
       {"hostfile", "machinefile"},
       "dtrain's is --hostfile FILE (host slots=N lines; OpenMPI's "
       "max_slots=N is taken too)"},
      {"an mpirun option", {"output_filename"}, "use --log-dir DIR: each rank's output also goes to DIR/rank_N.log"},
      {"an mpirun option",
       {"tag_output", "timestamp_output"},
       "worker lines are prefixed with [rank N] by default (--no-prefix turns that off); add timestamps in your "
       "script's logging"},
      {"a DeepSpeed launcher option",
       {"num_gpus"},
       "use --nproc-per-node N (workers per host; auto = one per visible "
       "GPU)"},
      {"a DeepSpeed launcher option",
       {"num_nodes"},
       "dtrain runs on every host given (--hosts h1:N,h2:N or --hostfile FILE); --nnodes MIN:MAX is the elastic "
       "range"},
      {"a DeepSpeed launcher option",
       {"include", "exclude"},
       "list only the hosts to use (--hosts, or a hostfile), and a host's GPUs as gpus=0,1 on its hostfile line (one "
       "worker per GPU listed)"},
  };
  static const std::vector<std::pair<std::vector<std::string>, std::string>> kHints = {
      {{"standalone"}, "dtrain needs nothing for it: one node with its own rendezvous store is the default"},
      {{"master_port"}, "dtrain picks a free port itself; to fix the port workers see, use --env MASTER_PORT=N"},
      {{"master_addr"},
       "dtrain sets MASTER_ADDR itself (127.0.0.1 on one node, else node 0's address); to give workers another "
       "address, "
       "use --env MASTER_ADDR=ADDR (or rendezvous.master_addr in a multi-node spec)"},
      {{"node_rank", "rdzv_endpoint", "rdzv_backend", "rdzv_id", "rdzv_conf", "rdzv_timeout"},
       "dtrain starts every node itself from one command: give the hosts with --hosts h1:N,h2:N or --hostfile FILE "
       "(ssh), and no per-node rank or rendezvous endpoint"},
      {{"local_addr"},
       "dtrain starts every node itself from one command (--hosts h1:N,h2:N or --hostfile FILE) and learns how the "
       "nodes reach each other; to choose a node's address, write address=IP on its hostfile line"},
      {{"no_python", "run_path"}, "dtrain adds nothing to the command: put the whole command after --"},
      {{"m", "module"}, "dtrain adds nothing to the command: run a module as -- python3 -m pkg.module"},
      {{"redirects", "tee", "r", "t"},
       "workers' output reaches the console with [rank N] prefixes; --log-dir DIR also writes DIR/rank_N.log, and "
       "--local-ranks-filter picks the ranks shown"},
      {{"monitor_interval"}, "dtrain waits on its workers directly; there is nothing to poll"},
      {{"role", "start_method", "max_restarts_per_node"}, "dtrain has no such setting; see dtrain run --help"},
  };
  for (const auto& [names, hint] : kHints)
    if (std::find(names.begin(), names.end(), f) != names.end())
      return fmt::format("{} is {}; {}", flag, kTorchrun, hint);
  for (const auto& h : kMpiHints)
    if (std::find(h.names.begin(), h.names.end(), f) != h.names.end())
      return fmt::format("{} is {}; {}", flag, h.launcher, h.what);
  return "";
}

// The error that ends dtrain, as one write: a worker's last line must not be cut between
// its parts by the teardown's signal (std::cerr is unbuffered: one write per <<). Through
// the console, behind what a run left in it.
// (one line whatever it quotes: a path or a command word with a newline, an ESC, is shown
// escaped, not as a second line or a terminal control; a `table`, the pre-flight's one line
// per host, keeps its lines, each escaped)
int sayError(const char* what, int code, bool table = false) {
  std::string text;
  if (table) {
    for (const std::string& line : split(what, '\n'))
      text += (text.empty() ? "" : "\n") + elideLongWords(oneLine(line));
  } else {
    text = elideLongWords(oneLine(what));
  }
  launch::console().write(STDERR_FILENO, fmt::format("dtrain: error: {}\n", text));
  return code;
}

// A misspelt command name (`dtrain runn`, `dtrain store frob`, `dtrain --verison`): CLI11
// alone would only say that a subcommand is required. "" when the words name commands.
std::string unknownCommand(CLI::App& app, const std::vector<std::string>& args) {
  CLI::App* cur = &app;
  std::string where = "dtrain";
  for (const std::string& word : args) {
    const auto subs = cur->get_subcommands([](CLI::App*) { return true; });
    if (subs.empty()) return "";
    std::vector<std::string> names, shown;
    for (CLI::App* sub : subs) {
      names.push_back(sub->get_name());
      if (!sub->get_group().empty()) shown.push_back(sub->get_name());
    }
    const std::string list = fmt::format("{}", fmt::join(shown, ", "));
    if (word.rfind('-', 0) == 0) {
      if (cur != &app || word == "-h" || word == "--help" || word == "--version") return "";
      const std::string m = closestMatch(word, {"--help", "--version"});
      return fmt::format("unknown option {}{}; dtrain takes a command first: {}", word,
                         m.empty() ? "" : fmt::format(" (did you mean {}?)", m), list);
    }
    const auto it = std::find(names.begin(), names.end(), word);
    if (it == names.end()) {
      const std::string m = closestMatch(word, names);
      return fmt::format("{}: unknown command \"{}\"{}; the commands are {}", where, word,
                         m.empty() ? "" : fmt::format(" (did you mean \"{}\"?)", m), list);
    }
    cur = subs[static_cast<size_t>(it - names.begin())];
    where += " " + word;
  }
  return "";
}

// Words no command took (`dtrain validate job.json a b`), in the order the user gave them:
// CLI11 2.1's own ExtrasError message joins them in reverse. `hint` replaces the pointer to
// --help when given; `fallback` is CLI11's message, for when no command holds the words.
std::string unexpectedArguments(CLI::App& app, const std::string& hint, const std::string& fallback) {
  std::vector<CLI::App*> todo{&app};
  for (size_t i = 0; i < todo.size(); ++i) {
    CLI::App* cur = todo[i];
    if (cur->remaining_size(false) > 0) {
      std::string path;
      for (CLI::App* p = cur; p->get_parent() != nullptr; p = p->get_parent())
        path = p->get_name() + (path.empty() ? "" : " " + path);
      std::vector<std::string> words;
      for (const std::string& w : cur->remaining(false)) words.push_back(shellQuote(w));
      // A misspelt option (`store get --tmeout 3 k`): named, with the closest of the command's.
      for (const std::string& w : cur->remaining(false)) {
        if (w.size() < 2 || w[0] != '-' || w == "--" || std::isdigit(static_cast<unsigned char>(w[1]))) continue;
        const std::string word = w.substr(0, w.find('='));
        std::vector<std::string> known;  // (long names only: any one-letter flag is "close")
        for (const CLI::Option* o : cur->get_options())
          for (const std::string& n : o->get_lnames()) known.push_back("--" + n);
        // One of the command's own options, left over: it came after "--", which ends them
        // (`store set -- -k v --endpoint X`: "did you mean --endpoint?" named the same flag).
        if (std::find(known.begin(), known.end(), word) != known.end())
          return fmt::format("{}{} comes after \"--\", which ends the options (what follows is taken as "
                             "arguments); put {} before \"--\"",
                             path.empty() ? "" : path + ": ", word, word);
        const std::string m = word.rfind("--", 0) == 0 ? closestMatch(word, known) : std::string();
        return fmt::format("{}unknown option {}{}; see dtrain {}--help", path.empty() ? "" : path + ": ", word,
                           m.empty() ? "" : fmt::format(" (did you mean {}?)", m), path.empty() ? "" : path + " ");
      }
      return fmt::format("{}unexpected argument{} {}{}", path.empty() ? "" : path + ": ", words.size() == 1 ? "" : "s",
                         fmt::join(words, " "),
                         hint.empty() ? fmt::format("; see dtrain {}--help", path.empty() ? "" : path + " ") : hint);
    }
    for (CLI::App* sub : cur->get_subcommands()) todo.push_back(sub);
  }
  return fallback + (hint.empty() ? "; see dtrain --help" : hint);
}

// CLI11's own words for an option given without a value or more than once ("1 required TEXT
// missing", "At Most 1 required but received 2"), said with the option and the fix; "" for
// other messages. `args`: the words the user gave, for the spellings they used.
std::string argumentMismatch(const std::string& what, const std::vector<std::string>& args) {
  const size_t colon = what.find(": ");
  if (colon == std::string::npos || what.rfind("--", 0) != 0) return "";
  const std::string name = what.substr(0, colon), rest = what.substr(colon + 2);
  // The user's spellings of it (--nproc_per_node and --nproc-per-node are one option).
  auto sameOption = [&](const std::string& w) {
    std::string n = w.substr(0, w.find('='));
    std::replace(n.begin(), n.end(), '_', '-');
    return n == name;
  };
  std::vector<std::string> spellings;
  bool emptyValue = false;
  for (const std::string& w : args) {
    if (w == "--") break;
    if (!sameOption(w)) continue;
    const std::string spelt = w.substr(0, w.find('='));
    if (std::find(spellings.begin(), spellings.end(), spelt) == spellings.end()) spellings.push_back(spelt);
    if (w.size() == spelt.size() + 1) emptyValue = true;  // "--opt="
  }
  if (rest.find("required") != std::string::npos && rest.find("missing") != std::string::npos) {
    if (emptyValue)
      return fmt::format("{}: the value is empty (an unset variable?); give a value or leave the option out", name);
    return fmt::format("{}: no value given; give one ({} VALUE or {}=VALUE), or leave the option out", name, name,
                       name);
  }
  if (rest.rfind("At Most ", 0) == 0) {
    const std::string received = rest.substr(rest.rfind(' ') + 1);
    return fmt::format("{}: given {} times{}; it takes one value: give it once", name, received,
                       spellings.size() > 1 ? fmt::format(" (as {}, one option)", fmt::join(spellings, " and ")) : "");
  }
  return "";
}

// The command being parsed, as the user typed it ("store get", "bench allreduce"): the deepest
// subcommand CLI11 has taken.
CLI::App* parsedCommand(CLI::App& app, std::string* path) {
  CLI::App* cur = &app;
  for (bool deeper = true; deeper;) {
    deeper = false;
    for (CLI::App* sub : cur->get_subcommands()) {
      if (!sub->parsed()) continue;
      *path += (path->empty() ? "" : " ") + sub->get_name();
      cur = sub;
      deeper = true;
      break;
    }
  }
  return cur;
}

// CLI11's "Could not convert: --timeout = x", said with the command, what the option takes
// and where its help is; "" when the message is not that.
std::string conversionError(CLI::App& app, const std::string& what) {
  const std::string prefix = "Could not convert: ";
  const size_t eq = what.find(" = ");
  if (what.rfind(prefix, 0) != 0 || eq == std::string::npos) return "";
  const std::string name = what.substr(prefix.size(), eq - prefix.size()), value = what.substr(eq + 3);
  std::string path;
  CLI::App* cmd = parsedCommand(app, &path);
  const CLI::Option* o = cmd->get_option_no_throw(name);
  const std::string type = o ? o->get_type_name() : std::string();
  const std::string takes = type == "INT" || type == "UINT" ? "an integer"
                            : type == "FLOAT"               ? "a number"
                                                            : "another value";
  return fmt::format("{}{}: expected {}, got \"{}\"; see dtrain {}--help", path.empty() ? "" : path + ": ", name, takes,
                     value, path.empty() ? "" : path + " ");
}

// CLI11's "key is required" (a positional) or "--endpoint is required", with the command and
// its help; `hint` (storeParseHint) replaces the pointer to --help when given.
std::string requiredError(CLI::App& app, const std::string& what, const std::string& hint) {
  std::string path;
  CLI::App* cmd = parsedCommand(app, &path);
  const size_t is = what.find(" is required");
  std::string said = what;
  if (what.rfind("A subcommand", 0) == 0) {
    // `dtrain`, `dtrain store`, `dtrain bench` alone: name the commands it takes.
    std::vector<std::string> shown;
    for (CLI::App* sub : cmd->get_subcommands([](CLI::App* s) { return !s->get_group().empty(); }))
      shown.push_back(sub->get_name());
    said = fmt::format("a command is missing; the commands are {}", fmt::join(shown, ", "));
  } else if (is != std::string::npos && what.rfind("--", 0) != 0) {
    std::string name = what.substr(0, is);
    std::transform(name.begin(), name.end(), name.begin(), [](unsigned char c) { return std::toupper(c); });
    said = fmt::format("the {} argument is missing", name);
  }
  return fmt::format("{}{}{}", path.empty() ? "" : path + ": ", said,
                     hint.empty() ? fmt::format("; see dtrain {}--help", path.empty() ? "" : path + " ") : hint);
}

// True when `path` is a job spec: a .json file, or a file that parses as one. For the
// words after it, which are then a command given beside a spec, not a command without --.
bool isSpecFile(const std::string& path) {
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec)) return false;
  if (std::filesystem::path(path).extension() == ".json") return true;
  try {
    spec::loadJobSpec(path);
    return true;
  } catch (const std::exception&) {
    return false;
  }
}

}  // namespace

namespace {

int dtrainMain(int argc, char** argv) {
  // SIGUSR1/SIGUSR2 (a scheduler's checkpoint request: Slurm's --signal) held until the
  // handlers below are in: their default action would end dtrain run by that signal.
  sigset_t usrSignals, startMask;
  sigemptyset(&usrSignals);
  sigaddset(&usrSignals, SIGUSR1);
  sigaddset(&usrSignals, SIGUSR2);
  ::sigprocmask(SIG_BLOCK, &usrSignals, &startMask);
  // A closed stdin, stdout or stderr (`dtrain run ... >&-`, a daemon's leftovers) is /dev/null
  // from here on: otherwise the next descriptor opened takes its number (the signal pipe, a
  // socket, a log), and what is written to stdout or stderr lands in it, read back as signal
  // numbers or sent to a peer. The workers get /dev/null there too.
  for (int fd = 0; fd <= 2; ++fd)
    if (::fcntl(fd, F_GETFD) == -1 && errno == EBADF) {
      const int null = ::open("/dev/null", O_RDWR);
      if (null >= 0 && null != fd) {
        ::dup2(null, fd);
        ::close(null);
      }
    }
  // (before any thread: a launcher's logs and pipes per rank; restored in what it starts)
  dtrain::raiseFdLimit();
  // For `dtrain run` and `dtrain validate`, everything after the first "--" is the worker's
  // argv, untouched by CLI11 (validate checks an ad hoc command as run --dry-run takes it).
  // Other commands leave "--" to CLI11, where it ends the options so that a positional may
  // start with '-' (dtrain store set -- -key value).
  std::vector<std::string> args(argv + 1, argv + argc);
  std::vector<std::string> command;
  auto verb = std::find_if(args.begin(), args.end(), [](const std::string& w) { return w.empty() || w[0] != '-'; });
  const std::string verbWord = verb != args.end() ? *verb : std::string();
  bool isRun = verb != args.end() && *verb == "run";
  bool takesCommand = isRun || (verb != args.end() && *verb == "validate");
  for (size_t i = 0; takesCommand && i < args.size(); ++i) {
    if (args[i] == "--") {
      command.assign(args.begin() + static_cast<long>(i) + 1, args.end());
      args.resize(i);
      break;
    }
  }

  // A reader that went away (`dtrain validate job.json | head -1`, a closed `--summary-json -`)
  // is a failed write, said as one (exit 1, or a run's exit code kept), not death by SIGPIPE
  // (141) that hides a job's outcome: every result these commands print is checked as it is
  // written. (`dtrain train`, the trainer's worker, keeps the default a launched program
  // expects: its launcher is its reader; the agent ignores it itself.)
  if (verbWord == "run" || verbWord == "validate" || verbWord == "store" || verbWord == "bench") {
    struct sigaction ign {};
    ign.sa_handler = SIG_IGN;
    ::sigaction(SIGPIPE, &ign, nullptr);
  }

  // `dtrain run`'s stop signals are held from here until its outcome is decided (gHeldSignals,
  // enterRunEnd): one that comes before the launch ends the run with its own summary, not by
  // the signal's default action, which left an earlier run's summary in place.
  std::optional<launch::HeldStopSignals> heldSignals;
  if (isRun) app::holdRunStopSignals(&heldSignals.emplace());
  ::sigprocmask(SIG_SETMASK, &startMask, nullptr);  // (a signal held meanwhile comes now)

  // A run refused on its command line still writes its --summary-json (status failed, exit
  // 2, the error), as a run refused for its spec does: a CI script must never read an
  // earlier run's file as this one's. The path is read from the words themselves, because
  // CLI11 may stop before it reaches the option.
  std::string cliSummary;
  for (size_t i = 0; isRun && i < args.size(); ++i) {
    if (args[i] == "--summary-json" && i + 1 < args.size()) cliSummary = args[i + 1];
    if (args[i].rfind("--summary-json=", 0) == 0) cliSummary = args[i].substr(15);
  }
  if (cliSummary == "-") cliSummary = "/dev/stdout";
  auto usageError = [&](const std::string& what) {
    if (isRun) app::enterRunEnd(kExitUsage);
    launch::console().write(STDERR_FILENO, "dtrain: error: " + elideLongWords(oneLine(what)) + "\n");  // (main() writes it out)
    if (isRun && !cliSummary.empty() && cliSummary[0] != '-')
      app::writeFailedSummary(cliSummary, "", "", kExitUsage, what, 0);
    return kExitUsage;
  };

  // Named here: CLI11 takes the name from argv[0] only when given argc/argv, and the usage
  // line would otherwise start with no program name.
  CLI::App app{"dtrain: launcher and job runner for distributed training", "dtrain"};
  app.require_subcommand(1);
  app.set_version_flag("--version", app::versionString());

  RunArgs runArgs;
  runArgs.command = command;
  auto* run = app.add_subcommand("run", "Run a job: dtrain run job.json | dtrain run [flags] -- CMD ARGS...");
  run->add_option("spec", runArgs.spec_path, "Job spec (JSON)");
  run->add_flag("--dry-run", runArgs.dry_run, "Print the plan and run nothing");
  run->add_option("--summary-json", runArgs.summary_json,
                  "Write the outcome as JSON to this file (status, exit code, ranks, trainer); - for stdout")
      // ("-" is stdout, as for most tools: it made a file named "-")
      ->transform([](const std::string& v) { return v == "-" ? std::string("/dev/stdout") : v; });
  app::addOverrideFlags(run, runArgs);

  RunArgs valArgs;
  valArgs.verb = "validate";
  valArgs.command = command;
  auto* validate = app.add_subcommand("validate",
                                      "Check a job spec (or a command after --) and print it resolved: dtrain validate "
                                      "job.json | dtrain validate [flags] -- CMD ARGS...");
  validate->add_option("spec", valArgs.spec_path, "Job spec (JSON)");
  app::addOverrideFlags(validate, valArgs);

  app::addStoreCommands(app);
  app::addBenchCommands(app);
  app::addTrainCommand(app);
  app::addAgentCommand(app);

  if (const std::string bad = unknownCommand(app, args); !bad.empty()) {
    std::cerr << "dtrain: error: " << elideLongWords(oneLine(bad)) << "\n";
    return kExitUsage;
  }
  // mpirun's single-dash long options: CLI11 would read `-hostfile` as -h (help, exit 0).
  for (size_t i = 0; takesCommand && i < args.size(); ++i) {
    const std::string& w = args[i];
    if (w.size() > 2 && w[0] == '-' && w[1] != '-')
      if (const std::string hint = foreignFlagHint(w.substr(0, w.find('='))); !hint.empty())
        return usageError(verbWord + ": " + hint);
  }
  // Words left over after `run`'s spec are most often a command given without "--"
  // (torchrun's habit); said below with the fix instead of CLI11's generic message.
  run->allow_extras();

  std::vector<std::string> reversed(args.rbegin(), args.rend());
  try {
    app.parse(reversed);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::ExtrasError& e) {
    // validate takes no extra words: another launcher's option gets its hint, as under run.
    if (validate->parsed() && validate->remaining_size(false) > 0) {
      const std::string first = validate->remaining(false).front();
      if (first.size() > 1 && first[0] == '-')
        if (const std::string hint = foreignFlagHint(first.substr(0, first.find('='))); !hint.empty())
          return usageError("validate: " + hint);
    }
    return usageError(unexpectedArguments(app, app::storeParseHint(args), e.what()));
  } catch (const CLI::ArgumentMismatch& e) {
    if (const std::string said = argumentMismatch(e.what(), args); !said.empty()) return usageError(said);
    std::string hint = app::storeParseHint(args);
    return usageError(std::string(e.what()) + (hint.empty() ? "; see dtrain --help" : hint));
  } catch (const CLI::ConversionError& e) {
    if (const std::string said = conversionError(app, e.what()); !said.empty()) return usageError(said);
    return usageError(std::string(e.what()) + "; see dtrain --help");
  } catch (const CLI::RequiredError& e) {
    std::string hint = app::storeParseHint(args);
    return usageError(requiredError(app, e.what(), hint));
  } catch (const CLI::ParseError& e) {
    std::string hint = app::storeParseHint(args);
    return usageError(std::string(e.what()) + (hint.empty() ? "; see dtrain --help" : hint));
  }
  // A path or list option given as "" (an unset shell variable) must not quietly mean "not
  // given": `--summary-json "$OUT"` would then write no summary and say nothing.
  for (CLI::App* cmd : {run, validate}) {
    if (!cmd->parsed()) continue;
    for (const char* name : {"--summary-json", "--log-dir", "--hostfile", "--hosts", "--nnodes", "--nproc-per-node",
                             "--max-restarts", "--shutdown-timeout", "--local-ranks-filter"}) {
      const CLI::Option* o = cmd->get_option_no_throw(name);
      if (!o || o->count() == 0) continue;
      const auto& given = o->results();
      if (std::any_of(given.begin(), given.end(), [](const std::string& v) { return v.empty(); })) {
        return usageError(
            fmt::format("{}: the value is empty (an unset variable?); give a value or leave the option out", name));
      }
    }
  }
  if (run->parsed() && !run->remaining().empty()) {
    const std::vector<std::string> extra = run->remaining();
    // An unknown option left first: an option's value was taken for the spec
    // (`--master_port 29501` -> spec "29501"), so this is not about a command. Dashed words
    // after a command word (`python3 train.py --epochs 3`) are that command's.
    auto opt = extra.begin();
    // (the word CLI11 took for the spec may be a program given before the option:
    // `dtrain run train.py --lr 0.1`, whose --lr is the program's; one after it is the
    // option's value)
    const auto specAt = std::find(args.begin(), args.end(), runArgs.spec_path);
    const bool commandFirst = !runArgs.spec_path.empty() && specAt < std::find(args.begin(), args.end(), *opt) &&
                              std::filesystem::path(runArgs.spec_path).extension() != ".json" &&
                              !isSpecFile(runArgs.spec_path);
    if (opt->size() > 1 && (*opt)[0] == '-' && !commandFirst) {
      const std::string word = opt->substr(0, opt->find('='));
      if (const std::string hint = foreignFlagHint(word); !hint.empty()) return usageError("run: " + hint);
      std::vector<std::string> known;
      for (const CLI::Option* o : run->get_options())
        for (const std::string& n : o->get_lnames()) known.push_back("--" + n);
      const std::string m = closestMatch(word, known);
      return usageError(fmt::format("run: unknown option {}{}; see dtrain run --help", word,
                                    m.empty() ? "" : fmt::format(" (did you mean {}?)", m)));
    }
    std::vector<std::string> words;
    for (const auto& w : extra) words.push_back(shellQuote(w));
    // A spec first (`dtrain run job.json python3 x.py`): the spec names its own command, so
    // moving both after -- would run the spec file as a program.
    if (!runArgs.spec_path.empty() && isSpecFile(runArgs.spec_path)) {
      return usageError(
          fmt::format("run: unexpected arguments \"{}\" after the job spec {}: a spec and a command "
                      "cannot both be given; run the spec (dtrain run {}) or the command (dtrain run "
                      "[options] -- {})",
                      fmt::format("{}", fmt::join(words, " ")), runArgs.spec_path, shellQuote(runArgs.spec_path),
                      fmt::format("{}", fmt::join(words, " "))));
    }
    if (!runArgs.spec_path.empty()) words.insert(words.begin(), shellQuote(runArgs.spec_path));
    // torchrun's `torchrun train.py x` names the script alone: the fix gets the python3 that
    // dtrain would otherwise refuse it without (it adds no interpreter).
    std::vector<std::string> given = extra, fixed;
    if (!runArgs.spec_path.empty()) given.insert(given.begin(), runArgs.spec_path);
    for (const std::string& w : app::commandFix(given)) fixed.push_back(shellQuote(w));
    return usageError(
        fmt::format("run: unexpected arguments \"{}\"; to run a program, put its command after --: "
                    "dtrain run [options] -- {}",
                    fmt::format("{}", fmt::join(words, " ")), fmt::format("{}", fmt::join(fixed, " "))));
  }
  if (!command.empty() && !run->parsed() && !validate->parsed()) {
    std::cerr << "dtrain: error: a command after -- is only taken by 'dtrain run' and 'dtrain validate'\n";
    return kExitUsage;
  }

  try {
    if (int rc = app::runStoreCommand(); rc >= 0) return rc;
    if (int rc = app::runBenchCommand(); rc >= 0) return rc;
    if (int rc = app::runTrainCommand(); rc >= 0) return rc;
    if (int rc = app::runAgentCommand(); rc >= 0) return rc;
    if (run->parsed()) return app::runCommand(runArgs);
    if (validate->parsed()) return app::validateCommand(valArgs);
  } catch (const SpecError& e) {
    return sayError(e.what(), kExitUsage);
  } catch (const launch::PreflightError& e) {
    return sayError(e.what(), kExitFailure, true);
  } catch (const std::exception& e) {  // IoError and the rest: dtrain itself failed
    return sayError(e.what(), kExitFailure);
  }
  return kExitUsage;
}

}  // namespace

int main(int argc, char** argv) {
  const int rc = dtrainMain(argc, argv);
  // A run's (or an agent's) last output may still be queued in the console: written out
  // before dtrain exits (flushConsole).
  dtrain::app::flushConsole();
  return rc;
}
