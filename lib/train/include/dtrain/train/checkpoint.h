#pragma once
// Checkpoints of the built-in trainer. A file holds everything that shapes the rest of the
// run: weights, optimizer state, epoch, the global sample cursor within the epoch, step and
// a hash of the config. The data order and samples are functions of (seed, epoch, index),
// so there is no RNG state to save.
//
// Format (native byte order; same architecture to resume):
//   "DTRCKPT1" | u64 payload bytes | payload | SHA-256 of payload (32 bytes)
// payload: config hash, step, epoch, cursor, world, params, optimizer state, then the config
// in words (u64 count, then per part u64 bytes + text; absent in files of dtrain before it,
// which skips files that have it as malformed): so that a refusal can say what changed;
// then sections, each an 8-byte tag, u64 bytes and the bytes, a tag this reader does not
// know skipped (dtrain before sections skips files that have any as malformed):
//   "LRSCHED1": the LR schedule's ScheduleState (lr_schedule.h): u64 samples, reference
//   batch, global batch, anchor samples, f64 anchor progress. Absent in older files: the
//   resume derives it (legacyScheduleState).
// Written atomically: a temporary file, fsync, rename, fsync of the directory.
#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "dtrain/common/fd.h"
#include "dtrain/spec/job_spec.h"
#include "dtrain/train/lr_schedule.h"

