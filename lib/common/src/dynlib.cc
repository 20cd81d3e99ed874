#include "dtrain/common/dynlib.h"

#include <dlfcn.h>
#include <unistd.h>

#include <fmt/format.h>

namespace dtrain {

void* openLibrary(const std::vector<std::string>& candidates, const char* symbol, std::string* errors) {
  std::string why;
  for (const std::string& path : candidates) {
    if (!why.empty()) why += "; ";
    void* h = ::dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (!h) {
      const char* e = ::dlerror();
      // dlerror names the file already ("x.so: cannot open shared object file: ...").
      why += e ? e : path + ": cannot be loaded";
      continue;
    }
    if (::dlsym(h, symbol)) return h;
    why += fmt::format("{}: has no {} (a stale or foreign build?)", path, symbol);
    ::dlclose(h);
  }
  if (errors) *errors = why;
  return nullptr;
}

std::vector<std::string> pluginCandidates(const std::string& file) {
  char exe[4096];
  const ssize_t n = ::readlink("/proc/self/exe", exe, sizeof(exe) - 1);
  if (n <= 0) return {file};
  std::string dir(exe, static_cast<size_t>(n));
  dir = dir.substr(0, dir.rfind('/') + 1);
  return {dir + file, dir + "../lib/" + file, file};
}

}  // namespace dtrain
