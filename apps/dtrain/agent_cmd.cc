#include "agent_cmd.h"

#include <fmt/format.h>

#include "dtrain/agent/agent.h"
#include "dtrain/common/errors.h"
#include "dtrain/common/strings.h"

namespace dtrain::app {
namespace {

CLI::App* gAgent = nullptr;
agent::AgentOptions gOpts;
std::string gGpus;
bool gNoDataShare = false;
bool gNoMemoryCheck = false;

}  // namespace

void addAgentCommand(CLI::App& app) {
  gAgent = app.add_subcommand("agent", "One node of a multi-node job (started by dtrain run; reads the job secret on stdin)");
  gAgent->add_option("--store-addr", gOpts.store_addr, "Launcher's store address (default: the ssh client's address)");
  gAgent->add_option("--store-port", gOpts.store_port, "Launcher's store port")->required();
  gAgent->add_option("--run-id", gOpts.run_id, "Run id")->required();
  gAgent->add_option("--node", gOpts.node, "This node's name in the job")->required();
  gAgent->add_option("--order", gOpts.order, "Position in the hostfile (node rank of the first round)");
  gAgent->add_option("--nnodes", gOpts.nnodes, "Nodes in the job")->required();
  gAgent->add_option("--nproc", gOpts.nproc, "Workers on this node (default: the spec's nproc_per_node)");
  gAgent->add_option("--gpus", gGpus, "CUDA_VISIBLE_DEVICES for this node's workers, e.g. 0,1");
  gAgent->add_option("--address", gOpts.address, "How other nodes reach this one (default: learned)");
  gAgent->add_flag("--merge-output", gOpts.merge_output, "One pipe for each worker's stdout and stderr (the launcher's console is one file)");
  gAgent->add_flag("--no-data-share", gNoDataShare, "Workers parse the data files themselves (the launcher's DTRAIN_DATA_SHARE=0)");
  gAgent->add_flag("--no-memory-check", gNoMemoryCheck, "Do not refuse a job this host cannot hold (the launcher's DTRAIN_MEMORY_CHECK=0)");
  gAgent->add_option("--join-grace", gOpts.join_grace_s,
                     "Seconds past rendezvous.timeout_s to wait for a round (the launcher of an elastic job decides first)")
      ->check(CLI::Range(0.0, 3600.0));
  gAgent->add_flag("--wait", gOpts.wait, "Wait for the launcher's word before joining (a host coming back)");
  gAgent->group("");  // internal: hidden from dtrain --help
}

int runAgentCommand() {
  if (!gAgent || !gAgent->parsed()) return -1;
  if (!gGpus.empty()) {
    for (const auto& g : split(gGpus, ',')) {
      try {
        gOpts.gpus.push_back(std::stoi(g));
      } catch (...) {
        throw SpecError(fmt::format("--gpus: expected GPU indices like 0,1, got \"{}\"", gGpus));
      }
    }
  }
  gOpts.data_share = !gNoDataShare;
  gOpts.memory_check = !gNoMemoryCheck;
  return agent::runAgent(gOpts);
}

}  // namespace dtrain::app
