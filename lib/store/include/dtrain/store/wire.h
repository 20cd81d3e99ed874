#pragma once
// The store's wire protocol (docs/store-protocol.md is the normative description).
// Pure functions over byte strings: no sockets, so the parser can be fuzzed and tested at
// every byte boundary. Thread-safety: stateless.
#include <cstdint>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace dtrain::store::wire {

// Version 2: mutual authentication and a MAC on every frame after the handshake (auth.h).
// Version 1 authenticated the client only; its peers are refused with VERSION.
inline constexpr uint16_t kVersion = 2;
inline constexpr size_t kHeaderSize = 4;  // u32 big-endian body length
inline constexpr size_t kNonceSize = 32;
// The longest frame read before authentication: AUTH is 75 bytes. Room for a later
// version's AUTH to reach the version check (and get VERSION, not TOO_LARGE), and nothing
// an unauthenticated peer could make the server hold.
inline constexpr size_t kMaxHandshakeFrame = 128;

enum class Op : uint8_t {
  kSet = 1,
  kGet = 2,
  kAdd = 3,
  kCompareSet = 4,
  kCheck = 5,
  kWait = 6,
  kDelete = 7,
  kNumKeys = 8,
  kAppend = 9,
  kMultiGet = 10,
  kMultiSet = 11,
  kPing = 12,
  kAuth = 0x40,
  // replies
  kOk = 0x80,
  kValue = 0x81,
  kInt = 0x82,
  kBool = 0x83,
  kValues = 0x84,
  kChallenge = 0x85,
  kProof = 0x86,
  kError = 0xFF,
};

enum class ErrorCode : uint16_t {
  kUnknownOpcode = 1,
  kMalformed = 2,
  kTooLarge = 3,
  kQuota = 4,
  kAuthFailed = 5,
  kNotAuthenticated = 6,
  kTimeout = 7,
  kNotInteger = 8,
  kVersion = 9,
  kOutOfRange = 10,
  kIntegrity = 11,
};

const char* errorCodeName(ErrorCode c);

// Sizes checked before anything is allocated.
struct Limits {
  size_t max_key = 4096;
  size_t max_value = 16u << 20;
  size_t max_keys_per_request = 4096;
  size_t max_frame = (16u << 20) + (1u << 20);  // a max value plus headroom
};

// A frame the peer should not have sent. Carries the code for the error reply.
class WireError : public std::runtime_error {
 public:
  WireError(ErrorCode code, const std::string& msg) : std::runtime_error(msg), code_(code) {}
  ErrorCode code() const { return code_; }

 private:
  ErrorCode code_;
};

// One request. Which fields an op uses is fixed per op (see docs/store-protocol.md):
// keys/values for the key-value ops, num for a timeout (ms, -1 = none), an add delta, or the
// protocol version (kAuth, whose values are {client nonce, client proof}; an AUTH of another
// version carries its version only: what follows is that version's, and is not read).
struct Request {
  Op op = Op::kPing;
  std::vector<std::string> keys;
  std::vector<std::string> values;
  int64_t num = 0;
};

struct Reply {
  Op op = Op::kOk;
  ErrorCode code = ErrorCode::kMalformed;  // kError
  std::string message;                     // kError
  std::string value;                       // kValue; nonce for kChallenge; proof for kProof
  int64_t num = 0;                         // kInt; version for kChallenge
  bool flag = false;                       // kBool
  std::vector<std::string> values;         // kValues
};

// Whole frames: header + body. Throw WireError(kTooLarge) for a frame whose length would not
// fit the u32 header (a caller bounds its frames by Limits::max_frame before building them).
std::string encodeRequest(const Request& r);
std::string encodeReply(const Reply& r);

// Reads the body length from a 4-byte header; throws kTooLarge over limits.max_frame.
uint32_t decodeHeader(std::string_view header, const Limits& limits);

// Decode a body (without its header). Throw WireError on anything malformed or over limits.
Request decodeRequest(std::string_view body, const Limits& limits);
Reply decodeReply(std::string_view body, const Limits& limits);

Reply errorReply(ErrorCode code, std::string message);

}  // namespace dtrain::store::wire
