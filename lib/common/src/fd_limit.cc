#include "dtrain/common/fd_limit.h"

#include <algorithm>

namespace dtrain {
namespace {

std::optional<rlimit> found;

}  // namespace

void raiseFdLimit() {
  rlimit cur{};
  if (::getrlimit(RLIMIT_NOFILE, &cur) != 0) return;
  const rlim_t want = cur.rlim_max == RLIM_INFINITY ? kFdLimitWanted : std::min<rlim_t>(cur.rlim_max, kFdLimitWanted);
  if (cur.rlim_cur != RLIM_INFINITY && cur.rlim_cur >= want) return;
  if (cur.rlim_cur == RLIM_INFINITY) return;
  rlimit raised = cur;
  raised.rlim_cur = want;
  if (::setrlimit(RLIMIT_NOFILE, &raised) == 0) found = cur;
}

std::optional<rlimit> fdLimitToRestore() { return found; }

}  // namespace dtrain
