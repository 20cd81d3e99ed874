#pragma once
#include <CLI/CLI.hpp>

namespace dtrain::app {

// `dtrain agent ...`: one node of a multi-node job, started by `dtrain run` (over ssh for
// remote hosts). Not meant to be run by hand: it reads the job secret from stdin.
void addAgentCommand(CLI::App& app);
int runAgentCommand();  // -1 when not parsed

}  // namespace dtrain::app
