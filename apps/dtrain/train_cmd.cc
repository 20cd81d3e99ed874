#include "train_cmd.h"

#include <cstdlib>
#include <iostream>

#include <fmt/format.h>

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <thread>

#include "dtrain/comm/communicator.h"
#include "dtrain/launch/output.h"
#include "dtrain/launch/plan.h"
#include "dtrain/common/errors.h"
#include "dtrain/common/strings.h"
#include "dtrain/spec/error_file.h"
#include "dtrain/spec/job_spec.h"
#include "dtrain/spec/summary.h"
#include "dtrain/store/hash_store.h"
#include "dtrain/train/checkpoint.h"
#include "dtrain/train/device.h"
#include "dtrain/train/memory_estimate.h"
#include "dtrain/train/trainer.h"
#include "train_signals.h"

namespace dtrain::app {
namespace {

CLI::App* gTrain = nullptr;
std::string gSpec;

const char* envOr(const char* name, const char* dflt) {
  const char* v = std::getenv(name);
  return v && *v ? v : dflt;
}

// Per-step hooks from the environment:
// - DTRAIN_WATCHDOG_FILE (set by dtrain when worker_timeout_s > 0): touched every step, so
//   a hung trainer is found and restarted.
// - DTRAIN_DEBUG_KILL_AT=RANK:STEP[:MICRO] (fault injection, for tests): on the first
//   attempt (TORCHELASTIC_RESTART_COUNT 0), rank RANK SIGKILLs itself as step STEP begins,
//   or with MICRO (pipeline trainer) as that step's micro-batch MICRO begins its forward on
//   that rank: in the middle of the step, with its neighbours waiting on it.
// - DTRAIN_DEBUG_SAMPLE_LOG=PREFIX (for tests): every batch appended to
//   PREFIX.<rank>.<restart> as "step epoch sample...".
// - DTRAIN_DEBUG_CHECKPOINT_DELAY_MS=N (for tests): each write of a checkpoint's bytes is
//   followed by N ms, so that a test can kill the writer with the file half written.
// Touches the watchdog file: its mtime is the worker's heartbeat.
void touch(const std::string& path) {
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC, 0644);
  if (fd >= 0) {
    ::futimens(fd, nullptr);
    ::close(fd);
  }
}

void installStepHooks(train::TrainOptions& to, int rank) {
  std::string watchdog = envOr("DTRAIN_WATCHDOG_FILE", "");
  std::string killAt = envOr("DTRAIN_DEBUG_KILL_AT", "");
  std::string restart = envOr("TORCHELASTIC_RESTART_COUNT", "0");
  long long killStep = -1;
  int killMicro = -1;
  if (!killAt.empty() && restart == "0") {
    const SpecError bad("DTRAIN_DEBUG_KILL_AT: expected RANK:STEP or RANK:STEP:MICRO, got \"" + killAt + "\"");
    auto parts = split(killAt, ':');
    if (parts.size() != 2 && parts.size() != 3) throw bad;
    try {
      size_t used = 0;
      for (const auto& part : parts) {
        (void)std::stoll(part, &used);
        if (used != part.size()) throw bad;
      }
      if (std::stoi(parts[0]) == rank) {
        killStep = std::stoll(parts[1]);
        if (parts.size() == 3) killMicro = std::stoi(parts[2]);
      }
    } catch (const SpecError&) {
      throw;
    } catch (...) {
      throw bad;
    }
  }
  if (killMicro >= 0) {
    to.on_micro_batch = [killStep, killMicro](long long s, int m) {
      if (s == killStep && m == killMicro) ::raise(SIGKILL);
    };
    killStep = -2;  // not at the step's start
  }
  auto step = std::make_shared<long long>(0);
  if (!watchdog.empty() || killStep >= 0) {
    to.on_step = [watchdog, killStep, step](long long s) {
      *step = s;
      if (!watchdog.empty()) touch(watchdog);
      if (s == killStep) ::raise(SIGKILL);
    };
  }
  if (!watchdog.empty()) {
    // Work outside the steps (the final evaluation, a checkpoint write) is not a hang. At most
    // a few touches a second: an evaluation batch can take well under a millisecond.
    auto last = std::make_shared<std::chrono::steady_clock::time_point>();
    to.heartbeat = [watchdog, last] {
      const auto now = std::chrono::steady_clock::now();
      if (now - *last < std::chrono::milliseconds(250)) return;
      *last = now;
      touch(watchdog);
    };
  }
  if (const char* ms = std::getenv("DTRAIN_DEBUG_CHECKPOINT_DELAY_MS"); ms && *ms) {
    const long delay = std::atol(ms);
    to.on_checkpoint_bytes = [delay] { std::this_thread::sleep_for(std::chrono::milliseconds(delay)); };
  }
  if (const char* prefix = std::getenv("DTRAIN_DEBUG_SAMPLE_LOG"); prefix && *prefix) {
    if (!to.on_step) to.on_step = [step](long long s) { *step = s; };
    auto out = std::make_shared<std::ofstream>(fmt::format("{}.{}.{}", prefix, rank, restart), std::ios::app);
    to.on_batch = [out, step](int epoch, const uint64_t* idx, int n) {
      *out << *step << ' ' << epoch;
      for (int i = 0; i < n; ++i) *out << ' ' << idx[i];
      *out << '\n';
      out->flush();
    };
  }
}

// The final checkpoint of a run that ended at `step`, where a next run resumes from it; ""
// when none was written (no checkpoint dir).
std::string finalCheckpoint(const spec::TrainerSpec& ts, long long step) {
  const std::string last = train::resumeFile(ts, step);
  std::error_code ec;
  return !last.empty() && std::filesystem::exists(last, ec) ? last : std::string();
}

// Rank 0's result for the summary of a run stopped by a signal at `step` (DTRAIN_RESULT_FILE):
// where it stopped and what the next run resumes from; no timing of a run cut short.
void writeStoppedOutcome(const spec::TrainerSpec& ts, long long step, const std::string& checkpoint) {
  const char* path = std::getenv("DTRAIN_RESULT_FILE");
  if (!path || !*path) return;
  spec::TrainerOutcome o;
  o.steps = step;
  o.checkpoint = checkpoint;
  o.stopped = true;
  o.pipeline_stages = ts.parallel.pipeline_stages;
  try {
    spec::writeTrainerOutcome(path, o);
  } catch (const std::exception&) {  // the stop goes on: the summary then has no trainer part
  }
}

}  // namespace

