#pragma once
// The typed job spec. All validation of user input lives in this library; the rest of
// dtrain sees only these structs and may assume they are valid.
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "dtrain/common/errors.h"

namespace dtrain::spec {

struct RendezvousSpec {
  int port = 0;          // dtrain's own store port; 0 = a free one, chosen at start
  int timeout_s = 900;
  // Multi-node only. The address agents use to reach the launcher's store; "" = the source
  // address of the launching host's route to each node (what that node sees it as).
  std::string addr;
  // MASTER_ADDR override; "" = node 0's address as the other nodes reach it.
  std::string master_addr;
  // Multi-node: a node whose agent has not heartbeat for this long is lost.
  double heartbeat_timeout_s = 15;
  bool operator==(const RendezvousSpec&) const = default;
};

// One host of a multi-node job: a hostfile line, a "nodes" entry or a --hosts item.
struct NodeSpec {
  std::string host;       // as ssh (or the resolver) reaches it, without user@
  std::string user;       // "" = ssh.user, else ssh's own default
  int port = 0;           // ssh port; 0 = ssh.port, else 22
  int slots = 0;          // workers on this node; 0 = one per GPU in gpus, else nproc_per_node
                          // (resolved on that node if "auto")
  int max_slots = 0;      // hostfile max_slots=N (OpenMPI): slots may not exceed it; 0 = no cap
  std::string address;    // how other nodes reach this one; "" = learned at run time
  std::vector<int> gpus;  // CUDA_VISIBLE_DEVICES for this node's workers; empty = leave as is
  bool local = false;     // resolved: this machine (localhost, 127.x, ::1, its host name); no ssh
  std::string origin;     // where it was given, for messages: "hosts:3", "job.json: /nodes/2", "--hosts"
  bool operator==(const NodeSpec&) const = default;
};

// How the launcher reaches remote nodes (OpenSSH client, BatchMode).
struct SshSpec {
  std::string user;                      // default login user; "" = ssh's default
  int port = 0;                          // default port; 0 = ssh's default (22 or ssh_config)
  std::string identity_file;             // -i; "" = ssh's defaults / agent
  double connect_timeout_s = 10;         // ConnectTimeout, also the pre-flight deadline
  std::vector<std::string> options;      // extra ssh arguments, verbatim (e.g. "-F", "cfg")
  std::string host_key_checking = "accept-new";  // StrictHostKeyChecking: yes | no | accept-new
  std::string dtrain_path;               // dtrain binary on the remote hosts; "" = this binary's path
  bool operator==(const SshSpec&) const = default;
};

// The built-in trainer (docs/job-spec.md, "trainer").
struct TrainerSpec {
  struct Model {
    std::string type = "mlp";
    std::vector<int> layers;           // input, hidden..., output
    std::string activation = "relu";   // relu | gelu
    std::string loss = "cross_entropy";  // cross_entropy | mse
    bool operator==(const Model&) const = default;
  } model;
  struct Data {
    std::string type = "synthetic";  // synthetic | csv | idx
    long long train_samples = 60000;  // synthetic
    long long eval_samples = 10000;   // synthetic
    unsigned long long seed = 1;
    // csv: numeric columns, one of them the label; idx: MNIST-format images + labels.
    std::string path, labels_path;            // training set
    std::string eval_path, eval_labels_path;  // held-out set (optional)
    std::string label_column = "label";       // csv: header name, or a 0-based index
    // label_column came as a JSON number: a 0-based index, even where the header has a column
    // of that name. A string is a header name first: digits name a column index only where
    // no column bears them as its name (or the file has no header).
    bool label_column_is_index = false;
    bool header = true;                       // csv: first line names the columns
    // Load the next batch on a thread of its own while a step computes; unset = "auto" (on for
    // GPU math, and for CPU math when the node has a core beyond the workers' BLAS threads).
    std::optional<bool> prefetch;
    // Threads that compute a batch's samples (the loading thread and helpers); unset = "auto"
    // (GPU math: this worker's share of the node's CPUs less one, at most 16; CPU math: 1).
    // Samples are a pure function of their index, so the count changes when, never what.
    std::optional<int> loader_threads;
    bool operator==(const Data&) const = default;
  } data;
  int batch_size = 128;  // per worker
  int epochs = 1;
  long long max_steps = 0;  // 0 = no limit
  struct Optimizer {
    std::string type = "sgd";  // sgd | adamw
    double lr = 0.05;
    double momentum = 0.0;     // sgd
    bool nesterov = false;     // sgd
    double weight_decay = 0.0; // sgd: L2 added to the gradient; adamw: decoupled (default 0.01)
    double beta1 = 0.9, beta2 = 0.999, eps = 1e-8;  // adamw
    bool operator==(const Optimizer&) const = default;
  } optimizer;
  struct LrSchedule {
    std::string type = "constant";  // constant | step | warmup_cosine
    long long step_size = 0;        // step: multiply by gamma every step_size steps
    double gamma = 0.1;
    long long warmup_steps = 0;     // warmup_cosine: linear warm-up, then cosine to min_lr
    double min_lr = 0.0;
    bool operator==(const LrSchedule&) const = default;
  } lr_schedule;
  double grad_clip_norm = 0;  // clip gradients to this global L2 norm; 0 = off
  std::string device = "auto";  // auto | cpu | cuda
  unsigned long long seed = 0;
  double bucket_mb = 25;
  std::optional<bool> overlap;   // all-reduce buckets during backward; unset = "auto"
  int log_every_steps = 50;
  struct Checkpoint {
    std::string dir;
    int every_steps = 0;
    // Written on a thread of the writing rank while training goes on (docs/trainer.md).
    bool async = false;
    bool operator==(const Checkpoint&) const = default;
  } checkpoint;
  // Pipeline (model) parallelism, combined with data parallelism: world = D x
  // pipeline_stages. docs/trainer.md, "Pipeline parallelism".
  struct Parallel {
    int pipeline_stages = 1;
    int micro_batches = 0;           // 0 = pipeline_stages (resolved by the parser)
    std::string schedule = "1f1b";   // gpipe | 1f1b
    std::vector<int> stage_layers;   // weight layers per stage; empty = balanced by parameters
    bool operator==(const Parallel&) const = default;
  } parallel;
  bool operator==(const TrainerSpec&) const = default;
};

// The launcher's variables remote workers get unless the job says otherwise (env_forward):
// the default of every JobSpec, from a spec file or from the command line alone.
inline const std::vector<std::string> kDefaultEnvForward = {"NCCL_", "GLOO_", "OMP_", "OPENBLAS_", "MKL_",
                                                            "PYTHON", "TORCH_", "HF_", "WANDB_"};

// Paths (cwd, log_dir, hostfile, env_file, ssh.identity_file, the trainer's data files and
// checkpoint.dir) are absolute once parsed: a relative one means what it means in the
// directory dtrain is started in, whatever `cwd` says.
struct JobSpec {
  std::string name = "job";
  std::vector<std::string> command;           // argv; command[0] looked up on PATH
  std::map<std::string, std::string> env;     // applied on top of the torchrun variables
  std::string cwd;                            // "" = dtrain's cwd
  bool nproc_auto = false;                    // "auto" before resolution
  int nproc_per_node = 1;                     // resolved count
  std::string nproc_auto_note;                // why "auto" came to less than the CPUs seen, for validate
  std::string log_dir;                        // "" = no per-rank files
  int max_restarts = 0;
  // Elastic range (multi-node): the job goes on while at least min_nodes are left, and
  // admits nodes back up to max_nodes. 0 = the number of hosts given.
  int min_nodes = 0;
  int max_nodes = 0;
  // A worker that has armed its watchdog (DTRAIN_WATCHDOG_FILE) and not touched it for
  // this long is killed and counted as failed. 0 = off.
  double worker_timeout_s = 0;
  // Pause before restart n: restart_backoff_s * 2^(n-1), at most 60 s.
  double restart_backoff_s = 1;
  RendezvousSpec rendezvous;
  double shutdown_timeout_s = 30;             // grace between SIGTERM and SIGKILL
  bool prefix_output = true;                  // "[rank N] " on every console line
  std::vector<int> console_ranks;             // empty = all ranks on the console
  std::string source;                         // file it was read from, for messages
  std::optional<TrainerSpec> trainer;         // set: workers run the built-in trainer
  // Multi-node: empty = single node, this machine. Filled from "nodes", "hostfile" (path
  // relative to dtrain's cwd) or --hostfile/--hosts; order = node order of the first round.
  std::vector<NodeSpec> nodes;
  std::string hostfile;                       // the file nodes came from, if any
  SshSpec ssh;
  // Prefixes of the launcher's environment variables that reach remote workers (local ones
  // inherit everything anyway). The default lives here, so that a spec file without the key
  // and a job given on the command line alone (dtrain run --hosts ... -- CMD) get the same.
  std::vector<std::string> env_forward = kDefaultEnvForward;
  std::string env_file;                       // KEY=VALUE lines merged under env (env wins)
  // Things the launcher should say on stderr before it starts anything (a MASTER_PORT set
  // over dtrain's, a host with more workers than GPUs): one line each, naming where it was
  // given; keyed by what it is about, so a later source replaces an earlier one's line.
  // Not shipped to nodes.
  std::map<std::string, std::string> warnings;
  bool operator==(const JobSpec&) const = default;
};

// Limits shared by the spec and the command line (docs/job-spec.md).
inline constexpr int kMaxProcsPerNode = 4096;  // nproc_per_node, slots; local ranks are below it
inline constexpr int kMaxNodes = 4096;         // min_nodes, max_nodes, --nnodes, hosts
inline constexpr size_t kMaxJobName = 1024;    // name: bytes
inline constexpr int kMaxRestarts = 1000000;   // max_restarts, --max-restarts

// A spec refused after its JSON was read and its name taken (the default "job" when it has
// none): the name, so that the run's summary names the job it refused.
class NamedSpecError : public SpecError {
 public:
  NamedSpecError(const std::string& what, std::string job) : SpecError(what), job_(std::move(job)) {}
  const std::string& job() const { return job_; }

