#include "dtrain/common/strings.h"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <limits>

#include "dtrain/common/errors.h"

namespace dtrain {
namespace {

// Whether s[i] is a UTF-8 continuation byte (10xxxxxx): not where a character starts.
bool utf8Continuation(std::string_view s, size_t i) {
  return i < s.size() && (static_cast<unsigned char>(s[i]) & 0xc0) == 0x80;
}

}  // namespace

size_t editDistance(std::string_view a, std::string_view b) {
  std::vector<size_t> prev(b.size() + 1), cur(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) prev[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    cur[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      size_t sub = prev[j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1);
      cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, sub});
    }
    std::swap(prev, cur);
  }
  return prev[b.size()];
}

std::string closestMatch(std::string_view word, const std::vector<std::string>& candidates) {
  std::string best;
  size_t bestDist = SIZE_MAX;
  for (const auto& c : candidates) {
    size_t d = editDistance(word, c);
    if (d < bestDist) {
      bestDist = d;
      best = c;
    }
  }
  // A typo changes a few characters; beyond a third of the word it is another word.
  size_t limit = std::max<size_t>(2, word.size() / 3);
  return bestDist <= limit ? best : std::string();
}

size_t utf8PrefixLength(std::string_view s, size_t max) {
  if (s.size() <= max) return s.size();
  size_t n = max;
  while (n > 0 && (static_cast<unsigned char>(s[n]) & 0xC0) == 0x80) --n;  // s[n]: the first byte left out
  return n;
}

std::string trim(std::string_view s) {
  const size_t b = s.find_first_not_of(" \t\r\n");
  if (b == std::string_view::npos) return "";
  return std::string(s.substr(b, s.find_last_not_of(" \t\r\n") - b + 1));
}

std::string elideLongWords(std::string_view s, size_t maxWord) {
  constexpr size_t kHead = 160, kTail = 40;
  maxWord = std::max(maxWord, kHead + kTail + 32);
  auto cont = [&](size_t i) { return utf8Continuation(s, i); };
  std::string out;
  out.reserve(std::min(s.size(), size_t{1} << 16));
  for (size_t i = 0; i < s.size();) {
    if (s[i] == ' ' || s[i] == '\n') {
      out += s[i];
      ++i;
      continue;
    }
    size_t end = s.find_first_of(" \n", i);
    if (end == std::string_view::npos) end = s.size();
    if (end - i <= maxWord) {
      out.append(s.substr(i, end - i));
    } else {
      size_t head = i + kHead, tail = end - kTail;
      while (head > i && cont(head)) --head;  // (at a character's first byte)
      while (tail < end && cont(tail)) ++tail;
      out.append(s.substr(i, head - i));
      out += fmt::format("...[{} bytes]...", tail - head);
      out.append(s.substr(tail, end - tail));
    }
    i = end;
  }
  return out;
}

std::string oneLine(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  auto cont = [&](size_t i) { return utf8Continuation(s, i); };
  for (size_t i = 0; i < s.size();) {
    const unsigned char ch = static_cast<unsigned char>(s[i]);
    if (ch < 0x80) {
      if (ch == '\n')
        out += "\\n";
      else if (ch == '\t')
        out += "\\t";
      else if (ch < 0x20 || ch == 0x7f)
        out += fmt::format("\\x{:02x}", ch);
      else
        out += static_cast<char>(ch);
      ++i;
      continue;
    }
    // A whole UTF-8 character passes as it is; a byte that is not part of one (a binary
    // file's header, Latin-1 text), and the C1 controls U+0080..U+009F (a terminal takes
    // U+009B for CSI), are shown as \xNN.
    const unsigned char next = i + 1 < s.size() ? static_cast<unsigned char>(s[i + 1]) : 0;
    size_t len = 0;
    if (ch >= 0xc2 && ch <= 0xdf && cont(i + 1))
      len = ch == 0xc2 && next <= 0x9f ? 0 : 2;
    else if (ch >= 0xe0 && ch <= 0xef && cont(i + 1) && cont(i + 2) && !(ch == 0xe0 && next < 0xa0) &&
             !(ch == 0xed && next >= 0xa0))
      len = 3;
    else if (ch >= 0xf0 && ch <= 0xf4 && cont(i + 1) && cont(i + 2) && cont(i + 3) && !(ch == 0xf0 && next < 0x90) &&
             !(ch == 0xf4 && next >= 0x90))
      len = 4;
    if (len == 0) {
      out += fmt::format("\\x{:02x}", ch);
      ++i;
      continue;
    }
    out.append(s.substr(i, len));
    i += len;
  }
  return out;
}

std::vector<std::string> split(std::string_view s, char sep) {
  std::vector<std::string> out;
  size_t start = 0;
  while (true) {
    size_t pos = s.find(sep, start);
    if (pos == std::string_view::npos) {
      out.emplace_back(s.substr(start));
      return out;
    }
    out.emplace_back(s.substr(start, pos - start));
    start = pos + 1;
  }
}

