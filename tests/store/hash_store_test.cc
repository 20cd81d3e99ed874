#include "dtrain/store/hash_store.h"

#include <gtest/gtest.h>

#include <chrono>
#include <limits>
#include <memory>
#include <thread>

#include "dtrain/common/errors.h"
#include "dtrain/store/prefix_store.h"

namespace dtrain::store {
namespace {

using namespace std::chrono_literals;

TEST(HashStore, SetGetBinarySafe) {
  HashStore s;
  std::string key("k\0ey", 4), value("\x00\xff\x01", 3);
  s.set(key, value);
  EXPECT_EQ(s.get(key), value);
  EXPECT_TRUE(s.check({key}));
  EXPECT_FALSE(s.check({key, "other"}));
  EXPECT_EQ(s.numKeys(), 1);
  EXPECT_TRUE(s.deleteKey(key));
  EXPECT_FALSE(s.deleteKey(key));
  EXPECT_EQ(s.numKeys(), 0);
}

TEST(HashStore, AddAppendMulti) {
  HashStore s;
  EXPECT_EQ(s.add("c", 5), 5);
  EXPECT_EQ(s.add("c", -7), -2);
  EXPECT_EQ(s.get("c"), "-2");
  s.set("notint", "abc");
  EXPECT_THROW(s.add("notint", 1), StoreError);
  s.append("a", "x");
  s.append("a", "yz");
  EXPECT_EQ(s.get("a"), "xyz");
  s.multiSet({"m1", "m2"}, {"1", "2"});
  EXPECT_EQ(s.multiGet({"m2", "m1"}), (std::vector<Bytes>{"2", "1"}));
  EXPECT_THROW(s.multiSet({"x"}, {}), StoreError);
}

// add() refuses what it cannot represent instead of wrapping, and stores nothing then.
TEST(HashStore, AddRefusesOverflowAndNonIntegers) {
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max(), kMin = std::numeric_limits<int64_t>::min();
  HashStore s;
  EXPECT_EQ(s.add("ov", kMax), kMax);
  try {
    s.add("ov", 1);
    FAIL() << "overflow not refused";
  } catch (const OutOfRangeError& e) {
    EXPECT_NE(std::string(e.what()).find("key 'ov'"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("would overflow int64"), std::string::npos) << e.what();
  }
  EXPECT_EQ(s.get("ov"), std::to_string(kMax));
  EXPECT_EQ(s.add("ov", 0), kMax);
  EXPECT_EQ(s.add("neg", kMin), kMin);
  EXPECT_THROW(s.add("neg", -1), OutOfRangeError);
  EXPECT_EQ(s.get("neg"), std::to_string(kMin));
  EXPECT_EQ(s.add("neg", kMax), -1);  // opposite signs never overflow
  s.set("text", "abc");
  try {
    s.add("text", 1);
    FAIL() << "non-integer not refused";
  } catch (const NotIntegerError& e) {
    std::string m = e.what();
    EXPECT_NE(m.find("key 'text'"), std::string::npos) << m;
    EXPECT_EQ(m.find("not an integer"), m.rfind("not an integer")) << "said twice: " << m;
  }
  EXPECT_EQ(s.get("text"), "abc");
}

// The one add() rule every Store uses (HashStore and the TCP server).
TEST(HashStore, AddToCounterIsTheSharedRule) {
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max(), kMin = std::numeric_limits<int64_t>::min();
  Bytes v = "41", big = std::to_string(kMax), small = std::to_string(kMin), junk = "12x";
  Bytes tooLong = "99999999999999999999";
  EXPECT_EQ(addToCounter("k", nullptr, 5), 5);
  EXPECT_EQ(addToCounter("k", &v, 1), 42);
  EXPECT_EQ(addToCounter("k", &big, -1), kMax - 1);
  EXPECT_THROW(addToCounter("k", &big, 1), OutOfRangeError);
  EXPECT_THROW(addToCounter("k", &small, -1), OutOfRangeError);
  EXPECT_THROW(addToCounter("k", &junk, 1), NotIntegerError);
  EXPECT_THROW(addToCounter("k", &tooLong, 1), NotIntegerError);  // a stored value beyond int64
}

TEST(HashStore, CompareSetFollowsC10d) {
  HashStore s;
  EXPECT_EQ(s.compareSet("k", "old", "new"), "old");  // absent, expected non-empty: unchanged
  EXPECT_FALSE(s.check({"k"}));
  EXPECT_EQ(s.compareSet("k", "", "v1"), "v1");  // absent, expected empty: set
  EXPECT_EQ(s.compareSet("k", "wrong", "v2"), "v1");
  EXPECT_EQ(s.compareSet("k", "v1", "v2"), "v2");
  EXPECT_EQ(s.get("k"), "v2");
}

TEST(HashStore, CounterIsExactUnderContention) {
  HashStore s;
  std::vector<std::thread> ts;
  for (int t = 0; t < 16; ++t)
    ts.emplace_back([&] {
      for (int i = 0; i < 1000; ++i) s.add("n", 1);
    });
  for (auto& t : ts) t.join();
  EXPECT_EQ(s.get("n"), "16000");
}

TEST(HashStore, WaitIsWokenBySet) {
  HashStore s;
  auto start = std::chrono::steady_clock::now();
  std::thread setter([&] {
    std::this_thread::sleep_for(50ms);
    s.set("a", "1");
    s.set("b", "2");
  });
  s.wait({"a", "b"}, 5s);
  auto took = std::chrono::steady_clock::now() - start;
  setter.join();
  EXPECT_LT(took, 2s);
  EXPECT_EQ(s.get("b"), "2");
}

TEST(HashStore, TimeoutIsPreciseAndNamesKeys) {
  HashStore s;
  s.set("here", "1");
  auto start = std::chrono::steady_clock::now();
  try {
    s.wait({"here", "missing"}, 500ms);
    FAIL() << "no timeout";
  } catch (const TimeoutError& e) {
    EXPECT_STREQ(e.what(), "timed out after 0.5 s waiting for key 'missing'");
  }
  auto took = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - start);
  EXPECT_GE(took.count(), 500);
  EXPECT_LE(took.count(), 550);  // within 10%
  s.setTimeout(100ms);
  EXPECT_THROW(s.get("nope"), TimeoutError);
}

TEST(PrefixStore, NamespacesKeys) {
  auto inner = std::make_shared<HashStore>();
  PrefixStore a("job1", inner), b("job2", inner);
  a.set("k", "A");
  b.set("k", "B");
  EXPECT_EQ(a.get("k"), "A");
  EXPECT_EQ(b.get("k"), "B");
  EXPECT_EQ(inner->get("job1/k"), "A");
  EXPECT_EQ(a.add("n", 2), 2);
  EXPECT_EQ(inner->get("job1/n"), "2");
  EXPECT_TRUE(a.check({"k", "n"}));
  EXPECT_FALSE(b.check({"n"}));
  EXPECT_EQ(a.compareSet("k", "A", "A2"), "A2");
  EXPECT_TRUE(b.deleteKey("k"));
  EXPECT_EQ(inner->numKeys(), 2);
  a.setTimeout(50ms);
  EXPECT_THROW(a.get("never"), TimeoutError);
}

}  // namespace
}  // namespace dtrain::store
