#include "dtrain/comm/types.h"

#include <algorithm>
#include <cstring>
#include <type_traits>

#include <fmt/format.h>

#include "dtrain/common/errors.h"
#include "detail/reduce.h"

namespace dtrain::comm {

size_t elementSize(DataType t) {
  switch (t) {
    case DataType::kFloat32:
    case DataType::kInt32: return 4;
    case DataType::kFloat64:
    case DataType::kInt64: return 8;
    case DataType::kBFloat16:
    case DataType::kFloat16: return 2;
  }
  return 1;
}

const char* name(DataType t) {
  switch (t) {
    case DataType::kFloat32: return "float";
    case DataType::kFloat64: return "double";
    case DataType::kInt32: return "int32";
    case DataType::kInt64: return "int64";
    case DataType::kBFloat16: return "bfloat16";
    case DataType::kFloat16: return "half";
  }
  return "?";
}

const char* name(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return "sum";
    case ReduceOp::kAvg: return "avg";
    case ReduceOp::kMin: return "min";
    case ReduceOp::kMax: return "max";
  }
  return "?";
}

DataType parseDataType(const std::string& s) {
  if (s == "float" || s == "float32" || s == "fp32") return DataType::kFloat32;
  if (s == "double" || s == "float64" || s == "fp64") return DataType::kFloat64;
  if (s == "int32" || s == "int") return DataType::kInt32;
  if (s == "int64") return DataType::kInt64;
  if (s == "bfloat16" || s == "bf16") return DataType::kBFloat16;
  if (s == "half" || s == "float16" || s == "fp16") return DataType::kFloat16;
  throw SpecError(fmt::format("unknown data type \"{}\"; use float, double, int32, int64, bfloat16 or half", s));
}

ReduceOp parseReduceOp(const std::string& s) {
  if (s == "sum") return ReduceOp::kSum;
  if (s == "avg") return ReduceOp::kAvg;
  if (s == "min") return ReduceOp::kMin;
  if (s == "max") return ReduceOp::kMax;
  throw SpecError(fmt::format("unknown reduction \"{}\"; use sum, avg, min or max", s));
}

float bf16ToFloat(uint16_t v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

uint16_t floatToBf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);  // quiet NaN
  uint32_t rounding = 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>((bits + rounding) >> 16);
}

float halfToFloat(uint16_t h) {
  uint32_t sign = (h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      exp = 127 - 15 + 1;
      while (!(mant & 0x400u)) {
        mant <<= 1;
        --exp;
      }
      mant &= 0x3ffu;
      bits = sign | (exp << 23) | (mant << 13);
    }
  } else if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

uint16_t floatToHalf(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  uint32_t absBits = bits & 0x7fffffffu;
  if (absBits > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);  // NaN
  if (absBits >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // overflow -> inf
  if (absBits < 0x38800000u) {  // subnormal or zero in half
    if (absBits < 0x33000000u) return sign;
    uint32_t exp = absBits >> 23;
    uint32_t mant = (absBits & 0x7fffffu) | 0x800000u;
    uint32_t shift = 126 - exp;  // 113 <= exp <= 112+... ; shift in [14, 24]
    uint32_t halfMant = mant >> shift;
    uint32_t rem = mant & ((1u << shift) - 1);
    uint32_t halfway = 1u << (shift - 1);
    if (rem > halfway || (rem == halfway && (halfMant & 1u))) ++halfMant;
    return static_cast<uint16_t>(sign | halfMant);
  }
  uint32_t rounded = absBits + 0xfffu + ((absBits >> 13) & 1u);
  return static_cast<uint16_t>(sign | ((rounded - 0x38000000u) >> 13));
}

namespace {

// min and max in which a NaN from any rank wins, as it does for sum (and as torch.minimum and
// torch.maximum do): std::min and std::max answer by operand order when one side is NaN, so
// a NaN was kept or dropped by which rank held it and where the ring's order put it. Equal
// to std::min/std::max otherwise. Two selects, no branches: the loops stay vectorised (with
// early returns max ran at 0.76-0.90x of std::max's speed from 256 KiB up).
template <typename T>
T minOf(T x, T y) {
  const T r = y < x ? y : x;  // x when either is NaN
  if constexpr (std::is_floating_point_v<T>) return y != y ? y : r;
  return r;
}
template <typename T>
T maxOf(T x, T y) {
  const T r = x < y ? y : x;  // x when either is NaN
  if constexpr (std::is_floating_point_v<T>) return y != y ? y : r;
  return r;
}

template <typename T>
void reduceT(T* d, const T* s, size_t n, ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg:
      for (size_t i = 0; i < n; ++i) d[i] = d[i] + s[i];
      break;
    case ReduceOp::kMin:
      for (size_t i = 0; i < n; ++i) d[i] = minOf(d[i], s[i]);
      break;
    case ReduceOp::kMax:
      for (size_t i = 0; i < n; ++i) d[i] = maxOf(d[i], s[i]);
      break;
  }
}

// dst = a (op) b; the three loops are separate so that the compiler's aliasing checks see at
// most two distinct pointers and the common in-place cases stay vectorised.
template <typename T, typename F>
void combine(T* dst, const T* a, const T* b, size_t n, F f) {
  if (dst == a) {
    for (size_t i = 0; i < n; ++i) dst[i] = f(dst[i], b[i]);
  } else if (dst == b) {
    for (size_t i = 0; i < n; ++i) dst[i] = f(a[i], dst[i]);
  } else {
    for (size_t i = 0; i < n; ++i) dst[i] = f(a[i], b[i]);
  }
}

// Same expressions as reduceT, so reduceTo(d, a, b) == (copy a to d; reduceInto(d, b)).
template <typename T>
void reduceToT(T* d, const T* a, const T* b, size_t n, ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg: return combine(d, a, b, n, [](T x, T y) { return static_cast<T>(x + y); });
    case ReduceOp::kMin: return combine(d, a, b, n, [](T x, T y) { return minOf(x, y); });
    case ReduceOp::kMax: return combine(d, a, b, n, [](T x, T y) { return maxOf(x, y); });
  }
}

