#pragma once
#include <CLI/CLI.hpp>
#include <string>
#include <vector>

#include "dtrain/launch/job.h"
#include "dtrain/spec/job_spec.h"

namespace dtrain::app {

// `dtrain run` and `dtrain validate`'s words, as the command line gave them (checked and
// turned into a JobSpec by the command itself).
struct RunArgs {
  std::string spec_path;
  std::vector<std::string> command;  // after "--"
  spec::Overrides overrides;
  bool dry_run = false;
  std::string summary_json;
  std::string nproc, max_restarts, shutdown, hostfile, hosts, nnodes;
  std::vector<std::string> ssh_options;  // appended to the spec's ssh.options
  std::string verb = "run";              // "validate": messages name it
};

// The options run and validate share, which override the spec's fields.
void addOverrideFlags(CLI::App* cmd, RunArgs& a);

// `dtrain run`: exit code of the job (or of its refusal). Throws SpecError (exit 2) and other
// exceptions (exit 1) for main to say, after writing the run's failed --summary-json.
int runCommand(RunArgs& a);

// `dtrain validate`: prints the resolved spec; throws as runCommand does.
int validateCommand(RunArgs& a);

// `dtrain run`'s stop signals, held by main from its start (`held` outlives the run): a stop
// before the launch ends the run with its own summary, not the signal's default action.
void holdRunStopSignals(launch::HeldStopSignals* held);

// The run's outcome is decided: exit code `code`. From here a stop signal changes nothing and
// only cuts short the waits that may block for good (run_cmd.cc says the contract).
void enterRunEnd(int code);

// The --summary-json of a run that ended before any worker started: status failed, the exit
// code and the error (`stoppedBy`: the signal that stopped it, "" for none). Best effort.
void writeFailedSummary(const std::string& path, const std::string& job, const std::string& runId, int code,
                        const std::string& what, double wallS, const std::string& stoppedBy = "");

// Writes out what the console still holds; false when a stop signal cut the wait short.
bool flushConsole();

// How to run `words` (a program, as the user gave it) with dtrain: with the python3 a Python
// script needs, or the ./ a script in this directory needs. For the fixes in messages.
std::vector<std::string> commandFix(std::vector<std::string> words);

}  // namespace dtrain::app
