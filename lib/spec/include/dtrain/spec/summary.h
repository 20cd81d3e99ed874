#pragma once
// Machine-readable outcomes: `dtrain run --summary-json FILE`, and the trainer's result that
// a worker hands to its launcher. JSON stays inside lib/spec; callers see these structs.
#include <optional>
#include <string>
#include <vector>

namespace dtrain::spec {

struct TrainerOutcome {
  // Absent (JSON null) when this run trained no step (its checkpoint already completed the
  // job) or too few to time: not 0, which would read as a measurement.
  std::optional<double> final_loss;
  // 0..1 on the held-out split; absent when there was none, or for regression (mse), where
  // accuracy means nothing: eval_loss says how it did.
  std::optional<double> eval_accuracy;
  std::optional<double> samples_per_s;
  long long steps = 0;
  std::string weights_sha256;
  // Pipeline parallelism (written when pipeline_stages > 1, the job's stage count, whether
  // or not this run trained): the bubble fraction and each stage's forward + backward compute
  // per step, absent (null) when this run timed none (it trained no step, or was stopped).
  int pipeline_stages = 1;
  std::optional<double> bubble_fraction;
  std::vector<double> stage_ms;
  std::optional<double> eval_loss;  // mean loss on the held-out split; absent without one
  // The checkpoint a next run resumes from: the final one of a finished run, or the one
  // written when it was stopped (SIGTERM: see `stopped`); "" (null) when none was written.
  std::string checkpoint;
  // Stopped by a signal at step `steps` rather than finished: final_loss, eval_*, samples_per_s
  // and weights_sha256 are null (nothing was evaluated or compared across ranks).
  bool stopped = false;
};

struct RankOutcome {
  int rank = 0;
  int local_rank = 0;
  std::string host;
  int exit_code = 0;    // when signal is empty
  std::string signal;   // "SIGKILL", or "" when it exited
  bool stopped_by_dtrain = false;
  bool lost = false;    // its node was lost before it reported an exit: exit_code and signal unknown
};

// One elastic event: "restart", "node_lost", "node_joined", "host_excluded", "worker_hung".
struct JobEvent {
  std::string time;    // UTC, ISO 8601
  int round = 0;       // rendezvous round (= restart attempt) it ended or started
  std::string kind;
  std::string reason;  // one line
  std::string host;    // "" when not about one host
  int rank = -1;       // -1 when not about one rank
};

// The event's one-line form, as printed on stderr when it happens.
std::string formatEvent(const JobEvent& e);

struct RunSummary {
  std::string job;
  std::string run_id;
  bool succeeded = false;
  // Written as the job starts: status "running", exit_code null. A file that still says so
  // later is a run that never finished (dtrain SIGKILLed, the machine lost).
  bool running = false;
  int exit_code = 0;
  int restarts = 0;
  double wall_s = 0;
  std::string stopped_by;  // "SIGINT" etc. when dtrain was signalled
  // Why it failed, in one line (the headline dtrain printed, or the error that ended the run
  // before any worker started); "" when it succeeded.
  std::string error;
  std::vector<RankOutcome> ranks;
  std::optional<TrainerOutcome> trainer;
  std::vector<JobEvent> events;
};

std::string toJson(const RunSummary& s);
// True when `text` is a summary toJson wrote (of this dtrain or an earlier one: a JSON object
// with "status" and "exit_code"), which a next run may replace.
bool isRunSummaryText(const std::string& text);

// The trainer's rank 0 writes its outcome to DTRAIN_RESULT_FILE; the launcher reads it.
void writeTrainerOutcome(const std::string& path, const TrainerOutcome& t);
std::optional<TrainerOutcome> readTrainerOutcome(const std::string& path);

}  // namespace dtrain::spec
