#pragma once
#include <string>
#include <string_view>
#include <vector>

namespace dtrain {

// Edit distance, for did-you-mean suggestions.
size_t editDistance(std::string_view a, std::string_view b);

// The candidate closest to `word`, or "" when none is close enough to be a likely typo.
std::string closestMatch(std::string_view word, const std::vector<std::string>& candidates);

std::vector<std::string> split(std::string_view s, char sep);

// Name of a signal without its number: "SIGSEGV". Unknown signals read "SIG<n>".
std::string signalName(int sig);

// Quotes an argv word for display in a shell-like way, only when needed.
std::string shellQuote(std::string_view word);

// "4096", "4K", "256M", "1G" (powers of 1024) -> bytes. Throws SpecError naming `what`.
size_t parseSize(const std::string& text, const std::string& what);

}  // namespace dtrain