template <float (*ToF)(uint16_t), uint16_t (*FromF)(float)>
void reduceTo16(uint16_t* d, const uint16_t* a, const uint16_t* b, size_t n, ReduceOp op) {
  for (size_t i = 0; i < n; ++i) {
    float x = ToF(a[i]), y = ToF(b[i]);
    float r = op == ReduceOp::kMin ? minOf(x, y) : op == ReduceOp::kMax ? maxOf(x, y) : x + y;
    d[i] = FromF(r);
  }
}

template <float (*ToF)(uint16_t), uint16_t (*FromF)(float)>
void reduce16(uint16_t* d, const uint16_t* s, size_t n, ReduceOp op) {
  for (size_t i = 0; i < n; ++i) {
    float a = ToF(d[i]), b = ToF(s[i]);
    float r = op == ReduceOp::kMin ? minOf(a, b) : op == ReduceOp::kMax ? maxOf(a, b) : a + b;
    d[i] = FromF(r);
  }
}

}  // namespace

void reduceInto(void* dst, const void* src, size_t n, DataType t, ReduceOp op) {
  switch (t) {
    case DataType::kFloat32: return reduceT(static_cast<float*>(dst), static_cast<const float*>(src), n, op);
    case DataType::kFloat64: return reduceT(static_cast<double*>(dst), static_cast<const double*>(src), n, op);
    case DataType::kInt32: return reduceT(static_cast<int32_t*>(dst), static_cast<const int32_t*>(src), n, op);
    case DataType::kInt64: return reduceT(static_cast<int64_t*>(dst), static_cast<const int64_t*>(src), n, op);
    case DataType::kBFloat16:
      return reduce16<bf16ToFloat, floatToBf16>(static_cast<uint16_t*>(dst), static_cast<const uint16_t*>(src), n, op);
    case DataType::kFloat16:
      return reduce16<halfToFloat, floatToHalf>(static_cast<uint16_t*>(dst), static_cast<const uint16_t*>(src), n, op);
  }
}

namespace detail {

void reduceTo(void* dst, const void* a, const void* b, size_t n, DataType t, ReduceOp op) {
  switch (t) {
    case DataType::kFloat32:
      return reduceToT(static_cast<float*>(dst), static_cast<const float*>(a), static_cast<const float*>(b), n, op);
    case DataType::kFloat64:
      return reduceToT(static_cast<double*>(dst), static_cast<const double*>(a), static_cast<const double*>(b), n, op);
    case DataType::kInt32:
      return reduceToT(static_cast<int32_t*>(dst), static_cast<const int32_t*>(a), static_cast<const int32_t*>(b), n, op);
    case DataType::kInt64:
      return reduceToT(static_cast<int64_t*>(dst), static_cast<const int64_t*>(a), static_cast<const int64_t*>(b), n, op);
    case DataType::kBFloat16:
      return reduceTo16<bf16ToFloat, floatToBf16>(static_cast<uint16_t*>(dst), static_cast<const uint16_t*>(a),
                                                  static_cast<const uint16_t*>(b), n, op);
    case DataType::kFloat16:
      return reduceTo16<halfToFloat, floatToHalf>(static_cast<uint16_t*>(dst), static_cast<const uint16_t*>(a),
                                                  static_cast<const uint16_t*>(b), n, op);
  }
}

}  // namespace detail

void finishAvg(void* data, size_t n, DataType t, int worldSize) {
  switch (t) {
    case DataType::kFloat32: {
      auto* p = static_cast<float*>(data);
      for (size_t i = 0; i < n; ++i) p[i] /= static_cast<float>(worldSize);
      break;
    }
    case DataType::kFloat64: {
      auto* p = static_cast<double*>(data);
      for (size_t i = 0; i < n; ++i) p[i] /= worldSize;
      break;
    }
    case DataType::kInt32: {
      auto* p = static_cast<int32_t*>(data);
      for (size_t i = 0; i < n; ++i) p[i] /= worldSize;
      break;
    }
    case DataType::kInt64: {
      auto* p = static_cast<int64_t*>(data);
      for (size_t i = 0; i < n; ++i) p[i] /= worldSize;
      break;
    }
    case DataType::kBFloat16: {
      auto* p = static_cast<uint16_t*>(data);
      for (size_t i = 0; i < n; ++i) p[i] = floatToBf16(bf16ToFloat(p[i]) / static_cast<float>(worldSize));
      break;
    }
    case DataType::kFloat16: {
      auto* p = static_cast<uint16_t*>(data);
      for (size_t i = 0; i < n; ++i) p[i] = floatToHalf(halfToFloat(p[i]) / static_cast<float>(worldSize));
      break;
    }
  }
}

}  // namespace dtrain::comm
