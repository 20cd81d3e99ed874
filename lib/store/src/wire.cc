#include "dtrain/store/wire.h"

#include <cstdint>
#include <limits>

#include <fmt/format.h>

namespace dtrain::store::wire {
namespace {

constexpr size_t kMaxU32 = std::numeric_limits<uint32_t>::max();

class Writer {
 public:
  void u8(uint8_t v) { buf_.push_back(static_cast<char>(v)); }
  void u16(uint16_t v) {
    u8(static_cast<uint8_t>(v >> 8));
    u8(static_cast<uint8_t>(v));
  }
  void u32(uint32_t v) {
    for (int s = 24; s >= 0; s -= 8) u8(static_cast<uint8_t>(v >> s));
  }
  void i64(int64_t v) {
    auto u = static_cast<uint64_t>(v);
    for (int s = 56; s >= 0; s -= 8) u8(static_cast<uint8_t>(u >> s));
  }
  void count(size_t n) {
    if (n > kMaxU32) throw WireError(ErrorCode::kTooLarge, fmt::format("{} items do not fit a frame", n));
    u32(static_cast<uint32_t>(n));
  }
  void bytes(std::string_view b) {
    // A length that does not fit its u32 would be sent truncated: the peer would read the
    // rest as other fields.
    if (b.size() > kMaxU32)
      throw WireError(ErrorCode::kTooLarge, fmt::format("a field of {} bytes does not fit a frame", b.size()));
    u32(static_cast<uint32_t>(b.size()));
    buf_.append(b);
  }
  std::string frame() && {
    if (buf_.size() > kMaxU32)
      throw WireError(ErrorCode::kTooLarge, fmt::format("a frame of {} bytes does not fit the u32 length", buf_.size()));
    std::string out;
    out.reserve(kHeaderSize + buf_.size());
    uint32_t n = static_cast<uint32_t>(buf_.size());
    for (int s = 24; s >= 0; s -= 8) out.push_back(static_cast<char>(static_cast<uint8_t>(n >> s)));
    out += buf_;
    return out;
  }

 private:
  std::string buf_;
};

class Reader {
 public:
  explicit Reader(std::string_view b) : b_(b) {}
  uint8_t u8() {
    need(1);
    return static_cast<uint8_t>(b_[pos_++]);
  }
  uint16_t u16() {
    uint16_t hi = u8();
    return static_cast<uint16_t>((hi << 8) | u8());
  }
  uint32_t u32() {
    uint32_t v = 0;
    for (int i = 0; i < 4; ++i) v = (v << 8) | u8();
    return v;
  }
  int64_t i64() {
    uint64_t v = 0;
    for (int i = 0; i < 8; ++i) v = (v << 8) | u8();
    return static_cast<int64_t>(v);
  }
  std::string bytes(size_t max, const char* what) {
    uint32_t n = u32();
    if (n > max) throw WireError(ErrorCode::kTooLarge, fmt::format("{} of {} bytes exceeds the limit of {}", what, n, max));
    need(n);
    std::string out(b_.substr(pos_, n));
    pos_ += n;
    return out;
  }
  uint32_t count(size_t max, const char* what) {
    uint32_t n = u32();
    if (n > max) throw WireError(ErrorCode::kTooLarge, fmt::format("{} {} exceeds the limit of {}", n, what, max));
    return n;
  }
  void end() {
    if (pos_ != b_.size())
      throw WireError(ErrorCode::kMalformed, fmt::format("{} trailing bytes after the frame's fields", b_.size() - pos_));
  }

