#include "dtrain/store/auth.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/opensslv.h>
#if OPENSSL_VERSION_NUMBER >= 0x30000000L
#include <openssl/core_names.h>
#include <openssl/params.h>
#else
#include <openssl/hmac.h>
#endif

#include <fmt/format.h>

#include "dtrain/common/errors.h"
#include "dtrain/store/wire.h"

namespace dtrain::store::auth {
namespace detail {

// HMAC-SHA256 over several pieces, so that a 16 MiB frame is not copied to prepend its
// direction and sequence number. OpenSSL 3 deprecates HMAC_CTX for EVP_MAC; both are
// libcrypto's own HMAC.
class Hmac {
 public:
  explicit Hmac(std::string_view key) {
    // An empty key must still be a key: a null pointer would mean "the previous key".
    static const unsigned char kNoKey = 0;
    const auto* k = key.empty() ? &kNoKey : reinterpret_cast<const unsigned char*>(key.data());
#if OPENSSL_VERSION_NUMBER >= 0x30000000L
    static EVP_MAC* const mac = EVP_MAC_fetch(nullptr, "HMAC", nullptr);  // shared, read-only
    ctx_ = mac ? EVP_MAC_CTX_new(mac) : nullptr;
    char digest[] = "SHA256";
    OSSL_PARAM params[] = {OSSL_PARAM_construct_utf8_string(OSSL_MAC_PARAM_DIGEST, digest, 0), OSSL_PARAM_construct_end()};
    if (!ctx_ || EVP_MAC_init(ctx_, k, key.size(), params) != 1) fail();
#else
    ctx_ = HMAC_CTX_new();
    if (!ctx_ || HMAC_Init_ex(ctx_, k, static_cast<int>(key.size()), EVP_sha256(), nullptr) != 1) fail();
#endif
  }
  ~Hmac() {
#if OPENSSL_VERSION_NUMBER >= 0x30000000L
    EVP_MAC_CTX_free(ctx_);
#else
    HMAC_CTX_free(ctx_);
#endif
  }
  Hmac(const Hmac&) = delete;
  Hmac& operator=(const Hmac&) = delete;

  // Starts a new message under the same key: the key's inner and outer states were hashed
  // once, at construction, and are copied back (a null key means "the previous key" to both
  // OpenSSL 3's EVP_MAC_init and 1.1's HMAC_Init_ex).
  Hmac& reset() {
#if OPENSSL_VERSION_NUMBER >= 0x30000000L
    if (EVP_MAC_init(ctx_, nullptr, 0, nullptr) != 1) fail();
#else
    if (HMAC_Init_ex(ctx_, nullptr, 0, nullptr, nullptr) != 1) fail();
#endif
    return *this;
  }

  Hmac& update(std::string_view data) {
    const auto* p = reinterpret_cast<const unsigned char*>(data.data());
#if OPENSSL_VERSION_NUMBER >= 0x30000000L
    if (EVP_MAC_update(ctx_, p, data.size()) != 1) fail();
#else
    if (HMAC_Update(ctx_, p, data.size()) != 1) fail();
#endif
    return *this;
  }

  std::string final() {
    unsigned char out[EVP_MAX_MD_SIZE];
#if OPENSSL_VERSION_NUMBER >= 0x30000000L
    size_t len = 0;
    if (EVP_MAC_final(ctx_, out, &len, sizeof(out)) != 1) fail();
#else
    unsigned int len = 0;
    if (HMAC_Final(ctx_, out, &len) != 1) fail();
#endif
    if (len != kMacSize) fail();
    return std::string(reinterpret_cast<char*>(out), len);
  }

 private:
  // libcrypto without HMAC-SHA256 (a provider configuration that lacks it) cannot run a
  // store at all; the message says what is missing rather than failing authentication.
  [[noreturn]] static void fail() { throw IoError("store: HMAC-SHA256 is not available from OpenSSL's libcrypto"); }

#if OPENSSL_VERSION_NUMBER >= 0x30000000L
  EVP_MAC_CTX* ctx_ = nullptr;
#else
  HMAC_CTX* ctx_ = nullptr;
#endif
};

}  // namespace detail

namespace {

using detail::Hmac;

std::string labelled(std::string_view label, std::string_view token, std::string_view serverNonce,
                     std::string_view clientNonce) {
  return Hmac(token).update(label).update(serverNonce).update(clientNonce).final();
}

}  // namespace

std::string clientProof(std::string_view token, std::string_view serverNonce, std::string_view clientNonce) {
  return labelled("dtrain-store v2 client proof", token, serverNonce, clientNonce);
}

std::string serverProof(std::string_view token, std::string_view serverNonce, std::string_view clientNonce) {
  return labelled("dtrain-store v2 server proof", token, serverNonce, clientNonce);
}

std::string sessionKey(std::string_view token, std::string_view serverNonce, std::string_view clientNonce) {
  return labelled("dtrain-store v2 session key", token, serverNonce, clientNonce);
}

bool macEqual(std::string_view a, std::string_view b) {
  return a.size() == b.size() && CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

FrameMac::FrameMac(std::string key, Direction dir) : mac_(std::make_unique<Hmac>(key)), dir_(dir) {}
FrameMac::~FrameMac() = default;
FrameMac::FrameMac(FrameMac&&) noexcept = default;
FrameMac& FrameMac::operator=(FrameMac&&) noexcept = default;

std::string FrameMac::tag(std::string_view header, std::string_view body) {
  char prefix[9];
  prefix[0] = static_cast<char>(dir_);
  for (int i = 0; i < 8; ++i) prefix[1 + i] = static_cast<char>(static_cast<uint8_t>(seq_ >> (56 - 8 * i)));
  // reset() first, not after final(): a tag that threw half-way leaves no message behind.
  return mac_->reset().update(std::string_view(prefix, sizeof(prefix))).update(header).update(body).final();
}

std::string FrameMac::seal(std::string frame) {
  DTRAIN_CHECK(frame.size() >= wire::kHeaderSize);
  const size_t length = frame.size() - wire::kHeaderSize + kMacSize;
  if (length > 0xffffffffu)
    throw wire::WireError(wire::ErrorCode::kTooLarge, fmt::format("a frame of {} bytes does not fit the u32 length", length));
  for (int i = 0; i < 4; ++i) frame[i] = static_cast<char>(static_cast<uint8_t>(length >> (24 - 8 * i)));
  std::string_view whole(frame);
  std::string t = tag(whole.substr(0, wire::kHeaderSize), whole.substr(wire::kHeaderSize));
  frame += t;
  ++seq_;
  return frame;
}

std::optional<std::string_view> FrameMac::open(std::string_view header, std::string_view payload) {
  // A frame must hold at least an opcode besides its tag.
  if (header.size() != wire::kHeaderSize || payload.size() <= kMacSize) return std::nullopt;
  std::string_view body = payload.substr(0, payload.size() - kMacSize);
  if (!macEqual(payload.substr(body.size()), tag(header, body))) return std::nullopt;
  ++seq_;
  return body;
}

}  // namespace dtrain::store::auth
