#include "dtrain/common/strings.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <limits>
#include <utility>
#include <vector>

#include "dtrain/common/errors.h"

namespace dtrain {
namespace {

std::string refusal(const std::string& text, int64_t lo = std::numeric_limits<int64_t>::min(),
                    int64_t hi = std::numeric_limits<int64_t>::max()) {
  try {
    parseInteger(text, "delta", lo, hi);
  } catch (const SpecError& e) {
    return e.what();
  }
  ADD_FAILURE() << "\"" << text << "\" was accepted";
  return "";
}

TEST(ParseInteger, StrictDecimalInRange) {
  EXPECT_EQ(parseInteger("42", "x"), 42);
  EXPECT_EQ(parseInteger("-7", "x"), -7);
  EXPECT_EQ(parseInteger("010", "x"), 10);  // decimal, not octal
  EXPECT_EQ(parseInteger("9223372036854775807", "x"), std::numeric_limits<int64_t>::max());
  EXPECT_EQ(parseInteger("-9223372036854775808", "x"), std::numeric_limits<int64_t>::min());
  EXPECT_EQ(parseInteger("65535", "--port", 0, 65535), 65535);
}

TEST(ParseInteger, OutOfRangeIsRefusedNeverClamped) {
  EXPECT_EQ(refusal("99999999999999999999"),
            "delta: 99999999999999999999 is out of range; expected an integer from -9223372036854775808 to "
            "9223372036854775807");
  EXPECT_NE(refusal("-99999999999999999999").find("is out of range"), std::string::npos);
  EXPECT_NE(refusal("9223372036854775808").find("is out of range"), std::string::npos);
  EXPECT_EQ(refusal("65536", 0, 65535), "delta: 65536 is out of range; expected an integer from 0 to 65535");
  EXPECT_NE(refusal("-1", 0, 65535).find("is out of range"), std::string::npos);
}

TEST(ParseInteger, NonNumbersAreRefused) {
  for (const char* bad : {"", "x", "1x", "0x10", " 1", "1 ", "+", "-", "1.5", "1e3"})
    EXPECT_NE(refusal(bad).find("delta: expected an integer from"), std::string::npos) << bad;
}

TEST(ParseSeconds, FiniteAndBounded) {
  EXPECT_DOUBLE_EQ(parseSeconds("0.5", "--timeout", 100), 0.5);
  EXPECT_DOUBLE_EQ(parseSeconds("0", "--timeout", 100), 0);
  EXPECT_DOUBLE_EQ(parseSeconds("100", "--timeout", 100), 100);
  for (const char* bad : {"", "-1", "101", "1e400", "inf", "nan", "1s", "99999999999999999999"})
    EXPECT_THROW(parseSeconds(bad, "--timeout", 100), SpecError) << bad;
  try {
    parseSeconds("-1", "--timeout", 100);
  } catch (const SpecError& e) {
    EXPECT_STREQ(e.what(), "--timeout: expected seconds from 0 to 100, got \"-1\"");
  }
}

TEST(ParseSize, BinaryUnitsInEitherCase) {
  EXPECT_EQ(parseSize("4096", "-b"), 4096u);
  EXPECT_EQ(parseSize("8B", "-b"), 8u);
  EXPECT_EQ(parseSize("4K", "-b"), 4096u);
  EXPECT_EQ(parseSize("4k", "-b"), 4096u);  // as nccl-tests takes it
  EXPECT_EQ(parseSize("4KiB", "-b"), 4096u);
  EXPECT_EQ(parseSize("256m", "-e"), 256u << 20);
  EXPECT_EQ(parseSize("1G", "-e"), 1ull << 30);
  EXPECT_EQ(parseSize("1024T", "-e"), 1ull << 50);  // the largest, as the refusal says
  for (const char* bad : {"", "K", "-4K", "+4K", " 4K", "4 K", "4X", "4KB", "1.5M", "0x10", "4bib", "8BiB"}) {
    try {
      parseSize(bad, "-b/--minbytes");
      ADD_FAILURE() << "\"" << bad << "\" was accepted";
    } catch (const SpecError& e) {
      EXPECT_EQ(std::string(e.what()),
                fmt::format("-b/--minbytes: expected a size like 4096, 4K, 256M or 1G, got \"{}\"", bad));
    }
  }
  for (const char* huge : {"1025T", "99999999999999999999", "18446744073709551616K"})
    EXPECT_THROW(
        {
          try {
            parseSize(huge, "-e");
          } catch (const SpecError& e) {
            EXPECT_NE(std::string(e.what()).find("is out of range; sizes go up to 1024T"), std::string::npos) << huge;
            throw;
          }
        },
        SpecError);
}

// Messages quote what users give: one line, no terminal controls, no raw binary.
TEST(OneLine, EscapesControlsAndWhatIsNotUtf8) {
  EXPECT_EQ(oneLine("a\nb\tc\x1b[0m\x7f"), "a\\nb\\tc\\x1b[0m\\x7f");
  EXPECT_EQ(oneLine("r\xc3\xa9sum\xc3\xa9 \xe2\x80\x94 \xf0\x9f\x98\x80"), "r\xc3\xa9sum\xc3\xa9 \xe2\x80\x94 \xf0\x9f\x98\x80");
  EXPECT_EQ(oneLine(std::string_view("\x1f\x8b\x08\x00\xe9x", 6)), "\\x1f\\x8b\\x08\\x00\\xe9x");  // gzip's header
  EXPECT_EQ(oneLine("\xc2\x9b"), "\\xc2\\x9b");                                  // U+009B, CSI
  EXPECT_EQ(oneLine("\xc0\xaf \xed\xa0\x80 \xf4\x90\x80\x80"), "\\xc0\\xaf \\xed\\xa0\\x80 \\xf4\\x90\\x80\\x80");
  EXPECT_EQ(oneLine("\xe2\x80"), "\\xe2\\x80");  // cut short
}

TEST(Utf8PrefixLength, NeverEndsInsideACharacter) {
  const std::string s = "ab\xc3\xa9z";  // "abéz": é is two bytes
  EXPECT_EQ(utf8PrefixLength(s, 10), s.size());
  EXPECT_EQ(utf8PrefixLength(s, 4), 4u);  // "abé"
  EXPECT_EQ(utf8PrefixLength(s, 3), 2u);  // not half of é
  EXPECT_EQ(utf8PrefixLength(s, 0), 0u);
}

// LOCAL_RANK as the trainer and the NCCL backend both read it: std::atoi took "1x" for 1 and
// "x" for 0, where the trainer fell back to the rank, so the two picked different GPUs.
TEST(EnvIndex, DigitsOnlyElseTheFallback) {
  const char* kName = "DTRAIN_TEST_ENV_INDEX";
  ::unsetenv(kName);
  EXPECT_EQ(envIndex(kName, 7), 7);
  for (const auto& [value, want] : std::vector<std::pair<const char*, int>>{{"0", 0},
                                                                            {"3", 3},
                                                                            {"010", 10},
                                                                            {"1073741824", 1 << 30},
                                                                            {"", 7},
                                                                            {"1x", 7},
                                                                            {"x", 7},
                                                                            {"-1", 7},
                                                                            {" 2", 7},
                                                                            {"+2", 7},
                                                                            {"1073741825", 7},
                                                                            {"99999999999", 7}}) {
    ::setenv(kName, value, 1);
    EXPECT_EQ(envIndex(kName, 7), want) << "\"" << value << "\"";
  }
  ::unsetenv(kName);
}

}  // namespace
}  // namespace dtrain

