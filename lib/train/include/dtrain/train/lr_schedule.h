#pragma once
// The learning-rate schedule (trainer.lr_schedule), run on samples trained rather than on
// steps: a run resumed at another world size (another global batch) goes on where the
// schedule was, instead of jumping to where the new step count puts it. At one global batch
// throughout, samples = step x global batch and every formula gives the step-based value bit
// for bit (the quotients below are of exact integers whose ratio is the step-based one, and a
// correctly rounded division of the same exact ratio is the same double).
//
// - warmup_steps and step_size count steps of the reference batch: the global batch of the
//   training's first step (batch_size x data-parallel workers then). After a change of global
//   batch the warm-up still ends, and the step schedule still decays, after the same number
//   of samples.
// - warmup_cosine's cosine ends (at min_lr) when the run's plan ends: at the last step the
//   remaining epochs (or max_steps, a cap in steps) give at the current global batch. A
//   resume at another global batch moves that end; the cosine then goes on from the progress
//   it had reached (its anchor) and covers the rest, linearly in samples, up to the new end,
//   so the learning rate has no jump. A resume at the same global batch keeps the anchor and
//   plans as before: a change of epochs or max_steps then re-plans the cosine as if the new
//   length had been the plan (as a step-based schedule does).
#include <cstdint>

#include "dtrain/spec/job_spec.h"

namespace dtrain::train {

// Where the schedule stands, kept in every checkpoint (TrainState::schedule).
struct ScheduleState {
  uint64_t samples = 0;          // samples trained since step 0 (each step's global batch, summed)
  uint64_t reference_batch = 0;  // the global batch of step 0: warmup_steps and step_size count its steps
  uint64_t global_batch = 0;     // the global batch of the run that wrote it
  // The cosine's progress (0..1) at anchor_samples, set by a resume at another global batch;
  // anchor_samples 0 = none (an anchor is a resume point, never before the first step): the
  // cosine runs from the end of the warm-up.
  uint64_t anchor_samples = 0;
  double anchor_progress = 0;
  bool operator==(const ScheduleState&) const = default;
};

// One run's schedule: ScheduleState's constants and the end of this run's plan.
struct LrSchedule {
  uint64_t reference_batch = 1;
  uint64_t global_batch = 1;
  uint64_t end_samples = 0;  // samples trained at the last planned step's end: the cosine reaches min_lr there
  uint64_t anchor_samples = 0;
  double anchor_progress = 0;
};

// The learning rate of the step that starts with `samples` trained.
double learningRate(const spec::TrainerSpec& ts, const LrSchedule& s, uint64_t samples);

// The step-based form: 0-based `step` of `totalSteps` at one global batch throughout (what
// learningRate above gives with samples counted in steps).
double learningRate(const spec::TrainerSpec& ts, long long step, long long totalSteps);

// The schedule of a run that starts at `step`, (epoch, cursor) with `globalBatch`, of a
// training set of `datasetSamples`: from `resumed` (the checkpoint's state), or fresh when
// it is null. The run's end comes from plannedSteps (trainer.h).
LrSchedule planSchedule(const spec::TrainerSpec& ts, const ScheduleState* resumed, long long step, int epoch,
                        uint64_t cursor, uint64_t datasetSamples, uint64_t globalBatch);

// The state of a checkpoint from before the schedule was kept in them: a run at one global
// batch, `globalBatch` (the checkpoint's data-parallel world x the spec's batch_size: the
// batch size it was written with is not known), up to `step`.
ScheduleState legacyScheduleState(long long step, uint64_t globalBatch);

// What a checkpoint written with `samples` trained under `s` keeps.
ScheduleState scheduleState(const LrSchedule& s, uint64_t samples);

}  // namespace dtrain::train

namespace dtrain::train::detail {

// ScheduleState as 5 int64 words, for the resume header the ranks share (the progress's bits
// as they are).
void scheduleToWords(const ScheduleState& s, int64_t* words);
ScheduleState scheduleFromWords(const int64_t* words);

}  // namespace dtrain::train::detail
