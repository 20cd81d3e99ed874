#include "dtrain/store/token.h"

#include <sys/stat.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "dtrain/common/errors.h"

namespace dtrain::store {
namespace {

namespace fs = std::filesystem;

class StoreTokenFile : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/dtrain-token-test.XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string write(const std::string& name, const std::string& text, mode_t mode) {
    std::string p = dir_ + "/" + name;
    std::ofstream(p) << text;
    ::chmod(p.c_str(), mode);
    return p;
  }
  // The SpecError message of readTokenFile(path); fails the test when it does not throw.
  std::string refusal(const std::string& path) {
    try {
      readTokenFile(path);
    } catch (const SpecError& e) {
      return e.what();
    }
    ADD_FAILURE() << path << " was accepted";
    return "";
  }
  std::string dir_;
};

TEST_F(StoreTokenFile, ReadsATokenAndStripsTheLineEnd) {
  EXPECT_EQ(readTokenFile(write("tok", "abc123-0123456789\n", 0600)), "abc123-0123456789");
  std::string created = dir_ + "/new";
  std::string token = createTokenFile(created);
  EXPECT_EQ(token.size(), 64u);
  EXPECT_EQ(readTokenFile(created), token);
  struct stat st {};
  ASSERT_EQ(::stat(created.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
}

// Each refusal names the path and a fix that fits it: never chmod for a directory.
TEST_F(StoreTokenFile, EveryRefusalNamesTheRightFix) {
  std::string m = refusal(dir_ + "/absent");
  EXPECT_NE(m.find("no such token file; check the path"), std::string::npos) << m;

  EXPECT_EQ(refusal("/tmp"), "/tmp: is a directory; give the token file");
  ::chmod(dir_.c_str(), 0700);
  m = refusal(dir_);
  EXPECT_NE(m.find("is a directory; give the token file"), std::string::npos) << m;
  EXPECT_EQ(m.find("chmod"), std::string::npos) << m;
  EXPECT_EQ(m.find("empty"), std::string::npos) << m;

  m = refusal("/dev/null");
  EXPECT_NE(m.find("is not a regular file"), std::string::npos) << m;
  EXPECT_EQ(m.find("chmod"), std::string::npos) << m;

  m = refusal(write("empty", "\n", 0600));
  EXPECT_NE(m.find("token file is empty"), std::string::npos) << m;

  std::string open = write("open", "abc\n", 0644);
  EXPECT_EQ(refusal(open), open + ": token file is accessible by group or others; run chmod 600 " + open);

  m = refusal(write("huge", std::string(100 * 1024, 'a'), 0600));
  EXPECT_NE(m.find("larger than 64 KiB"), std::string::npos) << m;

  m = refusal(write("file", "abc\n", 0600) + "/below");
  EXPECT_NE(m.find("not a directory; check the path"), std::string::npos) << m;

  // Unreadable: root reads anything, so this part only runs as another user.
  if (::geteuid() != 0) {
    m = refusal(write("locked", "abc\n", 0000));
    EXPECT_NE(m.find("permission denied"), std::string::npos) << m;
  }
}

// A token that can be guessed is refused, naming its length and how to make a good one; 16
// characters is the least taken.
TEST_F(StoreTokenFile, ShortTokensAreRefusedWithTheFix) {
  std::string weak = write("weak", "a\n", 0600);
  EXPECT_EQ(refusal(weak), weak + ": the token is 1 character; a token must have at least 16 (a short one can be "
                                  "guessed); write a new one: openssl rand -hex 32 > " + weak);
  std::string m = refusal(write("fifteen", std::string(15, 'x') + "\n", 0600));
  EXPECT_NE(m.find("the token is 15 characters"), std::string::npos) << m;
  EXPECT_EQ(readTokenFile(write("sixteen", std::string(16, 'x'), 0600)), std::string(16, 'x'));
  EXPECT_NO_THROW(checkTokenStrength(newToken(), "new", "fix"));
  EXPECT_THROW(checkTokenStrength("x", "DTRAIN_STORE_TOKEN", "fix"), SpecError);
}

TEST_F(StoreTokenFile, CreateRefusesBadPathsAsBadInput) {
  try {
    createTokenFile(dir_ + "/no/such/dir/tok");
    FAIL() << "created below a missing directory";
  } catch (const SpecError& e) {
    EXPECT_NE(std::string(e.what()).find("its directory does not exist; check the path"), std::string::npos) << e.what();
  }
  std::string file = write("file", "x", 0600);
  EXPECT_THROW(createTokenFile(file + "/tok"), SpecError);
  EXPECT_THROW(createTokenFile(file), SpecError);  // exists: never overwritten
}

}  // namespace
}  // namespace dtrain::store