namespace dtrain {
namespace {

// A value quoted whole in an error (100 KB given for a number) is cut around its middle; the
// words around it (the place, the fix) stay, and so do words of a usual length.
TEST(ElideLongWords, CutsOnlyTheLongRunsAndKeepsTheRest) {
  const std::string value(100000, 'x');
  const std::string line = "spec.json: /nproc_per_node: expected a count, got the string \"" + value + "\"; fix it";
  const std::string out = elideLongWords(line);
  EXPECT_LT(out.size(), 400u);
  EXPECT_EQ(out.rfind("spec.json: /nproc_per_node: expected a count, got the string \"" + std::string(159, 'x'), 0), 0u)
      << out;
  // (the run is the value with its quotes and the ';': 100003 bytes, its first 160 and last 40 kept)
  EXPECT_NE(out.find("...[99803 bytes]..."), std::string::npos) << out;
  EXPECT_EQ(out.substr(out.size() - 47), std::string(38, 'x') + "\"; fix it");
  EXPECT_EQ(elideLongWords("a short line, as it is"), "a short line, as it is");
  const std::string exact(400, 'y');
  EXPECT_EQ(elideLongWords(exact), exact);
  // (UTF-8 characters whole: no cut inside one)
  std::string wide;
  for (int i = 0; i < 300; ++i) wide += "\xc3\xa9";  // é
  const std::string cut = elideLongWords(wide);
  EXPECT_EQ(cut.rfind(std::string("\xc3\xa9") + "\xc3\xa9", 0), 0u);
  EXPECT_EQ(cut.substr(0, 160), wide.substr(0, 160));
  EXPECT_NE(cut.find("...[400 bytes]..."), std::string::npos) << cut;
  EXPECT_EQ(cut.substr(cut.size() - 40), wide.substr(0, 40));
  // (lines stay lines: a newline ends a run, as a space does)
  EXPECT_EQ(elideLongWords(std::string(300, 'a') + "\n" + std::string(300, 'b') + "\n"),
            std::string(300, 'a') + "\n" + std::string(300, 'b') + "\n");
  const std::string twoLines = elideLongWords(std::string(1000, 'a') + "\nnext line");
  EXPECT_EQ(twoLines.substr(twoLines.size() - 10), "\nnext line");
}

}  // namespace
}  // namespace dtrain
