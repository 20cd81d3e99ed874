#include "train_cmd.h"

#include <cstdlib>
#include <iostream>

#include <fmt/format.h>

#include <unistd.h>

#include "dtrain/comm/communicator.h"
#include "dtrain/launch/output.h"
#include "dtrain/common/errors.h"
#include "dtrain/spec/job_spec.h"
#include "dtrain/spec/summary.h"
#include "dtrain/store/hash_store.h"
#include "dtrain/train/device.h"
#include "dtrain/train/trainer.h"

namespace dtrain::app {
namespace {

CLI::App* gTrain = nullptr;
std::string gSpec;

}  // namespace

void addTrainCommand(CLI::App& app) {
  gTrain = app.add_subcommand("train", "Run the built-in trainer of a job spec (started by dtrain run on every worker)");
  gTrain->add_option("spec", gSpec, "Job spec with a \"trainer\" section")->required();
}

int runTrainCommand() {
  if (!gTrain || !gTrain->parsed()) return -1;
  spec::JobSpec s = spec::loadJobSpec(gSpec);
  if (!s.trainer) throw SpecError(fmt::format("{}: /trainer: missing; dtrain train needs a \"trainer\" section", gSpec));
  // The device decides the communicator: NCCL all-reduces device memory in place, TCP host
  // memory. Resolved before the communicator exists, with the rule NCCL uses to pick its
  // GPU (LOCAL_RANK % visible GPUs), so both land on the same device.
  const int rankHint = std::getenv("RANK") ? std::atoi(std::getenv("RANK")) : 0;
  train::DeviceChoice dev = train::resolveDevice(s.trainer->device, train::localRankFromEnv(rankHint),
                                                   train::localWorldSizeFromEnv(0));
  comm::CommOptions co;
  co.backend = dev.cuda ? "nccl" : "tcp";
  std::unique_ptr<comm::Communicator> comm;
  if (std::getenv("DTRAIN_STORE_ADDR")) {
    comm = comm::createFromEnvironment(co);
  } else {
    // Alone (run by hand): a one-rank TCP communicator on either device. With one rank there
    // is nothing to average, so GPU gradients never leave the device.
    comm = comm::createTcpCommunicator(std::make_shared<store::HashStore>(), 0, 1, comm::CommOptions{});
  }
  train::TrainOptions to;
  to.device = dev.cuda ? "cuda" : "cpu";
  to.log = [](const std::string& line) { std::cout << line << std::endl; };
  if (const char* d = std::getenv("DTRAIN_LOG_DIR"); d && *d) to.metrics_dir = d;
  // A live progress bar: drawn by the launcher when its console is a terminal, or in place
  // here when run by hand on one. Plain periodic lines otherwise.
  if (const char* tty = std::getenv("DTRAIN_CONSOLE_TTY"); tty && std::string(tty) == "1") {
    to.status = [](const std::string& text) { std::cout << launch::kStatusPrefix << text << std::endl; };
  } else if (!std::getenv("DTRAIN_STORE_ADDR") && ::isatty(STDOUT_FILENO)) {
    to.status = [](const std::string& text) { std::cout << "\r\x1b[2K" << text << std::flush; };
    to.log = [](const std::string& line) { std::cout << "\r\x1b[2K" << line << std::endl; };
  }
  train::TrainResult r = train::train(*s.trainer, *comm, to);
  if (const char* path = std::getenv("DTRAIN_RESULT_FILE"); path && *path && comm->rank() == 0)
    spec::writeTrainerOutcome(path, {r.final_loss, r.eval_accuracy, r.samples_per_s, r.steps, r.weights_sha256});
  if (to.status && !std::getenv("DTRAIN_STORE_ADDR")) std::cout << "\n";
  if (comm->rank() == 0)
    std::cout << fmt::format("trained: {} steps, final loss {:.4f}, eval accuracy {:.2f}%, {:.0f} samples/s, weights sha256 {}",
                             r.steps, r.final_loss, 100 * r.eval_accuracy, r.samples_per_s, r.weights_sha256)
              << std::endl;
  return 0;
}

}  // namespace dtrain::app
