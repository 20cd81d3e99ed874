#include "progress.h"

#include <algorithm>
#include <cmath>

#include <fmt/format.h>

namespace dtrain::train::detail {

std::string fmtDuration(double s) {
  if (s < 60) return fmt::format("{:.0f}s", s);
  return fmt::format("{:.0f}m{:02.0f}s", std::floor(s / 60), std::fmod(s, 60));
}

Progress::Progress(long long firstStep, long long totalSteps, uint64_t globalBatch)
    : firstStep_(firstStep), totalSteps_(totalSteps), globalBatch_(static_cast<double>(globalBatch)) {}

void Progress::stepDone(long long step) {
  if (step == firstStep_ + 1) afterFirst_ = Clock::now();
}

double Progress::samplesPerSecond(long long step) const {
  const double elapsed = std::chrono::duration<double>(Clock::now() - afterFirst_).count();
  return step > firstStep_ + 1 && elapsed > 0 ? static_cast<double>(step - firstStep_ - 1) * globalBatch_ / elapsed : 0;
}

std::string rateText(double samplesPerSecond) {
  return samplesPerSecond > 0 ? fmt::format("{:.0f} samples/s", samplesPerSecond) : std::string("- samples/s");
}

std::string msText(double ms) {
  return ms >= 10 ? fmt::format("{:.1f}", ms) : ms >= 0.1 ? fmt::format("{:.2f}", ms) : fmt::format("{:.3f}", ms);
}

std::string Progress::eta(long long step) const {
  const double sps = samplesPerSecond(step);
  if (step >= totalSteps_) return fmtDuration(0);
  // Not measured yet (the first step is left out of the rate): "?", not a confident 0s.
  return sps > 0 ? fmtDuration(static_cast<double>(totalSteps_ - step) * globalBatch_ / sps) : std::string("?");
}

bool Progress::statusDue(long long step) {
  const auto now = Clock::now();
  if (now - lastStatus_ <= std::chrono::milliseconds(200) && step != totalSteps_) return false;
  lastStatus_ = now;
  return true;
}

std::string Progress::bar(long long step) const {
  const double frac = static_cast<double>(step) / static_cast<double>(std::max<long long>(1, totalSteps_));
  const int filled = std::clamp(static_cast<int>(frac * 30), 0, 30);
  // Rounded down: 100% only when every step is done (622 of 624 is 99%).
  return fmt::format("[{}{}] {:3.0f}% step {}/{}", std::string(static_cast<size_t>(filled), '#'),
                     std::string(static_cast<size_t>(30 - filled), '.'), std::floor(100 * frac), step, totalSteps_);
}

}  // namespace dtrain::train::detail