namespace dtrain::train {

struct TrainState {
  uint64_t config_hash = 0;
  long long step = 0;      // global steps done
  long long epoch = 0;     // epoch to continue in
  uint64_t cursor = 0;     // samples of that epoch's order already used (all ranks)
  long long world = 0;     // world size that wrote it (information)
  std::vector<float> params, momentum;
  // configDescription() of the config that wrote it; empty in files from before it was kept.
  std::vector<std::string> config;
  // Where the LR schedule stood; nullopt in files from before it was kept.
  std::optional<ScheduleState> schedule;
  // The training set's rows when it was written (an epoch's order is a permutation of
  // them); 0 in files from before it was kept.
  uint64_t train_rows = 0;
};

// Hash of the settings a checkpoint must agree with (model, data, optimizer kind, seeds);
// batch size and world size may change between runs. For csv and idx data it covers the
// training files (their absolute paths, the labels file, label_column, header) too.
uint64_t configHash(const spec::TrainerSpec& t);

// What configHash covers, in words, one "part: value" per part (model, data, optimizer,
// seed): kept in checkpoints so that a refusal can name what changed.
std::vector<std::string> configDescription(const spec::TrainerSpec& t);

// Why the checkpoint `s` (read from `path`) cannot be resumed by `t`: "" when it can. Names
// what changed when the file keeps its config's description, else what the sizes tell.
// `params` = this spec's parameter count where the checkpoint holds the whole model (the
// data-parallel trainer), 0 when it cannot be told (a pipeline stage).
std::string checkpointMismatch(const spec::TrainerSpec& t, const TrainState& s, const std::string& path, size_t params);

// The trainer's own refusal of a checkpoint of another config (a race with the check below,
// or a node 0 whose host was not checked): `detail` is checkpointMismatch()'s text (rank 0's,
// on every rank: detail::shareText), with the fix (remove all of them, not the newest).
std::string checkpointRefusal(const spec::TrainerSpec& t, const std::string& detail);

// Checkpoints of another layout in t.checkpoint.dir: the data-parallel trainer writes
// DIR/ckpt-*.bin, a pipeline of P stages DIR/stage-<p>-of-<P>/ckpt-*.bin and
// DIR/manifest.json, so a job of another layout would not find them and would train from
// step 0 beside them. "" when there are none; else one line, "<file> (step N) was written by
// <that layout>, this job is <this one>; <fix>", naming what to set or remove. Only an
// intact checkpoint counts (its checksum verified; junk named like one does not), or, for a
// pipeline job, a manifest naming another pipeline layout. A manifest that cannot be read
// is reported through `warn` (pipeline jobs only: it is the pipeline's own file) and skipped.
std::string checkpointLayoutMismatch(const spec::TrainerSpec& t, const std::function<void(const std::string&)>& warn = {});

// The trainer's refusal for checkpointLayoutMismatch() (exit 2 on every rank): `detail` is
// its text, rank 0's on every rank (detail::shareText).
std::string checkpointLayoutRefusal(const std::string& detail);

// A pipeline job whose stage `heldNone[p]` holds no intact checkpoint while others do: every
// stage would start over from step 0 (the run stopped before that stage's first save). But
// when the directory's manifest says every stage wrote a step, that stage's files were lost
// after the fact (removed, damaged), and starting over would throw the step away without a
// word. "" when that is not so (no readable manifest of this layout, or it names no step);
// else one line naming the manifest's step and the lost file, with the fix.
std::string stageFilesLost(const spec::TrainerSpec& t, const std::vector<bool>& heldNone);

// Rank 0's line on resuming from `path`; header = {status, step, epoch, cursor, world}.
// `complete`: the checkpoint leaves nothing to train (said so, not "epoch 3" of 2).
std::string resumeLine(const std::string& path, const int64_t header[5], int world, bool complete,
                       const spec::TrainerSpec& t);

// Before any worker starts (dtrain run for a local node 0, the agent of the first node,
// dtrain train run by hand): creates trainer.checkpoint.dir as mkdir -p does, checks that a
// file can be written in it, that it holds no checkpoints of another layout
// (checkpointLayoutMismatch: SpecError "<source>: /trainer/parallel/pipeline_stages: ..."), and
// that its newest valid checkpoint (each stage's, for a pipeline) was written by this config.
// Throws SpecError "<source>: /trainer/checkpoint/dir: ..." with the fix. Nothing to do
// without a checkpoint dir.
//
// Also takes the directory's lock (flock on DIR/.dtrain.lock, which names its holder), held
// by the returned Fd for as long as the caller keeps it: the job's lifetime. A directory
// another job holds is refused (SpecError naming the holder): two jobs writing one directory
// would overwrite each other's ckpt-<step>.bin.tmp and prune each other's checkpoints. The
// lock goes with its process, however that ends; workers do not inherit it (close-on-exec).
// `lockWaitS`: how long a held lock is waited for before the refusal (an agent started again
// on node 0 while its predecessor still tears down). A file system without flock: a warning
// on stderr, and an empty Fd.
[[nodiscard]] Fd prepareCheckpointDir(const spec::TrainerSpec& t, const std::string& source, double lockWaitS = 0);

// Why the job must not restart its workers with the lock `lock` (prepareCheckpointDir's):
// t.checkpoint.dir was removed, or moved away, since it was taken, so its lock file is no
// longer the one held. The workers would make the directory again and train beside whatever
// job took it meanwhile (the writer stops a running job at its next save; this covers a
// worker that failed first). "" when the lock is still the directory's, or none is held.
std::string checkpointLockLost(const spec::TrainerSpec& t, const Fd& lock);

// What saveCheckpoint writes, the arrays by reference: the trainer's own buffers are written
// as they are (a TrainState built for the write copied the weights and optimizer state).
struct CheckpointView {
  uint64_t config_hash = 0;
  long long step = 0;
  long long epoch = 0;
  uint64_t cursor = 0;
  long long world = 0;
  std::span<const float> params, momentum;
  std::vector<std::string> config;
  std::optional<ScheduleState> schedule;  // (nullopt: no section; tests of older files)
  uint64_t train_rows = 0;                // (0: no section)
};

// Writes dir/ckpt-<step>.bin and keeps the newest `keep` valid checkpoints (by a header
// check), never the one just written; files named like checkpoints that are not ours are
// left alone, reported through `warn` once per file and process. `progress` is called as
// the write goes (every 64 MiB), for a watchdog. Returns the path.
std::string saveCheckpoint(const std::string& dir, const CheckpointView& s, int keep = 3,
                           const std::function<void(const std::string&)>& warn = {},
                           const std::function<void()>& progress = {});
std::string saveCheckpoint(const std::string& dir, const TrainState& s, int keep = 3,
                           const std::function<void(const std::string&)>& warn = {},
                           const std::function<void()>& progress = {});
// As saveCheckpoint, every file made, renamed, synced and pruned through `dirFd`, an open
// descriptor of `dir` (which must exist; `dir` only names the files in messages and the path
// returned): a directory swapped in under `dir`'s name meanwhile gets none of this job's
// files (they go where the held directory is now). Reads the directory through a duplicate
// of `dirFd`, whose offset it shares: give it a descriptor of its own.
std::string saveCheckpointAt(int dirFd, const std::string& dir, const CheckpointView& s, int keep = 3,
                             const std::function<void(const std::string&)>& warn = {},
                             const std::function<void()>& progress = {});

// Why a checkpoint written when the training set had `checkpointRows` rows cannot be
// resumed with `rows` (the data file changed, or eval_path was added or removed): the line
// the trainer's SpecError carries; "" when the counts agree or the checkpoint kept none (0).
std::string trainRowsMismatch(const spec::TrainerSpec& t, uint64_t rows, uint64_t checkpointRows,
                              const std::string& checkpoint);

// The file saveCheckpoint writes for `step` in `dir`.
std::string checkpointPath(const std::string& dir, long long step);

// The file a next run of `t` resumes from once step `step` is saved: the data-parallel
// trainer's checkpoint (checkpointPath), or a pipeline's manifest.json; "" without a dir.
std::string resumeFile(const spec::TrainerSpec& t, long long step);

// Whether `dir` holds any file named like a checkpoint, its own or a pipeline stage's
// (stage-<p>-of-<P>/): a cheap look (names only) for a first run's empty directory.
bool holdsCheckpointFiles(const std::string& dir);

// The trainer's line for a checkpoint it could not write (saveCheckpoint's IoError `error`:
// a full disk, a read-only mount, a directory that went away), thrown as a SpecError (exit 2,
// not restarted: every attempt would train to the same step and fail the same way). Names the
// directory, the OS error and the fix; the checkpoints written before are intact.
std::string checkpointWriteRefusal(const std::string& dir, long long step, const std::string& error);

// The newest checkpoint that reads back intact; damaged ones are reported through `warn`
// and skipped, never loaded. nullopt when there is none. maxStep >= 0: the newest at or
// before that step (the pipeline trainer's stages agree on a common step this way).
std::optional<TrainState> loadLatestCheckpoint(const std::string& dir, const std::function<void(const std::string&)>& warn,
                                               std::string* path = nullptr, long long maxStep = -1);

}  // namespace dtrain::train
