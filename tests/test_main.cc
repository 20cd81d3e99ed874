// The test binaries' main: every test process works in a temporary directory of its own,
// removed when its tests end. The tests write checkpoints, csv files and sockets under
// TMPDIR (::testing::TempDir() and std::filesystem::temp_directory_path() both read it), and
// ctest runs each test as a process of its own, so names made unique by pid alone left
// thousands of directories in /tmp over a few suite runs.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <cstdlib>
#include <filesystem>
#include <string>
#include <system_error>

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  const char* given = std::getenv("TMPDIR");
  std::string dir = std::string(given != nullptr && given[0] != '\0' ? given : "/tmp") + "/dtrain-test-XXXXXX";
  // Without a directory of its own (an unwritable TMPDIR) a test runs where it would have,
  // and says so through the tests that need one.
  const bool own = ::mkdtemp(dir.data()) != nullptr;
  if (own) ::setenv("TMPDIR", dir.c_str(), 1);
  const int rc = RUN_ALL_TESTS();
  if (own) {
    std::error_code ec;
    std::filesystem::remove_all(dir, ec);
  }
  return rc;
}