 private:
  void need(size_t n) {
    if (b_.size() - pos_ < n) throw WireError(ErrorCode::kMalformed, "frame ends in the middle of a field");
  }
  std::string_view b_;
  size_t pos_ = 0;
};

}  // namespace

const char* errorCodeName(ErrorCode c) {
  switch (c) {
    case ErrorCode::kUnknownOpcode: return "unknown opcode";
    case ErrorCode::kMalformed: return "malformed frame";
    case ErrorCode::kTooLarge: return "too large";
    case ErrorCode::kQuota: return "quota exceeded";
    case ErrorCode::kAuthFailed: return "authentication failed";
    case ErrorCode::kNotAuthenticated: return "not authenticated";
    case ErrorCode::kTimeout: return "timeout";
    case ErrorCode::kNotInteger: return "not an integer";
    case ErrorCode::kVersion: return "unsupported protocol version";
    case ErrorCode::kOutOfRange: return "out of range";
    case ErrorCode::kIntegrity: return "integrity check failed";
  }
  return "unknown error";
}

std::string encodeRequest(const Request& r) {
  Writer w;
  w.u8(static_cast<uint8_t>(r.op));
  auto keyList = [&] {
    w.count(r.keys.size());
    for (const auto& k : r.keys) w.bytes(k);
  };
  switch (r.op) {
    case Op::kSet:
    case Op::kAppend: w.bytes(r.keys.at(0)); w.bytes(r.values.at(0)); break;
    case Op::kGet: w.bytes(r.keys.at(0)); w.i64(r.num); break;
    case Op::kAdd: w.bytes(r.keys.at(0)); w.i64(r.num); break;
    case Op::kCompareSet: w.bytes(r.keys.at(0)); w.bytes(r.values.at(0)); w.bytes(r.values.at(1)); break;
    case Op::kCheck: keyList(); break;
    case Op::kWait:
    case Op::kMultiGet: keyList(); w.i64(r.num); break;
    case Op::kDelete: w.bytes(r.keys.at(0)); break;
    case Op::kNumKeys:
    case Op::kPing: break;
    case Op::kMultiSet:
      w.count(r.keys.size());
      for (size_t i = 0; i < r.keys.size(); ++i) {
        w.bytes(r.keys[i]);
        w.bytes(r.values.at(i));
      }
      break;
    case Op::kAuth:
      w.u16(static_cast<uint16_t>(r.num));
      if (r.num == kVersion) {
        w.bytes(r.values.at(0));
        w.bytes(r.values.at(1));
      }
      break;
    default: break;
  }
  return std::move(w).frame();
}

uint32_t decodeHeader(std::string_view header, const Limits& limits) {
  if (header.size() < kHeaderSize) throw WireError(ErrorCode::kMalformed, "short frame header");
  Reader r(header.substr(0, kHeaderSize));
  uint32_t n = r.u32();
  if (n == 0) throw WireError(ErrorCode::kMalformed, "empty frame");
  if (n > limits.max_frame)
    throw WireError(ErrorCode::kTooLarge, fmt::format("frame of {} bytes exceeds the limit of {}", n, limits.max_frame));
  return n;
}

Request decodeRequest(std::string_view body, const Limits& limits) {
  Reader r(body);
  Request q;
  uint8_t op = r.u8();
  q.op = static_cast<Op>(op);
  auto key = [&] { q.keys.push_back(r.bytes(limits.max_key, "key")); };
  auto value = [&] { q.values.push_back(r.bytes(limits.max_value, "value")); };
  auto keyList = [&] {
    uint32_t n = r.count(limits.max_keys_per_request, "keys in one request");
    for (uint32_t i = 0; i < n; ++i) key();
  };
  switch (q.op) {
    case Op::kSet:
    case Op::kAppend: key(); value(); break;
    case Op::kGet: key(); q.num = r.i64(); break;
    case Op::kAdd: key(); q.num = r.i64(); break;
    case Op::kCompareSet: key(); value(); value(); break;
    case Op::kCheck: keyList(); break;
    case Op::kWait:
    case Op::kMultiGet: keyList(); q.num = r.i64(); break;
    case Op::kDelete: key(); break;
    case Op::kNumKeys:
    case Op::kPing: break;
    case Op::kMultiSet: {
      uint32_t n = r.count(limits.max_keys_per_request, "keys in one request");
      for (uint32_t i = 0; i < n; ++i) {
        key();
        value();
      }
      break;
    }
    case Op::kAuth:
      q.num = r.u16();
      // Another version's AUTH is answered VERSION whatever follows: its fields are that
      // version's, so a MALFORMED about them would hide the real cause.
      if (q.num != kVersion) return q;
      q.values.push_back(r.bytes(256, "client nonce"));
      q.values.push_back(r.bytes(256, "client proof"));
      break;
    default: throw WireError(ErrorCode::kUnknownOpcode, fmt::format("unknown opcode 0x{:02x}", op));
  }
  if ((q.op == Op::kGet || q.op == Op::kWait || q.op == Op::kMultiGet) && q.num < -1)
    throw WireError(ErrorCode::kMalformed, fmt::format("timeout {} ms is invalid; use -1 for none", q.num));
  r.end();
  return q;
}

std::string encodeReply(const Reply& p) {
  Writer w;
  w.u8(static_cast<uint8_t>(p.op));
  switch (p.op) {
    case Op::kOk: break;
    case Op::kValue: w.bytes(p.value); break;
    case Op::kInt: w.i64(p.num); break;
    case Op::kBool: w.u8(p.flag ? 1 : 0); break;
    case Op::kValues:
      w.count(p.values.size());
      for (const auto& v : p.values) w.bytes(v);
      break;
    case Op::kChallenge: w.u16(static_cast<uint16_t>(p.num)); w.bytes(p.value); break;
    case Op::kProof: w.bytes(p.value); break;
    case Op::kError: w.u16(static_cast<uint16_t>(p.code)); w.bytes(p.message); break;
    default: break;
  }
  return std::move(w).frame();
}

Reply decodeReply(std::string_view body, const Limits& limits) {
  Reader r(body);
  Reply p;
  uint8_t op = r.u8();
  p.op = static_cast<Op>(op);
  switch (p.op) {
    case Op::kOk: break;
    case Op::kValue: p.value = r.bytes(limits.max_value, "value"); break;
    case Op::kInt: p.num = r.i64(); break;
    case Op::kBool: p.flag = r.u8() != 0; break;
    case Op::kValues: {
      uint32_t n = r.count(limits.max_keys_per_request, "values in one reply");
      for (uint32_t i = 0; i < n; ++i) p.values.push_back(r.bytes(limits.max_value, "value"));
      break;
    }
    case Op::kChallenge:
      p.num = r.u16();
      p.value = r.bytes(256, "nonce");
      break;
    case Op::kProof: p.value = r.bytes(256, "server proof"); break;
    case Op::kError:
      p.code = static_cast<ErrorCode>(r.u16());
      p.message = r.bytes(64 * 1024, "error message");
      break;
    default: throw WireError(ErrorCode::kUnknownOpcode, fmt::format("unknown reply opcode 0x{:02x}", op));
  }
  r.end();
  return p;
}

Reply errorReply(ErrorCode code, std::string message) {
  Reply p;
  p.op = Op::kError;
  p.code = code;
  p.message = std::move(message);
  return p;
}

}  // namespace dtrain::store::wire
