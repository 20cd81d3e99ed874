#pragma once
// The typed job spec. All validation of user input lives in this library; the rest of
// dtrain sees only these structs and may assume they are valid.
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace dtrain::spec {

struct RendezvousSpec {
  int port = 0;          // dtrain's own store port; 0 = a free one, chosen at start
  int timeout_s = 900;
};

// The built-in trainer (docs/job-spec.md, "trainer").
struct TrainerSpec {
  struct Model {
    std::string type = "mlp";
    std::vector<int> layers;           // input, hidden..., output
    std::string activation = "relu";   // relu | gelu
    std::string loss = "cross_entropy";  // cross_entropy | mse
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
    bool header = true;                       // csv: first line names the columns
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
  } optimizer;
  struct LrSchedule {
    std::string type = "constant";  // constant | step | warmup_cosine
    long long step_size = 0;        // step: multiply by gamma every step_size steps
    double gamma = 0.1;
    long long warmup_steps = 0;     // warmup_cosine: linear warm-up, then cosine to min_lr
    double min_lr = 0.0;
  } lr_schedule;
  double grad_clip_norm = 0;  // clip gradients to this global L2 norm; 0 = off
  std::string device = "auto";  // auto | cpu | cuda
  unsigned long long seed = 0;
  double bucket_mb = 25;
  bool overlap = true;           // all-reduce buckets during backward
  int log_every_steps = 50;
  struct Checkpoint {
    std::string dir;
    int every_steps = 0;
  } checkpoint;
};

struct JobSpec {
  std::string name = "job";
  std::vector<std::string> command;           // argv; command[0] looked up on PATH
  std::map<std::string, std::string> env;     // applied on top of the torchrun variables
  std::string cwd;                            // "" = dtrain's cwd
  bool nproc_auto = false;                    // "auto" before resolution
  int nproc_per_node = 1;                     // resolved count
  std::string log_dir;                        // "" = no per-rank files
  int max_restarts = 0;
  RendezvousSpec rendezvous;
  double shutdown_timeout_s = 30;             // grace between SIGTERM and SIGKILL
  bool prefix_output = true;                  // "[rank N] " on every console line
  std::vector<int> console_ranks;             // empty = all ranks on the console
  std::string source;                         // file it was read from, for messages
  std::optional<TrainerSpec> trainer;         // set: workers run the built-in trainer
};

// Reads and validates a job spec file. Throws SpecError with one line:
// "<file>: <json pointer>: <problem>; <fix>".
JobSpec loadJobSpec(const std::string& path);

// Same, from text already in memory; `source` names it in messages.
JobSpec parseJobSpec(const std::string& text, const std::string& source);

// CLI overrides, torchrun-style. Unset fields leave the spec alone.
struct Overrides {
  std::optional<std::string> nproc_per_node;  // integer or "auto"
  std::optional<int> max_restarts;
  std::optional<std::string> log_dir;
  std::optional<double> shutdown_timeout_s;
  std::vector<std::string> env;               // "K=V"
  std::optional<std::string> local_ranks_filter;  // "0,2"
  bool no_prefix = false;
};

// Applies overrides and re-checks what they touched. Throws SpecError naming the flag.
void applyOverrides(JobSpec& spec, const Overrides& o);

// How many workers "auto" means on this machine: visible GPUs (CUDA_VISIBLE_DEVICES
// honoured, counted from the driver's /proc and /dev entries so that no CUDA context is
// created), else usable CPU cores.
int autoProcsPerNode();
int visibleGpuCount();

// Fills nproc_per_node when nproc_auto and checks cross-field consistency.
void resolve(JobSpec& spec);

// Human-readable dump of the resolved spec (what `dtrain validate` prints).
std::string describe(const JobSpec& spec);

}  // namespace dtrain::spec
