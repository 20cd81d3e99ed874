#include "dtrain/train/lr_schedule.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "dtrain/train/trainer.h"

namespace dtrain::train {
namespace {

// a x b, or the largest uint64 when that overflows (a warm-up or decay period that long is
// never reached).
uint64_t productOrMax(uint64_t a, uint64_t b) {
  uint64_t r = 0;
  return __builtin_mul_overflow(a, b, &r) ? std::numeric_limits<uint64_t>::max() : r;
}

uint64_t warmupEnd(const spec::TrainerSpec& ts, const LrSchedule& s) {
  return productOrMax(static_cast<uint64_t>(ts.lr_schedule.warmup_steps), s.reference_batch);
}

// The cosine's progress (0..1) at `samples`, at or past the warm-up's end.
double cosineProgress(const spec::TrainerSpec& ts, const LrSchedule& s, uint64_t samples) {
  const bool anchored = s.anchor_samples != 0;
  const auto from = static_cast<int64_t>(anchored ? s.anchor_samples : warmupEnd(ts, s));
  const double start = anchored ? s.anchor_progress : 0.0;
  // (at least one step: a plan that ends within the warm-up has no cosine to speak of)
  const int64_t span = std::max(static_cast<int64_t>(s.global_batch), static_cast<int64_t>(s.end_samples) - from);
  const double q = static_cast<double>(static_cast<int64_t>(samples) - from) / static_cast<double>(span);
  // (without an anchor 0 + 1 * q is q exactly: the step-based value)
  return std::clamp(start + (1 - start) * q, 0.0, 1.0);
}

}  // namespace

double learningRate(const spec::TrainerSpec& ts, const LrSchedule& s, uint64_t samples) {
  const auto& sc = ts.lr_schedule;
  const double base = ts.optimizer.lr;
  if (sc.type == "step") {
    const uint64_t every = productOrMax(static_cast<uint64_t>(sc.step_size), s.reference_batch);
    return base * std::pow(sc.gamma, static_cast<double>(samples / every));
  }
  if (sc.type == "warmup_cosine") {
    if (samples < warmupEnd(ts, s)) {
      // Reference steps done at the end of this step (step + 1 at one global batch), the
      // warm-up's length at most (a larger step may cross its end).
      const double done = std::min(static_cast<double>(samples + s.global_batch) / static_cast<double>(s.reference_batch),
                                   static_cast<double>(sc.warmup_steps));
      return base * done / static_cast<double>(sc.warmup_steps);
    }
    const double progress = cosineProgress(ts, s, samples);
    return sc.min_lr + (base - sc.min_lr) * 0.5 * (1 + std::cos(3.141592653589793 * progress));
  }
  return base;
}

double learningRate(const spec::TrainerSpec& ts, long long step, long long totalSteps) {
  LrSchedule s;
  s.end_samples = static_cast<uint64_t>(std::max(0ll, totalSteps));
  return learningRate(ts, s, static_cast<uint64_t>(std::max(0ll, step)));
}

LrSchedule planSchedule(const spec::TrainerSpec& ts, const ScheduleState* resumed, long long step, int epoch,
                        uint64_t cursor, uint64_t datasetSamples, uint64_t globalBatch) {
  LrSchedule s;
  s.global_batch = globalBatch;
  s.reference_batch = resumed && resumed->reference_batch > 0 ? resumed->reference_batch : globalBatch;
  const uint64_t samples = resumed ? resumed->samples : 0;
  if (resumed) {
    s.anchor_samples = resumed->anchor_samples;
    s.anchor_progress = resumed->anchor_progress;
  }
  // Samples trained when the plan at global batch g ends (a max_steps below `step`: now).
  auto endAt = [&](uint64_t g) {
    const long long left = std::max(0ll, plannedSteps(ts, step, epoch, cursor, datasetSamples, g) - step);
    return samples + static_cast<uint64_t>(left) * g;
  };
  s.end_samples = endAt(globalBatch);
  if (resumed && resumed->global_batch > 0 && resumed->global_batch != globalBatch && samples >= warmupEnd(ts, s)) {
    // Another global batch moves the end: the cosine goes on from the progress it has at the
    // checkpoint under the plan of the batch that wrote it (this spec's epochs and max_steps).
    LrSchedule before = s;
    before.global_batch = resumed->global_batch;
    before.end_samples = endAt(resumed->global_batch);
    s.anchor_progress = cosineProgress(ts, before, samples);
    s.anchor_samples = samples;
  }
  return s;
}

ScheduleState legacyScheduleState(long long step, uint64_t globalBatch) {
  ScheduleState st;
  st.samples = static_cast<uint64_t>(std::max(0ll, step)) * globalBatch;
  st.reference_batch = st.global_batch = globalBatch;
  return st;
}

ScheduleState scheduleState(const LrSchedule& s, uint64_t samples) {
  return {samples, s.reference_batch, s.global_batch, s.anchor_samples, s.anchor_progress};
}

}  // namespace dtrain::train

namespace dtrain::train::detail {

void scheduleToWords(const ScheduleState& s, int64_t* w) {
  w[0] = static_cast<int64_t>(s.samples);
  w[1] = static_cast<int64_t>(s.reference_batch);
  w[2] = static_cast<int64_t>(s.global_batch);
  w[3] = static_cast<int64_t>(s.anchor_samples);
  std::memcpy(&w[4], &s.anchor_progress, sizeof(double));
}

ScheduleState scheduleFromWords(const int64_t* w) {
  ScheduleState s;
  s.samples = static_cast<uint64_t>(w[0]);
  s.reference_batch = static_cast<uint64_t>(w[1]);
  s.global_batch = static_cast<uint64_t>(w[2]);
  s.anchor_samples = static_cast<uint64_t>(w[3]);
  std::memcpy(&s.anchor_progress, &w[4], sizeof(double));
  return s;
}

}  // namespace dtrain::train::detail
