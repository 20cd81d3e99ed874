#pragma once
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

namespace dtrain::app {

// `dtrain store serve|set|get|add|wait|check|delete`. Exit codes for scripts:
// 0 ok, 1 "no" (check: a key is missing; delete: key was absent), 2 usage or a request
// the store refuses as given, 3 timed out, 4 store unreachable or connection lost,
// 5 authentication refused.
void addStoreCommands(CLI::App& app);
// Runs whichever store subcommand was parsed; -1 when none was.
int runStoreCommand();
// For a command line CLI11 refused: when a `dtrain store` word that is no option starts
// with '-' (a key like -k), how to pass it ("; ... after --"); otherwise "".
std::string storeParseHint(const std::vector<std::string>& args);

}  // namespace dtrain::app