void addTrainCommand(CLI::App& app) {
  gTrain = app.add_subcommand("train", "Run the built-in trainer of a job spec (started by dtrain run on every worker)");
  gTrain->add_option("spec", gSpec, "Job spec with a \"trainer\" section")->required();
}

int trainCommand();

int runTrainCommand() {
  if (!gTrain || !gTrain->parsed()) return -1;
  try {
    return trainCommand();
  } catch (const std::exception& e) {
    // Under a launcher (dtrain run, torchrun), the error file is what its report and summary
    // say about this rank, as a Python worker's @record leaves it; main says it on stderr.
    spec::leaveWorkerError(e.what());
    throw;
  }
}

int trainCommand() {
  // First, before any thread starts (they inherit the signal mask): SIGUSR1/SIGUSR2 ask for a
  // checkpoint, SIGTERM/SIGINT/SIGHUP for a final one and an exit (train_signals.h).
  static train::TrainControl control;
  static TrainSignals signals(control);
  spec::JobSpec s = spec::loadJobSpec(gSpec);
  signals.setGraceSeconds(s.shutdown_timeout_s);
  if (!s.trainer) throw SpecError(fmt::format("{}: /trainer: missing; dtrain train needs a \"trainer\" section", gSpec));
  // Run by hand, this is the launch: the checkpoint directory is made and tried first.
  // (Under dtrain run the launcher or node 0's agent did it.)
  Fd checkpointLock;  // (held while this process trains)
  if (!std::getenv("DTRAIN_STORE_ADDR")) {
    // A job this host cannot hold: refused with the numbers, as dtrain run does, before its
    // checkpoint directory is made. (The data set is not read twice for it: file data is
    // left out of this estimate.) DTRAIN_MEMORY_CHECK=0: not enforced.
    train::MemoryLayout layout;
    layout.gpu = train::resolveDevice(s.trainer->device, 0, 1).cuda;
    layout.checkpoint_to_read = !s.trainer->checkpoint.dir.empty() && train::holdsCheckpointFiles(s.trainer->checkpoint.dir);
    if (train::memoryCheckEnforced()) train::checkHostMemory(*s.trainer, layout, memoryAvailability(), gSpec);
    checkpointLock = train::prepareCheckpointDir(*s.trainer, gSpec);
  }
  // The device decides the communicator: NCCL all-reduces device memory in place, TCP host
  // memory. Resolved before the communicator exists, with the rule NCCL uses to pick its
  // GPU (LOCAL_RANK % visible GPUs), so both land on the same device.
  const int rankHint = std::getenv("RANK") ? std::atoi(std::getenv("RANK")) : 0;
  train::DeviceChoice dev = train::resolveDevice(s.trainer->device, train::localRankFromEnv(rankHint),
                                                   train::localWorldSizeFromEnv(0));
  comm::CommOptions co;
  co.backend = dev.cuda ? "nccl" : "tcp";
  // "auto" is a job-wide choice: GPUs only when every rank has one (NCCL ranks and TCP
  // ranks would never meet), else the CPU everywhere.
  co.tcp_fallback = s.trainer->device == "auto";
  std::unique_ptr<comm::Communicator> comm;
  if (std::getenv("DTRAIN_STORE_ADDR")) {
    comm = comm::createFromEnvironment(co);
    if (dev.cuda && std::string(comm->backend()) != "nccl") {
      std::cout << fmt::format("trainer.device \"auto\": some ranks of the job have no GPU, so this one trains on the "
                               "CPU too (set trainer.device to \"cpu\" to say so, or run on GPU hosts only)")
                << std::endl;
      dev = train::DeviceChoice{};
      dev.name = "cpu";
    }
  } else {
    // Alone (run by hand): a one-rank TCP communicator on either device. With one rank there
    // is nothing to average, so GPU gradients never leave the device.
    comm = comm::createTcpCommunicator(std::make_shared<store::HashStore>(), 0, 1, comm::CommOptions{});
  }
  train::TrainOptions to;
  to.device = dev.cuda ? "cuda" : "cpu";
  to.log = [](const std::string& line) { std::cout << line << std::endl; };
  to.warn = [](const std::string& line) { std::cerr << "dtrain: warning: " << line << std::endl; };
  if (const char* d = std::getenv("DTRAIN_LOG_DIR"); d && *d) to.metrics_dir = d;
  // Metrics rows name their run; one run by hand gets an id of its own.
  const char* runId = std::getenv("DTRAIN_RUN_ID");
  to.run_id = runId && *runId ? runId : launch::newRunId();
  if (const char* n = std::getenv("DTRAIN_RESTART_COUNT"); n && *n) to.attempt = std::atoi(n);
  if (const char* d = std::getenv("DTRAIN_TRACE_DIR"); d && *d) to.trace_dir = d;
  installStepHooks(to, comm->rank());
  // A live progress bar: drawn by the launcher when its console is a terminal, or in place
  // here when run by hand on one. Plain periodic lines otherwise.
  if (const char* tty = std::getenv("DTRAIN_CONSOLE_TTY"); tty && std::string(tty) == "1") {
    to.status = [](const std::string& text) { std::cout << launch::kStatusPrefix << text << std::endl; };
  } else if (!std::getenv("DTRAIN_STORE_ADDR") && launch::consoleCanRedraw()) {
    to.status = [](const std::string& text) { std::cout << "\r\x1b[2K" << text << std::flush; };
    to.log = [](const std::string& line) { std::cout << "\r\x1b[2K" << line << std::endl; };
    to.warn = [](const std::string& line) {
      std::cout << "\r\x1b[2K" << std::flush;  // off the status line, which stdout redraws
      std::cerr << "dtrain: warning: " << line << std::endl;
    };
  }
  // A stop during the final evaluation (the training done, its last checkpoint durable) ends
  // the process at once, from the signal watcher's thread: rank 0 says so and leaves the
  // summary where the run stopped, as a stop in the steps does (the curve is drawn by train()).
  if (comm->rank() == 0) {
    to.on_stop_while_finishing = [ts = *s.trainer, log = to.log](long long step) {
      const std::string checkpoint = finalCheckpoint(ts, step);
      const std::string line =
          fmt::format("{}: stopping during the final evaluation, the training done at step {}; {}",
                      signalName(control.stop.load()), step,
                      checkpoint.empty() ? "no checkpoint written (no /trainer/checkpoint/dir)"
                                         : "its final checkpoint is " + checkpoint);
      if (log)
        log(line);
      else
        std::cout << line << std::endl;
      writeStoppedOutcome(ts, step, checkpoint);
    };
  }
  to.control = &control;
  train::TrainResult r;
  try {
    r = train::train(*s.trainer, *comm, to);
  } catch (const train::TrainingStopped& e) {
    control.phase.store(train::TrainControl::kDone);
    if (to.status && comm->rank() == 0) to.status("");  // (the bar off the screen, as at a finished run's end)
    // The summary says where the job stopped and what the next run resumes from.
    if (comm->rank() == 0) writeStoppedOutcome(*s.trainer, e.step(), e.checkpoint());
    // (rank 0 said where the final checkpoint is.) A rank that learned of the stop from its
    // peers alone waits a moment for its own signal: dtrain's teardown reaches every worker,
    // on other nodes a little later, and a worker that exits 128+signal before dtrain sent it
    // one would count as a failure of its own.
    int sig = control.stop.load();
    if (sig == 0) sig = signals.waitForStop(std::chrono::seconds(2));
    std::cout.flush();
    return 128 + (sig != 0 ? sig : e.signal());
  } catch (const std::exception& e) {
    control.phase.store(train::TrainControl::kDone);
    int sig = control.stop.load();
    // A lost peer under dtrain run: its failure makes the launcher stop every other worker
    // (SIGTERM), so that signal is on its way; a rank stopped by it is not a second failure.
    if (sig == 0 && dynamic_cast<const PeerLostError*>(&e) && std::getenv("DTRAIN_STORE_ADDR"))
      sig = signals.waitForStop(std::chrono::seconds(2));
    if (sig == 0) throw;
    // Stopping anyway: whatever went wrong since (a peer already gone, a final write that
    // failed) must not turn the teardown into a failure of this rank's own.
    std::cout.flush();
    std::cerr << fmt::format("dtrain train: {}: stopping now, without a final checkpoint: {}",
                             signalName(sig), e.what())
              << std::endl;
    return 128 + sig;
  }
  control.phase.store(train::TrainControl::kDone);
  if (to.status && comm->rank() == 0) to.status("");  // the bar is done: the summary lines replace it
  // A run that resumed from a checkpoint which already completed the job trains nothing:
  // its loss and throughput are not measured, and are not reported as zeros.
  const bool trained = r.steps_run > 0;
  // The pipeline's timing leaves each run's first step out (buffers and connections warming
  // up), as samples/s does: a run of one step timed nothing (stage_ms empty), and says
  // nothing of its bubble.
  const bool timed = !r.stage_ms.empty();
  const std::optional<double> loss = trained ? std::optional<double>(r.final_loss) : std::nullopt;
  const std::optional<double> sps = r.samples_per_s > 0 ? std::optional<double>(r.samples_per_s) : std::nullopt;
  // Held-out results only where there was a held-out split; accuracy only for classification.
  const bool evaluated = r.eval_samples > 0, classifier = s.trainer->model.loss != "mse";
  const std::optional<double> evalAcc = evaluated && classifier ? std::optional<double>(r.eval_accuracy) : std::nullopt;
  const std::optional<double> evalLoss = evaluated ? std::optional<double>(r.eval_loss) : std::nullopt;
  const std::string evalText = !evaluated ? std::string("no held-out set to evaluate")
                               : classifier ? fmt::format("eval accuracy {:.2f}%", 100 * r.eval_accuracy)
                                            : fmt::format("eval loss {:.4g}", r.eval_loss);
  if (const char* path = std::getenv("DTRAIN_RESULT_FILE"); path && *path && comm->rank() == 0) {
    spec::TrainerOutcome o{loss, evalAcc, sps, r.steps, r.weights_sha256, s.trainer->parallel.pipeline_stages,
                           timed && r.pipeline_stages > 1 ? std::optional<double>(r.bubble_fraction) : std::nullopt,
                           timed ? r.stage_ms : std::vector<double>()};
    o.eval_loss = evalLoss;
    o.checkpoint = finalCheckpoint(*s.trainer, r.steps);  // (written at the end of every run with a checkpoint dir)
    spec::writeTrainerOutcome(path, o);
  }
  if (comm->rank() == 0 && r.pipeline_stages > 1 && timed) {
    std::string stages;
    for (size_t i = 0; i < r.stage_ms.size(); ++i) stages += fmt::format("{}{:.2f}", i ? "/" : "", r.stage_ms[i]);
    std::cout << fmt::format("pipeline: {} stages, compute ms/step per stage {}, bubble fraction {:.3f}", r.pipeline_stages,
                             stages, r.bubble_fraction)
              << std::endl;
  }
  if (comm->rank() == 0 && !trained)
    std::cout << fmt::format("trained: {} steps, all before this run (its checkpoint completes the job; nothing left to "
                             "train), {}, weights sha256 {}",
                             r.steps, evalText, r.weights_sha256)
              << std::endl;
  else if (comm->rank() == 0)
    std::cout << fmt::format("trained: {} steps, final loss {:.4f}, {}, {}, weights sha256 {}", r.steps, r.final_loss,
                             evalText,
                             sps ? fmt::format("{:.0f} samples/s", *sps) : std::string("too few steps to time"),
                             r.weights_sha256)
              << std::endl;
  return 0;
}

}  // namespace dtrain::app
