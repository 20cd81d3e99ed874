// Fuzz target for the store's frame parser: any bytes must either decode or throw
// WireError; nothing else (no crash, no other exception, no huge allocation).
// Built as a libFuzzer binary with -DDTRAIN_FUZZ=ON (clang); otherwise linked with
// replay_main.cc, which CI uses to replay the corpus on every run.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "dtrain/store/wire.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace dtrain::store::wire;
  std::string_view in(reinterpret_cast<const char*>(data), size);
  Limits lim;
  try {
    uint32_t len = decodeHeader(in, lim);
    std::string_view body = in.substr(kHeaderSize);
    if (body.size() > len) body = body.substr(0, len);
    try {
      Request q = decodeRequest(body, lim);
      // Whatever decodes must encode back to a frame that decodes the same.
      std::string again = encodeRequest(q);
      Request q2 = decodeRequest(std::string_view(again).substr(kHeaderSize), lim);
      if (q2.keys != q.keys || q2.values != q.values || q2.num != q.num) __builtin_trap();
    } catch (const WireError&) {
    }
    try {
      decodeReply(body, lim);
    } catch (const WireError&) {
    }
  } catch (const WireError&) {
  }
  return 0;
}
