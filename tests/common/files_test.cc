#include "dtrain/common/files.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include <fmt/format.h>
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


// A name ownedFilePrefix made reads back as its pid, only with its stem, a run id of 12 hex
// digits, this process's place and mkdtemp's suffix (or .json).
TEST(OwnedFiles, NameCarriesThePidOfThisPlace) {
  const std::string prefix = ownedFilePrefix("dtrain-run-", "0123456789ab");
  EXPECT_EQ(prefix, "dtrain-run-0123456789ab-" + pidPlace() + "-" + std::to_string(::getpid()) + "-");
  EXPECT_EQ(ownedFilePid(prefix + "AbC123", "dtrain-run-"), ::getpid());
  EXPECT_EQ(ownedFilePid(prefix.substr(0, prefix.size() - 1) + ".json", "dtrain-run-"), ::getpid());
  EXPECT_EQ(ownedFilePid(prefix + "AbC123", "dtrain-"), -1);         // another stem
  EXPECT_EQ(ownedFilePid(prefix + "AbC12", "dtrain-run-"), -1);      // not mkdtemp's
  EXPECT_EQ(ownedFilePid(prefix + "AbC123/x", "dtrain-run-"), -1);
  EXPECT_EQ(ownedFilePid("dtrain-run-0123456789ab-0.1-42-AbC123", "dtrain-run-"), -1);  // another place
  EXPECT_EQ(ownedFilePid("dtrain-run-0123456789AB-" + pidPlace() + "-42-AbC123", "dtrain-run-"), -1);
  EXPECT_EQ(ownedFilePid("dtrain-run-" + pidPlace() + "-42-AbC123", "dtrain-run-"), -1);  // no run id
  EXPECT_NE(pidPlace().find('.'), std::string::npos);
}

// The sweep removes what a dead process of this place left, with what it holds, and nothing
// else: a live pid's, another place's, another stem's, a symbolic link (nor its target).
TEST(OwnedFiles, StaleOnesAreRemovedAndNothingElse) {
  TempDir d;
  const pid_t child = ::fork();
  if (child == 0) ::_exit(0);
  ASSERT_GT(child, 0);
  ::waitpid(child, nullptr, 0);  // a pid no process has now
  const std::string place = pidPlace();
  auto name = [&](const std::string& stem, const std::string& where, long pid) {
    return fmt::format("{}0123456789ab-{}-{}-AbC123", stem, where, pid);
  };
  const fs::path dead = d.path / name("dtrain-run-", place, child);
  const fs::path live = d.path / name("dtrain-run-", place, ::getppid());
  const fs::path elsewhere = d.path / name("dtrain-run-", "0.1", child);
  const fs::path otherStem = d.path / name("dtrain-", place, child);
  const fs::path link = d.path / name("dtrain-run-", place, child).replace(11, 12, "aaaaaaaaaaaa");
  const fs::path target = d.path / "target";
  for (const fs::path& p : {dead, live, elsewhere, otherStem, target}) fs::create_directory(p);
  std::ofstream(dead / "spec.json") << "secret";
  std::ofstream(target / "keep") << "x";
  fs::create_directory_symlink(target, link);
  removeStaleOwnedFiles(d.path, {"dtrain-run-"});
  EXPECT_FALSE(fs::exists(dead));
  EXPECT_TRUE(fs::exists(live));
  EXPECT_TRUE(fs::exists(elsewhere));
  EXPECT_TRUE(fs::exists(otherStem));
  EXPECT_TRUE(fs::is_symlink(link));
  EXPECT_TRUE(fs::exists(target / "keep"));
}

// The four ways a held directory and its path part, as the checkpoint writer and the
// launcher's restart check tell them apart.
TEST(PathStillNames, SameRemovedMovedReplacedOther) {
  const fs::path base = fs::temp_directory_path() / fmt::format("dtrain-hold-{}", ::getpid());
  fs::remove_all(base);
  fs::create_directories(base);
  const std::string d = (base / "d").string(), away = (base / "away").string();
  auto hold = [&] {
    fs::create_directories(d);
    return Fd(::open(d.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  };
  Fd a = hold();
  EXPECT_EQ(pathStillNames(a, d), PathHold::kSame);
  fs::remove(d);
  EXPECT_EQ(pathStillNames(a, d), PathHold::kRemoved);
  fs::create_directories(d);
  EXPECT_EQ(pathStillNames(a, d), PathHold::kReplaced);
  fs::remove(d);
  Fd b = hold();
  fs::rename(d, away);
  EXPECT_EQ(pathStillNames(b, d), PathHold::kMovedAway);
  fs::create_directories(d);
  EXPECT_EQ(pathStillNames(b, d), PathHold::kOther);
  EXPECT_EQ(pathStillNames(Fd(), d), PathHold::kSame);  // nothing held: nothing to conclude
  fs::remove_all(base);
}

}  // namespace
}  // namespace dtrain
