#pragma once
#include <string>

namespace dtrain {

// Now in UTC, ISO 8601 with milliseconds: "2026-12-03T09:02:11.123Z".
std::string utcNow();

}  // namespace dtrain
