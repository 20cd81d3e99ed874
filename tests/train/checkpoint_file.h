#pragma once
// Test helper: the bytes of a checkpoint file around a hand-made payload, framed as
// lib/train/src/checkpoint.cc frames one (magic, u64 length, payload, SHA-256 of the payload),
// for tests of files that an older or a damaged writer left.
#include <cstdint>
#include <string>

#include "dtrain/train/trainer.h"

namespace dtrain::train::testing {

inline std::string checkpointFileBytes(const std::string& payload) {
  std::string file = "DTRCKPT1";
  const uint64_t len = payload.size();
  file.append(reinterpret_cast<const char*>(&len), sizeof(len));
  file += payload;
  const std::string hex = sha256Hex(payload.data(), payload.size());
  for (size_t i = 0; i < hex.size(); i += 2) file.push_back(static_cast<char>(std::stoi(hex.substr(i, 2), nullptr, 16)));
  return file;
}

}  // namespace dtrain::train::testing
