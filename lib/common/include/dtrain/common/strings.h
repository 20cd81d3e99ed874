#pragma once
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace dtrain {

// Edit distance, for did-you-mean suggestions.
size_t editDistance(std::string_view a, std::string_view b);

// The candidate closest to `word`, or "" when none is close enough to be a likely typo.
std::string closestMatch(std::string_view word, const std::vector<std::string>& candidates);

std::vector<std::string> split(std::string_view s, char sep);

// s without the blanks (spaces, tabs, CR, LF) at either end.
std::string trim(std::string_view s);

// s as one line for a message: newline and tab as \n and \t, other control characters (a NUL
// in a file's header, the C1 controls) and bytes that are not valid UTF-8 as \xNN; UTF-8
// characters as they are.
std::string oneLine(std::string_view s);

// s with each run of more than `maxWord` bytes without a space or a newline (a value quoted whole: a
// 100 KB string given for a number, a path of a generated name) cut to its first and last
// bytes around "...[N bytes]...": an error line stays readable on a terminal and in a CI
// log, and keeps the place and the fix around the value. UTF-8 characters are not split.
std::string elideLongWords(std::string_view s, size_t maxWord = 400);

// The length of the longest prefix of s, at most max bytes, that does not end inside a UTF-8
// character (for cutting text to fit).
size_t utf8PrefixLength(std::string_view s, size_t max);

// Name of a signal without its number: "SIGSEGV". Unknown signals read "SIG<n>".
std::string signalName(int sig);

// "1.5 GiB", "300 MiB": a size for messages.
std::string formatBytes(uint64_t bytes);

// An on/off environment variable (DTRAIN_COMM_SHM, DTRAIN_DATA_SHARE): 0/off/false/no or
// 1/on/true/yes; nullopt when unset or empty. Throws SpecError naming the variable and the
// accepted values for anything else.
std::optional<bool> envSwitch(const char* name);
// The same for a value given elsewhere (a job spec's env): `name`=`value`.
std::optional<bool> parseSwitch(const std::string& name, const std::string& value);

// A count or index from the environment (LOCAL_RANK, LOCAL_WORLD_SIZE): a decimal integer
// in [0, 2^30] and nothing else; `fallback` when unset, empty or malformed. For values dtrain
// sets itself, read where a hand-run worker may lack them: every reader must agree (the
// trainer and the NCCL backend pick the same GPU from one LOCAL_RANK).
int envIndex(const char* name, int fallback);

// Quotes an argv word for display in a shell-like way, only when needed.
std::string shellQuote(std::string_view word);

// A command-line flag's integer in [lo, hi]; throws SpecError "<flag>: expected an integer
// between lo and hi, got "<v>"" for anything else (a sign where none fits, a fraction, junk).
int parseIntFlag(const std::string& flag, const std::string& v, int lo, int hi);

// "4096", "4K", "256M", "1G" (powers of 1024) -> bytes. Throws SpecError naming `what`.
size_t parseSize(const std::string& text, const std::string& what);

// A decimal integer in [lo, hi], nothing else: no base prefixes ("010" is ten, "0x10" is
// refused), no trailing text, and out-of-range values are refused rather than clamped.
// Throws SpecError naming `what` (the flag or argument).
int64_t parseInteger(const std::string& text, const std::string& what, int64_t lo = std::numeric_limits<int64_t>::min(),
                     int64_t hi = std::numeric_limits<int64_t>::max());

// Decimal seconds in [0, max] ("2", "0.5"); no "inf" or "nan". Throws SpecError naming `what`.
double parseSeconds(const std::string& text, const std::string& what, double max);

}  // namespace dtrain
