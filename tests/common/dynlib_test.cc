#include "dtrain/common/dynlib.h"

#include <dlfcn.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <climits>

namespace dtrain {
namespace {

TEST(Dynlib, OpensTheFirstCandidateThatHasTheSymbol) {
  std::string errors = "untouched";
  // The first does not exist, the second lacks the symbol, the third has it.
  void* h = openLibrary({"libdtrain_no_such_library.so", "libm.so.6", "libc.so.6"}, "getpid", &errors);
  ASSERT_NE(h, nullptr);
  using GetPid = pid_t (*)();
  EXPECT_EQ(reinterpret_cast<GetPid>(::dlsym(h, "getpid"))(), ::getpid());
  EXPECT_EQ(errors, "untouched");  // only written on failure
}

TEST(Dynlib, SaysWhyEachCandidateFailed) {
  std::string errors;
  EXPECT_EQ(openLibrary({"libdtrain_no_such_library.so", "libm.so.6"}, "dtrain_no_such_symbol", &errors), nullptr);
  EXPECT_NE(errors.find("libdtrain_no_such_library.so: cannot open shared object file"), std::string::npos) << errors;
  EXPECT_NE(errors.find("; libm.so.6: has no dtrain_no_such_symbol"), std::string::npos) << errors;
  EXPECT_EQ(openLibrary({}, "x", &errors), nullptr);
  EXPECT_EQ(errors, "");
}

TEST(Dynlib, PluginsAreLookedForNextToTheExecutable) {
  char exe[PATH_MAX];
  const ssize_t n = ::readlink("/proc/self/exe", exe, sizeof(exe) - 1);
  ASSERT_GT(n, 0);
  std::string dir(exe, static_cast<size_t>(n));
  dir = dir.substr(0, dir.rfind('/') + 1);
  EXPECT_EQ(pluginCandidates("libx.so"), (std::vector<std::string>{dir + "libx.so", dir + "../lib/libx.so", "libx.so"}));
}

}  // namespace
}  // namespace dtrain
