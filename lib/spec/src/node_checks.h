#pragma once
// Checks shared by the three ways of naming nodes (spec "nodes", hostfiles, --hosts).
// Internal to lib/spec. Each check returns "" when the value is fine, else the problem,
// phrased so that the caller only has to prefix where it was found.
#include <string>
#include <vector>

#include "dtrain/spec/job_spec.h"

namespace dtrain::spec::detail {

// Host names, users and addresses end up on ssh command lines: only the characters of
// host names, IPv4/IPv6 literals (':' and '%' for a scope) and login names are accepted,
// and nothing may start with '-' (it would read as an ssh option).
std::string hostProblem(const std::string& host);
std::string userProblem(const std::string& user);

// True for a non-empty string of decimal digits only ("2": not a host name).
bool allDigits(const std::string& s);

// "1".."4096" -> slots; -1 when the text is not such a count.
int parseSlotCount(const std::string& text);

// "0,1,3" -> GPU indices; "" when fine, else the problem (bad index, duplicate).
std::string parseGpuList(const std::string& text, std::vector<int>& out);

// Index of an earlier entry naming the same host (case-insensitive) and ssh port, or -1.
// Two entries may name one machine with different ports (containers behind one address).
int findDuplicate(const std::vector<NodeSpec>& nodes, const NodeSpec& n);

// Sets NodeSpec::local for every node (isLocalHost, with all name lookups at once under one
// deadline rather than one per host).
void markLocal(std::vector<NodeSpec>& nodes);

// Off: names that would need a DNS lookup count as remote, without one (the fuzz target:
// random names must not reach the resolver). On by default; thread-safe.
void setNameLookups(bool enabled);

// `host "h1"` or `host "h1" (port 2222)`, for messages.
std::string hostLabel(const NodeSpec& n);

}  // namespace dtrain::spec::detail