 private:
  std::string job_;
};

struct SpecLoadOptions {
  // False when the command line lists the hosts (--hosts, --hostfile), which replace the
  // spec's: its "hostfile" is then not read (it may name a cluster's file that is not here),
  // and its nodes come from applyOverrides.
  bool read_hostfile = true;
};

// Reads and validates a job spec file. Throws SpecError with one line:
// "<file>: <json pointer>: <problem>; <fix>" (a NamedSpecError once the name is known).
JobSpec loadJobSpec(const std::string& path, const SpecLoadOptions& o = {});

// Same, from text already in memory; `source` names it in messages.
JobSpec parseJobSpec(const std::string& text, const std::string& source, const SpecLoadOptions& o = {});

// CLI overrides, torchrun-style. Unset fields leave the spec alone.
struct Overrides {
  std::optional<std::string> nproc_per_node;  // integer or "auto"
  std::optional<int> max_restarts;
  std::optional<std::string> nnodes;          // --nnodes N or MIN:MAX
  std::optional<std::string> log_dir;
  std::optional<double> shutdown_timeout_s;
  std::vector<std::string> env;               // "K=V", or "K": the launcher's own value of K
  std::vector<std::string> env_forward;       // --env-forward PREFIX: added to the spec's env_forward
  std::optional<std::string> local_ranks_filter;  // "0,2"
  bool no_prefix = false;
  std::optional<std::string> hostfile;        // --hostfile FILE (replaces the spec's nodes)
  std::optional<std::string> hosts;           // --hosts h1:2,h2:2 (replaces the spec's nodes)
};

// Reads a hostfile: "host slots=N", "host:N", "user@host", optional "gpus=0,1" and
// "port=N" fields, '#' comments, blank lines. Throws SpecError "<file>:<line>: problem; fix"
// for duplicates, bad slot counts and unknown fields.
std::vector<NodeSpec> parseHostfile(const std::string& text, const std::string& source);
std::vector<NodeSpec> loadHostfile(const std::string& path);
// "--hosts h1:2,user@h2:2,h3" (slots optional). Throws SpecError "--hosts: problem; fix".
std::vector<NodeSpec> parseHostList(const std::string& list);

// An env_file's text: KEY=VALUE lines, '#' comments, blank lines, optional "export ",
// values literal (no expansion) with one pair of surrounding quotes removed. Throws
// SpecError "<source>:<line>: problem; fix" (a worker identity variable is one).
// `lineOf`, when given, gets each name's line.
std::map<std::string, std::string> parseEnvFile(const std::string& text, const std::string& source,
                                                std::map<std::string, int>* lineOf = nullptr);

// The worker identity variables dtrain sets from the job's layout (RANK, LOCAL_RANK,
// WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK and their torchrun/DeepSpeed aliases): "" when
// `name` is not one, else what it holds ("each worker's global rank"). A job may not set
// them: one value for every worker would give all of them the same identity.
std::string workerIdentityVar(const std::string& name);

// True when host names this machine (localhost, 127.0.0.0/8, ::1, gethostname(), or an
// address of one of its interfaces).
bool isLocalHost(const std::string& host);

// The resolved spec as spec JSON text that parseJobSpec accepts and that describes the same
// job on a node: everything but nodes, hostfile, ssh and env_file (launcher-only; env holds
// the env_file's variables already). For shipping a job to remote agents through the store.
// Paths (cwd, log_dir, data files, checkpoint dir) are written as given: relative ones are
// relative to the agent's working directory, and parseJobSpec on the node checks that they
// exist there. nproc_per_node is the spec's ("auto" when nproc_auto); for a node with its
// own slot count, set nproc_per_node (and nproc_auto = false) on a copy first.
std::string serializeForNode(const JobSpec& spec);

// Applies overrides and re-checks what they touched. Throws SpecError naming the flag.
void applyOverrides(JobSpec& spec, const Overrides& o);

// How many workers "auto" means on this machine: visible GPUs (CUDA_VISIBLE_DEVICES
// honoured, counted from the driver's /proc and /dev entries so that no CUDA context is
// created), else usable CPU cores.
int autoProcsPerNode();
int visibleGpuCount();

// Fills nproc_per_node when nproc_auto and checks cross-field consistency. `given` is what
// applyOverrides applied: an error about a value that came from a flag names the flag
// (--nnodes, --local-ranks-filter), not the spec's JSON path.
void resolve(JobSpec& spec, const Overrides& given = {});

// The world sizes a resolved job can have, as the launcher knows them before the launch:
// {nproc_per_node} for a local job; across hosts, for each node count k in
// min_nodes..max_nodes, every sum of k hosts' workers (any k of them may form a round), in
// the map under k. Empty when a host's count is decided on that host (nproc_per_node "auto").
std::map<int, std::vector<long long>> possibleWorldSizes(const JobSpec& spec);

// A trainer job with pipeline_stages P > 1 runs D x P workers: a world size the launcher knows
// (possibleWorldSizes) that is not a multiple of P is refused here, before any worker starts,
// with a SpecError naming /trainer/parallel/pipeline_stages, the world size(s) and the fix
// (the trainer refuses it too, for worlds only a rendezvous settles). `given` as for resolve.
void checkPipelineWorld(const JobSpec& spec, const Overrides& given = {});

// Human-readable dump of the resolved spec (what `dtrain validate` prints).
std::string describe(const JobSpec& spec);

// A command as validate and the --dry-run plan print it, on one line: words shell-quoted,
// control characters escaped, credentials hidden (by their format, as --token=VALUE, or as
// the word after an option named for one: --api-key VALUE).
std::string shownCommand(const std::vector<std::string>& command);

}  // namespace dtrain::spec
