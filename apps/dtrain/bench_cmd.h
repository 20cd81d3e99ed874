#pragma once
#include <CLI/CLI.hpp>

namespace dtrain::app {

// `dtrain bench allreduce|broadcast|allgather`: launches its own ranks locally and prints an
// nccl-tests style table; exit 1 when any value is wrong.
void addBenchCommands(CLI::App& app);
int runBenchCommand();  // -1 when no bench subcommand was parsed

}  // namespace dtrain::app
