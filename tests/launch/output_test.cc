#include "dtrain/launch/output.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace dtrain::launch {
namespace {

TEST(LineSplitter, JoinsChunksIntoLines) {
  LineSplitter s;
  std::vector<std::string> lines;
  auto emit = [&](std::string_view l) { lines.emplace_back(l); };
  s.feed("ab", emit);
  s.feed("c\nde\n\nf", emit);
  EXPECT_EQ(lines, (std::vector<std::string>{"abc", "de", ""}));
  s.finish(emit);
  EXPECT_EQ(lines.back(), "f");
  size_t before = lines.size();
  s.finish(emit);
  EXPECT_EQ(lines.size(), before);
}

TEST(LineSplitter, CutsOverlongLines) {
  LineSplitter s;
  std::vector<std::string> lines;
  std::string big(LineSplitter::kMaxLine * 2 + 5, 'x');
  s.feed(big, [&](std::string_view l) { lines.emplace_back(l); });
  ASSERT_EQ(lines.size(), 2u);
  EXPECT_EQ(lines[0].size(), LineSplitter::kMaxLine);
  s.finish([&](std::string_view l) { lines.emplace_back(l); });
  EXPECT_EQ(lines.back().size(), 5u);
}

TEST(LineSplitter, BinaryBytesPassThrough) {
  LineSplitter s;
  std::string got;
  s.feed(std::string_view("\xff\x00z\n", 4), [&](std::string_view l) { got = std::string(l); });
  EXPECT_EQ(got, std::string("\xff\x00z", 3));
}

TEST(TailBuffer, KeepsLastN) {
  TailBuffer t(2);
  t.push("a");
  t.push("b");
  t.push("c");
  ASSERT_EQ(t.lines().size(), 2u);
  EXPECT_EQ(t.lines().front(), "b");
}

}  // namespace
}  // namespace dtrain::launch
