#pragma once
// The error of a run whose loss or weights stopped being finite: both trainers stop with it
// (exit 2, as bad input: the same spec diverges the same way again, so a restart cannot help).
#include <cmath>
#include <cstddef>
#include <string>

#include <fmt/format.h>

#include "dtrain/common/errors.h"
#include "dtrain/spec/job_spec.h"

namespace dtrain::train::detail {

inline bool allFinite(const float* v, size_t n) {
  for (size_t i = 0; i < n; ++i)
    if (!std::isfinite(v[i])) return false;
  return true;
}

inline SpecError divergedError(const spec::TrainerSpec& ts, long long step, const std::string& what) {
  std::string fix = fmt::format("lower /trainer/optimizer/lr (now {:g})", ts.optimizer.lr);
  if (ts.grad_clip_norm <= 0) fix += " or set /trainer/grad_clip_norm (e.g. 1.0)";
  // (at the first steps, file data with huge values (an mse target near 1e38) overflows
  // whatever the learning rate)
  if (step <= 2 && ts.data.type != "synthetic") fix += ", and check the data for values too large to square or sum";
  if (!ts.checkpoint.dir.empty())
    fix += fmt::format("; the next run resumes from the last checkpoint (the learning rate may change on resume), but "
                       "its weights may already be too large: if it diverges again, remove the checkpoints in {} or "
                       "use another checkpoint.dir",
                       ts.checkpoint.dir);
  return SpecError(fmt::format("trainer: training diverged at step {}: {}; {}", step, what, fix));
}

}  // namespace dtrain::train::detail