std::optional<bool> envSwitch(const char* name) {
  const char* v = std::getenv(name);
  return parseSwitch(name, v ? v : "");
}

std::optional<bool> parseSwitch(const std::string& name, const std::string& s) {
  if (s.empty()) return std::nullopt;
  if (s == "0" || s == "off" || s == "false" || s == "no") return false;
  if (s == "1" || s == "on" || s == "true" || s == "yes") return true;
  throw SpecError(fmt::format("{}=\"{}\": expected 0 or 1 (also off/on, false/true, no/yes)", name, s));
}

int envIndex(const char* name, int fallback) {
  const char* s = std::getenv(name);
  if (!s) return fallback;
  const std::string_view v(s);
  if (v.empty() || v.size() > 10 || !std::all_of(v.begin(), v.end(), [](char c) { return c >= '0' && c <= '9'; }))
    return fallback;
  const long long n = std::stoll(std::string(v));
  return n <= (1LL << 30) ? static_cast<int>(n) : fallback;
}

int parseIntFlag(const std::string& flag, const std::string& v, int lo, int hi) {
  size_t used = 0;
  long long out = 0;
  try {
    out = std::stoll(v, &used);
  } catch (...) {
    used = 0;
  }
  if (used != v.size() || v.empty() || out < lo || out > hi)
    throw SpecError(fmt::format("{}: expected an integer between {} and {}, got \"{}\"", flag, lo, hi, v));
  return static_cast<int>(out);
}

std::string formatBytes(uint64_t bytes) {
  const double b = static_cast<double>(bytes);
  if (bytes >= (1ull << 30)) return fmt::format("{:.1f} GiB", b / (1ull << 30));
  return fmt::format("{:.0f} MiB", b / (1ull << 20));
}

std::string signalName(int sig) {
  const char* abbrev = sigabbrev_np(sig);
  if (abbrev) return std::string("SIG") + abbrev;
  return fmt::format("SIG{}", sig);
}

std::string shellQuote(std::string_view word) {
  if (!word.empty() && word.find_first_of(" \t\n'\"\\$`*?[]{}()<>|&;#~!") == std::string_view::npos)
    return std::string(word);
  std::string out = "'";
  for (char c : word) {
    if (c == '\'')
      out += "'\\''";
    else
      out += c;
  }
  out += "'";
  return out;
}

size_t parseSize(const std::string& text, const std::string& what) {
  unsigned long long v = 0;
  const auto [ptr, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  // (digits first: no sign, no blank; a number beyond 2^64 is out of range below)
  const size_t used = ptr == text.data() ? 0 : static_cast<size_t>(ptr - text.data());
  if (ec == std::errc::result_out_of_range) v = std::numeric_limits<unsigned long long>::max();
  // Binary units, in either case (nccl-tests takes 4k as 4K): K, KiB, k, kib ...
  std::string unit = used ? text.substr(used) : "";
  for (char& c : unit) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  if (unit.size() == 3 && unit.compare(1, 2, "IB") == 0 && unit.find_first_of("KMGT") == 0) unit.resize(1);
  unsigned long long mult = unit.empty() || unit == "B" ? 1
                            : unit == "K"               ? 1ull << 10
                            : unit == "M"               ? 1ull << 20
                            : unit == "G"               ? 1ull << 30
                            : unit == "T"               ? 1ull << 40
                                                        : 0;
  if (!used || !mult)
    throw SpecError(fmt::format("{}: expected a size like 4096, 4K, 256M or 1G, got \"{}\"", what, text));
  // Wrapping past 2^64 would turn an absurd size into a small one without a word.
  if (v > (1ull << 50) / mult)
    throw SpecError(fmt::format("{}: \"{}\" is out of range; sizes go up to 1024T (2^50 bytes)", what, text));
  return static_cast<size_t>(v * mult);
}

int64_t parseInteger(const std::string& text, const std::string& what, int64_t lo, int64_t hi) {
  int64_t v = 0;
  const char* end = text.data() + text.size();
  auto [ptr, ec] = std::from_chars(text.data(), end, v);
  if (ptr != end || text.empty() || (ec != std::errc() && ec != std::errc::result_out_of_range))
    throw SpecError(fmt::format("{}: expected an integer from {} to {}, got \"{}\"", what, lo, hi, text));
  // from_chars reads every digit before it reports a range error, so a number too long for
  // int64 gets here and is refused, never clamped.
  if (ec == std::errc::result_out_of_range || v < lo || v > hi)
    throw SpecError(fmt::format("{}: {} is out of range; expected an integer from {} to {}", what, text, lo, hi));
  return v;
}

double parseSeconds(const std::string& text, const std::string& what, double max) {
  double v = 0;
  const char* end = text.data() + text.size();
  auto [ptr, ec] = std::from_chars(text.data(), end, v);
  if (ec != std::errc() || ptr != end || text.empty() || !std::isfinite(v) || v < 0 || v > max)
    throw SpecError(fmt::format("{}: expected seconds from 0 to {}, got \"{}\"", what, max, text));
  return v;
}

}  // namespace dtrain
