#pragma once
// Libraries loaded on first use instead of linked: OpenBLAS, cudart's device probe, and
// dtrain's GPU plugins (cuBLAS and NCCL cost every dtrain process milliseconds to half a
// second at start-up, and a CUDA build must still run on hosts without them).
#include <string>
#include <vector>

namespace dtrain {

// dlopen (RTLD_NOW | RTLD_LOCAL) of the first candidate that loads and defines `symbol`. The
// handle is never closed: the library's code stays in use for the life of the process.
// Returns nullptr when none does, with each candidate's reason in *errors ("a: why; b: why").
// Thread-safe (dlopen is).
void* openLibrary(const std::vector<std::string>& candidates, const char* symbol, std::string* errors);

// Where one of dtrain's own plugins (built next to the binary) is looked for: the directory
// of the running executable, its ../lib, then the dynamic loader's search path.
std::vector<std::string> pluginCandidates(const std::string& file);

}  // namespace dtrain
