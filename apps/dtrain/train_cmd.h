#pragma once
#include <CLI/CLI.hpp>

namespace dtrain::app {

// `dtrain train SPEC`: one worker of the built-in trainer. `dtrain run` starts it on every
// worker of a job whose spec has a "trainer" section; run by hand it trains alone.
void addTrainCommand(CLI::App& app);
int runTrainCommand();  // -1 when not parsed

}  // namespace dtrain::app
