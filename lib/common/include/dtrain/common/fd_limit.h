// The limit on open descriptors of dtrain's processes, and of what they start.
#pragma once

#include <sys/resource.h>

#include <optional>

namespace dtrain {

// Raises this process's soft RLIMIT_NOFILE toward its hard limit (at most kFdLimitWanted):
// a launcher holds a log file and pipes per rank, and the usual 1024 runs out near a thousand
// ranks. Remembers the limit it found, for fdLimitToRestore. Call once, early, from the main
// thread; a limit that cannot be raised is left as it is.
void raiseFdLimit();
// The soft limit found before raiseFdLimit raised it (nullopt: not raised), which the
// programs dtrain starts get back: one that uses select() fails past 1024 descriptors.
std::optional<rlimit> fdLimitToRestore();

constexpr rlim_t kFdLimitWanted = 1 << 16;

}  // namespace dtrain
