#include "dtrain/launch/env.h"

#include <gtest/gtest.h>

#include "dtrain/launch/plan.h"

namespace dtrain::launch {
namespace {

spec::JobSpec twoWorkers() {
  spec::JobSpec s;
  s.command = {"true"};
  s.nproc_per_node = 2;
  s.max_restarts = 5;
  return s;
}

TEST(WorkerEnv, TorchrunContract) {
  spec::JobSpec s = twoWorkers();
  Plan p = makeLocalPlan(s, "abc123", 4242);
  ASSERT_EQ(p.workers.size(), 2u);
  EnvOptions o;
  o.error_file = "/tmp/e/1/error.json";
  o.restart_count = 1;
  EnvMap env = workerEnv({{"PATH", "/bin"}}, s, p, p.workers[1], o);
  EXPECT_EQ(env.at("PATH"), "/bin");
  EXPECT_EQ(env.at("RANK"), "1");
  EXPECT_EQ(env.at("LOCAL_RANK"), "1");
  EXPECT_EQ(env.at("GROUP_RANK"), "0");
  EXPECT_EQ(env.at("ROLE_RANK"), "1");
  EXPECT_EQ(env.at("ROLE_NAME"), "default");
  EXPECT_EQ(env.at("WORLD_SIZE"), "2");
  EXPECT_EQ(env.at("LOCAL_WORLD_SIZE"), "2");
  EXPECT_EQ(env.at("GROUP_WORLD_SIZE"), "1");
  EXPECT_EQ(env.at("ROLE_WORLD_SIZE"), "2");
  // The DeepSpeed launcher's names for the same layout; never MPI's (an MPI library would
  // take them for an mpirun launch).
  EXPECT_EQ(env.at("LOCAL_SIZE"), "2");
  EXPECT_EQ(env.at("CROSS_RANK"), "0");
  EXPECT_EQ(env.at("CROSS_SIZE"), "1");
  for (const char* mpi : {"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "PMI_RANK", "PMI_SIZE", "HOROVOD_RANK"})
    EXPECT_EQ(env.count(mpi), 0u) << mpi;
  EXPECT_EQ(env.at("MASTER_ADDR"), "127.0.0.1");
  EXPECT_EQ(env.at("MASTER_PORT"), "4242");
  EXPECT_EQ(env.at("TORCHELASTIC_RESTART_COUNT"), "1");
  EXPECT_EQ(env.at("TORCHELASTIC_MAX_RESTARTS"), "5");
  EXPECT_EQ(env.at("TORCHELASTIC_RUN_ID"), "abc123");
  EXPECT_EQ(env.at("TORCHELASTIC_USE_AGENT_STORE"), "False");
  EXPECT_EQ(env.at("TORCHELASTIC_ERROR_FILE"), "/tmp/e/1/error.json");
  EXPECT_EQ(env.at("DTRAIN_RUN_ID"), "abc123");
  EXPECT_EQ(env.at("OMP_NUM_THREADS"), "1");
}

TEST(WorkerEnv, OmpOnlyWhenSeveralWorkersAndUnset) {
  spec::JobSpec s = twoWorkers();
  Plan p = makeLocalPlan(s, "r", 1);
  EXPECT_EQ(workerEnv({{"OMP_NUM_THREADS", "8"}}, s, p, p.workers[0], {}).at("OMP_NUM_THREADS"), "8");
  s.nproc_per_node = 1;
  Plan p1 = makeLocalPlan(s, "r", 1);
  EXPECT_EQ(workerEnv({}, s, p1, p1.workers[0], {}).count("OMP_NUM_THREADS"), 0u);
}

TEST(WorkerEnv, OneWorkerUnderACpuQuotaGetsTheQuotasThreads) {
  spec::JobSpec s = twoWorkers();
  s.nproc_per_node = 1;
  Plan p = makeLocalPlan(s, "r", 1);
  EnvOptions o;
  o.cpus.affinity = 64;
  o.cpus.quota = 4.5;
  o.cpus.usable = 4;
  EXPECT_EQ(workerEnv({}, s, p, p.workers[0], o).at("OMP_NUM_THREADS"), "4");
  EXPECT_EQ(defaultOmpThreads({}, s, o.cpus), "4");
  // Set by the user: theirs.
  EXPECT_EQ(workerEnv({{"OMP_NUM_THREADS", "8"}}, s, p, p.workers[0], o).at("OMP_NUM_THREADS"), "8");
  EXPECT_EQ(defaultOmpThreads({{"OMP_NUM_THREADS", "8"}}, s, o.cpus), "");
  // A quota that does not bind (at least the affinity's CPUs): unset, as without one.
  o.cpus.affinity = 4;
  EXPECT_EQ(workerEnv({}, s, p, p.workers[0], o).count("OMP_NUM_THREADS"), 0u);
  // Several workers: torchrun's 1, quota or not.
  o.cpus.affinity = 64;
  spec::JobSpec two = twoWorkers();
  Plan p2 = makeLocalPlan(two, "r", 1);
  EXPECT_EQ(workerEnv({}, two, p2, p2.workers[0], o).at("OMP_NUM_THREADS"), "1");
}

TEST(WorkerEnv, SpecEnvWins) {
  spec::JobSpec s = twoWorkers();
  s.env = {{"MASTER_ADDR", "10.0.0.1"}, {"OMP_NUM_THREADS", "4"}};
  Plan p = makeLocalPlan(s, "r", 1);
  EnvMap env = workerEnv({}, s, p, p.workers[0], {});
  EXPECT_EQ(env.at("MASTER_ADDR"), "10.0.0.1");
  EXPECT_EQ(env.at("OMP_NUM_THREADS"), "4");
}

// dtrain run under mpirun: the launching process's MPI rank is not every worker's.
TEST(WorkerEnv, InheritedMpiIdentityIsDropped) {
  spec::JobSpec s = twoWorkers();
  Plan p = makeLocalPlan(s, "r", 1);
  const EnvMap base = {
      {"OMPI_COMM_WORLD_RANK", "3"}, {"OMPI_COMM_WORLD_SIZE", "8"}, {"PMI_RANK", "3"}, {"PMIX_RANK", "3"},
      {"OMPI_MCA_btl", "tcp,self"},  {"SLURM_JOB_ID", "7"}};
  EnvMap env = workerEnv(base, s, p, p.workers[1], {});
  for (const char* k : {"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "PMI_RANK", "PMIX_RANK"})
    EXPECT_EQ(env.count(k), 0u) << k;
  EXPECT_EQ(env.at("OMPI_MCA_btl"), "tcp,self");  // (settings, not identity, pass)
  EXPECT_EQ(env.at("SLURM_JOB_ID"), "7");
  EXPECT_EQ(env.at("RANK"), "1");
  s.env = {{"PMI_RANK", "1"}};
  EXPECT_EQ(workerEnv(base, s, p, p.workers[1], {}).at("PMI_RANK"), "1");  // the spec's own wins
}

TEST(Plan, FreePortAvoidsRendezvousPort) {
  for (int i = 0; i < 20; ++i) {
    int port = pickFreePort(29400);
    EXPECT_GT(port, 0);
    EXPECT_NE(port, 29400);
  }
}

TEST(Plan, TableHasOneRowPerWorker) {
  spec::JobSpec s = twoWorkers();
  s.nproc_per_node = 3;
  Plan p = makeLocalPlan(s, "r", 1);
  std::string t = formatPlan(p, s);
  size_t rows = 0;
  for (char c : t) rows += c == '\n';
  EXPECT_EQ(rows, 2u + 3u);
}

}  // namespace
}  // namespace dtrain::launch
