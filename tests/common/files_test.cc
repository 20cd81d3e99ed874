#include "dtrain/common/files.h"

#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include <gtest/gtest.h>

#include "dtrain/common/errors.h"

namespace dtrain {
namespace {

namespace fs = std::filesystem;

struct TempDir {
  fs::path path;
  TempDir() {
    std::string tmpl = (fs::temp_directory_path() / "dtrain-files-XXXXXX").string();
    path = ::mkdtemp(tmpl.data());
  }
  ~TempDir() { fs::remove_all(path); }
};

std::string slurp(const fs::path& p) {
  std::ifstream f(p);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

mode_t modeOf(const fs::path& p) {
  struct stat st {};
  EXPECT_EQ(::stat(p.c_str(), &st), 0);
  return st.st_mode & 07777;
}

TEST(WritePrivateFile, OwnerOnlyEvenWhenTheFileWasReadable) {
  TempDir d;
  const fs::path p = d.path / "spec.json";
  writePrivateFile(p, "{\"env\": {\"TOKEN\": \"secret\"}}");
  EXPECT_EQ(slurp(p), "{\"env\": {\"TOKEN\": \"secret\"}}");
  EXPECT_EQ(modeOf(p), 0600u);
  ::chmod(p.c_str(), 0644);
  writePrivateFile(p, "short");  // truncated, and private again
  EXPECT_EQ(slurp(p), "short");
  EXPECT_EQ(modeOf(p), 0600u);
}

TEST(WritePrivateFile, RefusesASymlinkAndNamesThePath) {
  TempDir d;
  const fs::path target = d.path / "elsewhere";
  std::ofstream(target) << "keep";
  fs::create_symlink(target, d.path / "link");
  try {
    writePrivateFile(d.path / "link", "x");
    FAIL() << "a symlink was followed";
  } catch (const IoError& e) {
    EXPECT_NE(std::string(e.what()).find((d.path / "link").string()), std::string::npos) << e.what();
  }
  EXPECT_EQ(slurp(target), "keep");
  EXPECT_THROW(writePrivateFile(d.path / "no-such-dir" / "f", "x"), IoError);
}

// The temp dir: TMPDIR as given, made absolute (workers may start elsewhere); an unusable one
// refused as bad input naming the variable, the problem and the fix.
TEST(TempDirectory, AbsoluteAndCheckedNamingTheVariable) {
  TempDir d;
  const char* old = std::getenv("TMPDIR");
  const std::string saved = old ? old : "";
  const fs::path cwd = fs::current_path();
  fs::create_directory(d.path / "rel");
  fs::current_path(d.path);
  ::setenv("TMPDIR", "rel", 1);
  EXPECT_EQ(tempDirectory(), (d.path / "rel").string());
  EXPECT_EQ(tempDirectoryProblem(), "");
  ::setenv("TMPDIR", "missing", 1);
  std::string dir;
  EXPECT_EQ(tempDirectoryProblem(&dir), "TMPDIR=missing (" + (d.path / "missing").string() +
                                            "): the directory does not exist; create it, or unset TMPDIR");
  EXPECT_EQ(dir, (d.path / "missing").string());
  EXPECT_THROW(tempDirectory(), SpecError);
  std::ofstream(d.path / "file") << "x";
  ::setenv("TMPDIR", (d.path / "file").c_str(), 1);
  EXPECT_EQ(tempDirectoryProblem(), "TMPDIR=" + (d.path / "file").string() +
                                        ": not a directory; point TMPDIR at a directory, or unset it");
  ::setenv("TMPDIR", "", 1);  // (empty: as if unset)
  EXPECT_EQ(tempDirectoryProblem(), "");
  fs::current_path(cwd);
  if (old) ::setenv("TMPDIR", saved.c_str(), 1);
  else ::unsetenv("TMPDIR");
}

}  // namespace
}  // namespace dtrain
