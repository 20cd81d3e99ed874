#include "dtrain/common/dynlib.h"

#include <dlfcn.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <climits>

namespace dtrain {
namespace {

TEST(Dynlib, OpensTheFirstCandidateThatHasTheSymbol) {
  std::string errors = "untouched";
  // The first does not exist, the second lacks the symbol (dlsym also searches a library's
  // dependencies, so libc: it depends on nothing that has cos), the third has it.
  void* h = openLibrary({"libdtrain_no_such_library.so", "libc.so.6", "libm.so.6"}, "cos", &errors);
  ASSERT_NE(h, nullptr);
  EXPECT_EQ(h, ::dlopen("libm.so.6", RTLD_NOW | RTLD_NOLOAD));
  using Cos = double (*)(double);
  EXPECT_EQ(reinterpret_cast<Cos>(::dlsym(h, "cos"))(0.0), 1.0);
  EXPECT_EQ(errors, "untouched");  // only written on failure
}

TEST(Dynlib, SaysWhyEachCandidateFailed) {
  std::string errors;
  EXPECT_EQ(openLibrary({"libdtrain_no_such_library.so", "libc.so.6"}, "cos", &errors), nullptr);
  EXPECT_NE(errors.find("libdtrain_no_such_library.so: cannot open shared object file"), std::string::npos) << errors;
  EXPECT_NE(errors.find("; libc.so.6: has no cos"), std::string::npos) << errors;
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
