#include "dtrain/launch/env.h"

#include <fmt/format.h>

#include "dtrain/launch/plan.h"

extern char** environ;

namespace dtrain::launch {

std::string defaultOmpThreads(const EnvMap& base, const spec::JobSpec& spec, const CpuAvailability& cpus) {
  if (base.count("OMP_NUM_THREADS") || spec.env.count("OMP_NUM_THREADS")) return "";
  if (spec.nproc_per_node > 1) return "1";
  return cpus.quotaBinds() ? std::to_string(cpus.usable) : "";
}

EnvMap workerEnv(const EnvMap& base, const spec::JobSpec& spec, const Plan& plan, const WorkerSlot& slot,
                 const EnvOptions& opts) {
  EnvMap env = base;
  // dtrain run under mpirun or srun --mpi: that launch's identity of dtrain's process, the same
  // in every worker, would make an MPI library (mpi4py, an MPI-built torch or Horovod) take each
  // worker for that one rank of mpirun's world. Dropped (the spec's env may still set them).
  for (auto it = env.begin(); it != env.end();) {
    const std::string& k = it->first;
    const bool mpiIdentity = k.rfind("OMPI_COMM_WORLD_", 0) == 0 || k == "PMI_RANK" || k == "PMI_SIZE" ||
                             k == "PMI_LOCAL_RANK" || k == "PMI_LOCAL_SIZE" || k == "PMIX_RANK";
    it = mpiIdentity ? env.erase(it) : std::next(it);
  }
  auto set = [&](const char* k, const std::string& v) { env[k] = v; };
  auto num = [&](const char* k, long v) { env[k] = std::to_string(v); };
  num("RANK", slot.global_rank);
  num("LOCAL_RANK", slot.local_rank);
  num("GROUP_RANK", slot.node_rank);
  num("ROLE_RANK", slot.global_rank);
  set("ROLE_NAME", "default");
  num("LOCAL_WORLD_SIZE", plan.local_world_size);
  num("WORLD_SIZE", plan.world_size);
  num("GROUP_WORLD_SIZE", plan.nnodes);
  num("ROLE_WORLD_SIZE", plan.world_size);
  // The DeepSpeed launcher's names for the node layout (scripts written for it read them);
  // not MPI's OMPI_COMM_WORLD_* / PMI_*, which MPI libraries would take for an mpirun launch.
  num("LOCAL_SIZE", plan.local_world_size);
  num("CROSS_RANK", slot.node_rank);
  num("CROSS_SIZE", plan.nnodes);
  set("MASTER_ADDR", plan.master_addr);
  num("MASTER_PORT", plan.master_port);
  num("TORCHELASTIC_RESTART_COUNT", opts.restart_count);
  num("TORCHELASTIC_MAX_RESTARTS", spec.max_restarts);
  set("TORCHELASTIC_RUN_ID", plan.run_id);
  set("TORCHELASTIC_USE_AGENT_STORE", "False");
  if (!opts.error_file.empty()) set("TORCHELASTIC_ERROR_FILE", opts.error_file);
  set("DTRAIN_RUN_ID", plan.run_id);
  set("DTRAIN_JOB_NAME", spec.name);
  num("DTRAIN_NODE_RANK", slot.node_rank);
  num("DTRAIN_NNODES", plan.nnodes);
  num("DTRAIN_RESTART_COUNT", opts.restart_count);
  num("DTRAIN_ROUND", plan.round);
  set("DTRAIN_DEVICE", slot.device);
  if (!spec.log_dir.empty()) set("DTRAIN_LOG_DIR", spec.log_dir);
  // The dtrain running the job, for a worker's own `dtrain store ...` when dtrain was run by
  // path (build/bin/dtrain) and is not on the workers' PATH.
  static const std::string self = selfExecutable();
  set("DTRAIN_BIN", self);
  if (plan.store_port > 0) {
    set("DTRAIN_STORE_ADDR", plan.store_addr);
    num("DTRAIN_STORE_PORT", plan.store_port);
    set("DTRAIN_STORE_TOKEN", plan.store_token);
  }
  if (auto omp = defaultOmpThreads(base, spec, opts.cpus); !omp.empty()) set("OMP_NUM_THREADS", omp);
  // What torchrun gives every worker, unless the user chose otherwise: Python output that
  // is not held in a block buffer (workers write to pipes: lines would arrive late, and the
  // last ones before a crash be lost; torchrun runs `python -u`), and NCCL errors that
  // abort the collective instead of hanging it (torch 1.x reads the first name, 2.x the
  // second).
  for (const char* k : {"PYTHONUNBUFFERED", "NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_ASYNC_ERROR_HANDLING"})
    if (!base.count(k)) set(k, "1");
  for (const auto& [k, v] : spec.env) env[k] = v;
  return env;
}

EnvMap currentEnvironment() {
  EnvMap env;
  for (char** e = environ; e && *e; ++e) {
    std::string kv(*e);
    auto eq = kv.find('=');
    if (eq == std::string::npos) continue;
    env[kv.substr(0, eq)] = kv.substr(eq + 1);
  }
  return env;
}

}  // namespace dtrain::launch
