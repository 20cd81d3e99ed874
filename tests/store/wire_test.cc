#include "dtrain/store/wire.h"

#include <gtest/gtest.h>

namespace dtrain::store::wire {
namespace {

std::string body(const std::string& frame) { return frame.substr(kHeaderSize); }

TEST(Wire, RequestRoundTripsForEveryOp) {
  Limits lim;
  std::vector<Request> reqs;
  reqs.push_back({Op::kSet, {"k"}, {std::string("v\0x", 3)}, 0});
  reqs.push_back({Op::kGet, {"k"}, {}, 1500});
  reqs.push_back({Op::kAdd, {"c"}, {}, -5});
  reqs.push_back({Op::kCompareSet, {"k"}, {"old", "new"}, 0});
  reqs.push_back({Op::kCheck, {"a", "b"}, {}, 0});
  reqs.push_back({Op::kWait, {"a", "b"}, {}, -1});
  reqs.push_back({Op::kDelete, {"a"}, {}, 0});
  reqs.push_back({Op::kNumKeys, {}, {}, 0});
  reqs.push_back({Op::kAppend, {"a"}, {"tail"}, 0});
  reqs.push_back({Op::kMultiGet, {"a", "b", "c"}, {}, 10});
  reqs.push_back({Op::kMultiSet, {"a", "b"}, {"1", "2"}, 0});
  reqs.push_back({Op::kPing, {}, {}, 0});
  reqs.push_back({Op::kAuth, {}, {std::string(32, 'm')}, kVersion});
  for (const auto& q : reqs) {
    std::string f = encodeRequest(q);
    EXPECT_EQ(decodeHeader(f, lim), f.size() - kHeaderSize);
    Request d = decodeRequest(body(f), lim);
    EXPECT_EQ(static_cast<int>(d.op), static_cast<int>(q.op));
    EXPECT_EQ(d.keys, q.keys);
    EXPECT_EQ(d.values, q.values);
    EXPECT_EQ(d.num, q.num);
  }
}

TEST(Wire, ReplyRoundTrips) {
  Limits lim;
  Reply v;
  v.op = Op::kValues;
  v.values = {"x", "", "zz"};
  EXPECT_EQ(decodeReply(body(encodeReply(v)), lim).values, v.values);
  Reply e = errorReply(ErrorCode::kQuota, "store is full");
  Reply d = decodeReply(body(encodeReply(e)), lim);
  EXPECT_EQ(d.code, ErrorCode::kQuota);
  EXPECT_EQ(d.message, "store is full");
  Reply o = decodeReply(body(encodeReply(errorReply(ErrorCode::kOutOfRange, "would overflow"))), lim);
  EXPECT_EQ(o.code, ErrorCode::kOutOfRange);
  EXPECT_STREQ(errorCodeName(ErrorCode::kOutOfRange), "out of range");
  Reply i;
  i.op = Op::kInt;
  i.num = -123456789012345;
  EXPECT_EQ(decodeReply(body(encodeReply(i)), lim).num, i.num);
}

TEST(Wire, BigEndianLayoutIsAsDocumented) {
  std::string f = encodeRequest({Op::kAdd, {"ab"}, {}, 258});
  std::string expect("\x00\x00\x00\x0f\x03\x00\x00\x00\x02" "ab" "\x00\x00\x00\x00\x00\x00\x01\x02", 19);
  EXPECT_EQ(f, expect);
}

TEST(Wire, RejectsBadInputWithTypedErrors) {
  Limits lim;
  auto code = [&](std::string_view b) {
    try {
      decodeRequest(b, lim);
    } catch (const WireError& e) {
      return e.code();
    }
    return ErrorCode{0};
  };
  EXPECT_EQ(code(std::string_view("\x63", 1)), ErrorCode::kUnknownOpcode);
  EXPECT_EQ(code(std::string_view("\x01\x00\x00", 3)), ErrorCode::kMalformed);  // truncated length
  // A key length of 2^32-1 is refused before anything is allocated.
  EXPECT_EQ(code(std::string_view("\x01\xff\xff\xff\xff", 5)), ErrorCode::kTooLarge);
  // limit+1
  std::string f = encodeRequest({Op::kSet, {std::string(lim.max_key + 1, 'k')}, {"v"}, 0});
  EXPECT_EQ(code(body(f)), ErrorCode::kTooLarge);
  // Too many keys in one request.
  EXPECT_EQ(code(std::string_view("\x05\x00\x10\x00\x01", 5)), ErrorCode::kTooLarge);
  // Trailing garbage.
  std::string ping = body(encodeRequest({Op::kPing, {}, {}, 0})) + "x";
  EXPECT_EQ(code(ping), ErrorCode::kMalformed);
  EXPECT_EQ(code(body(encodeRequest({Op::kWait, {"a"}, {}, -7}))), ErrorCode::kMalformed);
  EXPECT_THROW(decodeHeader(std::string_view("\xff\xff\xff\xff", 4), lim), WireError);
  EXPECT_THROW(decodeHeader(std::string_view("\x00\x00\x00\x00", 4), lim), WireError);
}

TEST(Wire, EveryTruncationIsRejectedNeverCrashes) {
  Limits lim;
  std::string b = body(encodeRequest({Op::kMultiSet, {"alpha", "beta"}, {"one", "two"}, 0}));
  for (size_t n = 0; n < b.size(); ++n) EXPECT_THROW(decodeRequest(std::string_view(b).substr(0, n), lim), WireError) << n;
  EXPECT_NO_THROW(decodeRequest(b, lim));
}

}  // namespace
}  // namespace dtrain::store::wire
