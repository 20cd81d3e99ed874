#include "dtrain/store/wire.h"

#include <gtest/gtest.h>

#include "dtrain/store/auth.h"
#include "dtrain/store/tcp_store.h"

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
  reqs.push_back({Op::kAuth, {}, {std::string(32, 'n'), std::string(32, 'm')}, kVersion});
  reqs.push_back({Op::kAuth, {}, {}, 1});  // another version: its version only
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

// An AUTH of another version is read as far as its version, so that the store can answer
// VERSION whatever that version's fields are (version 1 sent only a MAC).
TEST(Wire, AuthOfAnotherVersionIsReadToItsVersion) {
  Limits lim;
  std::string v1 = std::string("\x40\x00\x01\x00\x00\x00\x20", 7) + std::string(32, 'm');
  Request q = decodeRequest(v1, lim);
  EXPECT_EQ(q.op, Op::kAuth);
  EXPECT_EQ(q.num, 1);
  EXPECT_TRUE(q.values.empty());
  // Version 2's AUTH is all of it: 75 bytes, within what is read before authentication.
  std::string v2 = encodeRequest({Op::kAuth, {}, {std::string(32, 'n'), std::string(32, 'm')}, kVersion});
  EXPECT_EQ(v2.size() - kHeaderSize, 75u);
  EXPECT_LE(v2.size() - kHeaderSize, kMaxHandshakeFrame);
  EXPECT_THROW(decodeRequest(body(v2).substr(0, 74), lim), WireError);
  Reply p;
  p.op = Op::kProof;
  p.value = std::string(32, 'p');
  EXPECT_EQ(decodeReply(body(encodeReply(p)), lim).value, p.value);
  EXPECT_STREQ(errorCodeName(ErrorCode::kIntegrity), "integrity check failed");
}

// ---- The session's MACs (auth.h) ----

const std::string kTok = "job-token-0123456789abcdef";

TEST(StoreAuth, ProofsAndKeyDifferBySideAndNonce) {
  std::string ns(32, 's'), nc(32, 'c');
  std::string client = auth::clientProof(kTok, ns, nc), server = auth::serverProof(kTok, ns, nc),
              key = auth::sessionKey(kTok, ns, nc);
  EXPECT_EQ(client.size(), auth::kMacSize);
  EXPECT_NE(client, server);  // a client's proof reflected back is no server proof
  EXPECT_NE(client, key);
  EXPECT_NE(server, key);
  EXPECT_NE(server, auth::serverProof(kTok, ns, std::string(32, 'd')));  // fresh per client nonce
  EXPECT_NE(server, auth::serverProof(kTok + "x", ns, nc));
  EXPECT_EQ(client, auth::clientProof(kTok, ns, nc));
  EXPECT_TRUE(auth::macEqual(client, auth::clientProof(kTok, ns, nc)));
  EXPECT_FALSE(auth::macEqual(client, server));
  EXPECT_FALSE(auth::macEqual(client, client.substr(1)));
}

std::string hex(std::string_view b) {
  std::string out;
  for (unsigned char c : b) out += "0123456789abcdef"[c >> 4], out += "0123456789abcdef"[c & 15];
  return out;
}

// The test vectors of docs/store-protocol.md ("Test vectors", computed there with Python's
// hmac module): a client written from the page must get the same bytes.
TEST(StoreAuth, MatchesTheDocumentedTestVectors) {
  std::string ns(32, 's'), nc(32, 'c');
  EXPECT_EQ(hex(auth::clientProof(kTok, ns, nc)), "5529cb218013a698643c51ef37468b909f759139a49c9615d926fbdad59696a3");
  EXPECT_EQ(hex(auth::serverProof(kTok, ns, nc)), "a397ba199b54e4522660451f9c49c17202f68afe986a72db2652ca7e6fc81980");
  std::string key = auth::sessionKey(kTok, ns, nc);
  EXPECT_EQ(hex(key), "a0609e8363e32e2194d1e1242a1f29b1dfe68e549d5768da16537bdb3895f158");
  auth::FrameMac sealer(key, auth::Direction::kClientToServer);
  std::string ping = encodeRequest({Op::kPing, {}, {}, 0});  // 00 00 00 01 0c
  std::string first = sealer.seal(ping), second = sealer.seal(ping);
  EXPECT_EQ(hex(first), "000000210c" "c8f9be081046f7c3964f3ff2ac5fe36df9d225246252f3b4e67b742cfcf8dd0f");
  EXPECT_EQ(hex(second), "000000210c" "8349859fa104a70083e2e0d3b8604f6fa37e37ca51d1b2b3af759777aecbab07");
}

TEST(StoreAuth, EveryAlterationReplayReorderOrReflectionFails) {
  std::string key = auth::sessionKey(kTok, std::string(32, 's'), std::string(32, 'c'));
  auth::FrameMac tx(key, auth::Direction::kServerToClient);
  Reply v;
  v.op = Op::kValue;
  v.value = "the job spec";
  std::string f0 = tx.seal(encodeReply(v));
  std::string f1 = tx.seal(encodeReply(v));  // same bytes, next place
  auto open = [&](auth::FrameMac& rx, const std::string& f) { return rx.open(std::string_view(f).substr(0, 4), std::string_view(f).substr(4)); };
  for (size_t i = 0; i < f0.size(); ++i)
    for (int bit = 0; bit < 8; ++bit) {
      std::string bad = f0;
      bad[i] = static_cast<char>(bad[i] ^ (1 << bit));
      auth::FrameMac rx(key, auth::Direction::kServerToClient);
      EXPECT_FALSE(open(rx, bad)) << "byte " << i << " bit " << bit;
      EXPECT_EQ(rx.seq(), 0u) << "a frame that failed was counted";
    }
  {  // in order: both open, to the body
    auth::FrameMac rx(key, auth::Direction::kServerToClient);
    auto b0 = open(rx, f0);
    ASSERT_TRUE(b0);
    EXPECT_EQ(decodeReply(*b0, Limits{}).value, "the job spec");
    EXPECT_TRUE(open(rx, f1));
    EXPECT_FALSE(open(rx, f1)) << "replayed";
    EXPECT_FALSE(open(rx, f0)) << "replayed";
  }
  {  // reordered
    auth::FrameMac rx(key, auth::Direction::kServerToClient);
    EXPECT_FALSE(open(rx, f1));
  }
  {  // reflected: valid in the other direction only
    auth::FrameMac rx(key, auth::Direction::kClientToServer);
    EXPECT_FALSE(open(rx, f0));
  }
  {  // another session's key
    auth::FrameMac rx(auth::sessionKey(kTok, std::string(32, 's'), std::string(32, 'd')), auth::Direction::kServerToClient);
    EXPECT_FALSE(open(rx, f0));
  }
  {  // truncated: too short to hold a tag, or the tag cut
    auth::FrameMac rx(key, auth::Direction::kServerToClient);
    EXPECT_FALSE(rx.open(std::string_view(f0).substr(0, 4), std::string_view(f0).substr(4, auth::kMacSize)));
    EXPECT_FALSE(rx.open(std::string_view(f0).substr(0, 4), std::string_view(f0).substr(4, f0.size() - 5)));
  }
}

}  // namespace
}  // namespace dtrain::store::wire
