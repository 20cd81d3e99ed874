#include "dtrain/store/store.h"

#include <charconv>

#include <fmt/format.h>

namespace dtrain::store {

std::string describeWaitTimeout(Duration waited, const std::vector<std::string>& missing) {
  std::vector<std::string> quoted;
  for (size_t i = 0; i < missing.size() && i < 8; ++i) quoted.push_back("'" + missing[i] + "'");
  if (missing.size() > 8) quoted.push_back(fmt::format("and {} more", missing.size() - 8));
  return fmt::format("timed out after {:.3g} s waiting for key{} {}", waited.count() / 1000.0,
                     missing.size() == 1 ? "" : "s", fmt::join(quoted, ", "));
}

int64_t parseCounter(const std::string& key, const Bytes& value) {
  int64_t v = 0;
  auto [ptr, ec] = std::from_chars(value.data(), value.data() + value.size(), v);
  if (ec != std::errc() || ptr != value.data() + value.size() || value.empty())
    throw NotIntegerError(fmt::format("add on key '{}': its value is not an integer; set it to a decimal number "
                                      "or count under another key", key));
  return v;
}

int64_t addToCounter(const std::string& key, const Bytes* current, int64_t delta) {
  int64_t cur = current ? parseCounter(key, *current) : 0;
  int64_t sum = 0;
  if (__builtin_add_overflow(cur, delta, &sum))
    throw OutOfRangeError(fmt::format("add on key '{}': {} + {} would overflow int64; the value is unchanged", key,
                                      cur, delta));
  return sum;
}

}  // namespace dtrain::store
