#pragma once
// The store's authentication, protocol version 2 (docs/store-protocol.md, "Session").
// Both sides prove the job token over both nonces (a client does not talk to a listener
// that lacks the token), and every frame after the handshake carries a MAC under a key
// derived from the token and the nonces, with a direction and a sequence number (a relay
// between them cannot alter, drop, reorder, replay or inject a frame unnoticed).
// Authenticated, not confidential: nothing is encrypted. HMAC-SHA256 from OpenSSL's
// libcrypto. Thread-safety: the functions are stateless; a FrameMac belongs to one
// connection's one direction.
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

namespace dtrain::store::auth {

namespace detail {
class Hmac;
}

inline constexpr size_t kMacSize = 32;  // HMAC-SHA256, untruncated

// HMAC-SHA256(key = token, message = label || server_nonce || client_nonce), with the labels
// "dtrain-store v2 client proof", "... server proof" and "... session key". The nonces are
// 32 bytes each (the caller checks), so no two messages of different labels can be equal.
std::string clientProof(std::string_view token, std::string_view serverNonce, std::string_view clientNonce);
std::string serverProof(std::string_view token, std::string_view serverNonce, std::string_view clientNonce);
std::string sessionKey(std::string_view token, std::string_view serverNonce, std::string_view clientNonce);

// Compares two MACs in time that does not depend on where they differ.
bool macEqual(std::string_view a, std::string_view b);

// The first byte of each frame MAC's message: a frame is valid in one direction only, so a
// relay cannot reflect a client's frames back to it.
enum class Direction : uint8_t { kClientToServer = 'C', kServerToClient = 'S' };

// One direction of one connection after the handshake. The sender seals each frame it sends,
// the receiver opens each frame it receives; both count the frames (seq, from 0), so a frame
// is valid only at its place in the stream.
// tag = HMAC-SHA256(session key, u8 direction || u64 seq || u32 length || body), where
// length (the frame's header, as sent) counts the body and the tag.
// The key's HMAC state is computed once, at construction; each frame starts from a copy of
// it (re-keying per frame, with its digest lookup, was most of a small frame's cost).
class FrameMac {
 public:
  FrameMac(std::string key, Direction dir);
  ~FrameMac();
  FrameMac(FrameMac&&) noexcept;
  FrameMac& operator=(FrameMac&&) noexcept;
  FrameMac(const FrameMac&) = delete;
  FrameMac& operator=(const FrameMac&) = delete;

  // `frame` is a whole frame as wire::encodeRequest/encodeReply wrote it (header + body).
  // Returns it with the tag appended and the header's length grown by kMacSize. Throws
  // wire::WireError(kTooLarge) when the length would not fit its u32.
  std::string seal(std::string frame);

  // `header` is the 4 bytes received, `payload` the length's bytes that followed (body, then
  // tag). Returns the body when the tag is the next frame's in this direction; nullopt when
  // it is not (altered, replayed, reordered, injected, or too short to hold a tag). Only a
  // frame that opens counts.
  std::optional<std::string_view> open(std::string_view header, std::string_view payload);

  uint64_t seq() const { return seq_; }

 private:
  std::string tag(std::string_view header, std::string_view body);

  std::unique_ptr<detail::Hmac> mac_;  // keyed with the session key; reset per frame
  Direction dir_;
  uint64_t seq_ = 0;
};

}  // namespace dtrain::store::auth
