#include "dtrain/comm/types.h"

#include <algorithm>
#include <cstring>
#include <type_traits>

#if defined(__x86_64__) && defined(__GNUC__)
#include <cpuid.h>
#include <immintrin.h>
#define DTRAIN_HAVE_F16C_PATH 1
#endif

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

namespace {

// Branch-free (selects only), so that the reduction loops using them vectorise; bit-for-bit
// the same results as the straightforward versions (tests/comm checks every half and bf16
// value, and floats of every exponent).
inline uint32_t bitsOf(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}
inline float floatOf(uint32_t b) {
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}
// c ? x : y by masks: with a ?: the compiler may move a float operation into a branch of
// its own (it could raise a floating-point exception), and a loop with branches does not
// vectorise.
inline uint32_t pick(bool c, uint32_t x, uint32_t y) {
  const uint32_t m = 0u - static_cast<uint32_t>(c);
  return (x & m) | (y & ~m);
}
inline float bf16ToFloatFast(uint16_t v) { return floatOf(static_cast<uint32_t>(v) << 16); }
inline uint16_t floatToBf16Fast(float f) {
  const uint32_t b = bitsOf(f);
  const uint32_t rounded = (b + 0x7fffu + ((b >> 16) & 1u)) >> 16;  // to nearest, ties to even
  const uint32_t quiet = (b >> 16) | 0x40u;                         // a NaN stays a (quiet) NaN
  return static_cast<uint16_t>(pick((b & 0x7fffffffu) > 0x7f800000u, quiet, rounded));
}
inline float halfToFloatFast(uint16_t h) {
  const uint32_t sign = (static_cast<uint32_t>(h) & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
  const uint32_t normal = ((exp + 112u) << 23) | (mant << 13);
  const uint32_t infNan = 0x7f800000u | (mant << 13);
  // zero and subnormals: mant x 2^-24, exact (a normal float times a power of two, never a
  // subnormal operand, so a flush-to-zero mode cannot change it)
  const uint32_t small = bitsOf(static_cast<float>(static_cast<int32_t>(mant)) * 0x1p-24f);
  return floatOf(sign | pick(exp == 0, small, pick(exp == 0x1fu, infNan, normal)));
}
inline uint16_t floatToHalfFast(float f) {
  const uint32_t b = bitsOf(f);
  const uint32_t sign = (b >> 16) & 0x8000u, a = b & 0x7fffffffu;
  // normal half: rebias, round to nearest even on the 13 dropped bits (a carry into the
  // exponent is right, up to infinity from 65520 on)
  const uint32_t normal = (a + 0xc8000fffu + ((a >> 13) & 1u)) >> 13;  // 0xc8000000 = (15 - 127) << 23
  // subnormal half (|f| < 2^-14): adding 0.5 puts the 10 bits at the bottom of the float's
  // mantissa, the float unit rounding them to nearest even
  const uint32_t sub = bitsOf(floatOf(a) + 0.5f) - 0x3f000000u;
  const uint32_t r = pick(a > 0x7f800000u, 0x7e00u, pick(a >= 0x47800000u, 0x7c00u, pick(a < 0x38800000u, sub, normal)));
  return static_cast<uint16_t>(sign | r);
}

}  // namespace

float bf16ToFloat(uint16_t v) { return bf16ToFloatFast(v); }
uint16_t floatToBf16(float f) { return floatToBf16Fast(f); }
float halfToFloat(uint16_t h) { return halfToFloatFast(h); }
uint16_t floatToHalf(float f) { return floatToHalfFast(f); }

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

// 16-bit floats are reduced in float and rounded back, one loop per operation with the
// conversions inlined (no branch inside: they vectorise, 6-10x the speed of one loop asking
// for the operation and converting with branches per element).
template <float (*ToF)(uint16_t), uint16_t (*FromF)(float)>
void reduceTo16(uint16_t* d, const uint16_t* a, const uint16_t* b, size_t n, ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg: return combine(d, a, b, n, [](uint16_t x, uint16_t y) { return FromF(ToF(x) + ToF(y)); });
    case ReduceOp::kMin: return combine(d, a, b, n, [](uint16_t x, uint16_t y) { return FromF(minOf(ToF(x), ToF(y))); });
    case ReduceOp::kMax: return combine(d, a, b, n, [](uint16_t x, uint16_t y) { return FromF(maxOf(ToF(x), ToF(y))); });
  }
}

#ifdef DTRAIN_HAVE_F16C_PATH
// float16 on x86 CPUs with F16C (2012 on): the conversions in hardware, 8 lanes at a time;
// without, the portable branch-free conversions are 2-4x slower than bfloat16's. The same
// bits as the portable path: F16C rounds to nearest even like floatToHalf, min and max keep
// minOf/maxOf's operand rules, and a NaN result is made floatToHalf's (sign | 0x7e00, where
// the hardware would keep part of the payload), so ranks on CPUs with and without F16C
// agree (but for the sign of a NaN from adding two NaNs of opposite signs, which follows
// the operand order the compiler picked on either path). Returns how many leading elements it did (a multiple of 8); the caller does the rest.
template <ReduceOp Op>
__attribute__((target("avx2,f16c"))) size_t reduceHalfF16c(uint16_t* d, const uint16_t* a, const uint16_t* b, size_t n) {
  const __m128i signBit = _mm_set1_epi16(static_cast<short>(0x8000)), quietNan = _mm_set1_epi16(0x7e00);
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a + i)));
    const __m256 y = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + i)));
    __m256 r;
    if constexpr (Op == ReduceOp::kMin || Op == ReduceOp::kMax) {
      // (MINPS/MAXPS(y, x): x when either is NaN or they are equal; then a NaN y wins)
      const __m256 t = Op == ReduceOp::kMin ? _mm256_min_ps(y, x) : _mm256_max_ps(y, x);
      r = _mm256_blendv_ps(t, y, _mm256_cmp_ps(y, y, _CMP_UNORD_Q));
    } else {
      r = _mm256_add_ps(x, y);
    }
    __m128i h = _mm256_cvtps_ph(r, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(r, r, _CMP_UNORD_Q));
    const __m128i nan16 = _mm_packs_epi32(_mm256_castsi256_si128(nan), _mm256_extracti128_si256(nan, 1));
    h = _mm_blendv_epi8(h, _mm_or_si128(_mm_and_si128(h, signBit), quietNan), nan16);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(d + i), h);
  }
  return i;
}

bool haveF16c() {
  // (avx2 through the builtin, which also checks that the OS saves the 256-bit registers;
  // F16C through CPUID, a name clang's builtin does not take)
  static const bool have = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    return __builtin_cpu_supports("avx2") && __get_cpuid(1, &a, &b, &c, &d) && (c & bit_F16C) != 0;
  }();
  return have;
}
#endif

void reduceToHalf(uint16_t* d, const uint16_t* a, const uint16_t* b, size_t n, ReduceOp op) {
  size_t done = 0;
#ifdef DTRAIN_HAVE_F16C_PATH
  if (haveF16c()) {
    switch (op) {
      case ReduceOp::kSum:
      case ReduceOp::kAvg: done = reduceHalfF16c<ReduceOp::kSum>(d, a, b, n); break;
      case ReduceOp::kMin: done = reduceHalfF16c<ReduceOp::kMin>(d, a, b, n); break;
      case ReduceOp::kMax: done = reduceHalfF16c<ReduceOp::kMax>(d, a, b, n); break;
    }
  }
#endif
  reduceTo16<halfToFloatFast, floatToHalfFast>(d + done, a + done, b + done, n - done, op);
}

template <float (*ToF)(uint16_t), uint16_t (*FromF)(float)>
void reduce16(uint16_t* d, const uint16_t* s, size_t n, ReduceOp op) {
  reduceTo16<ToF, FromF>(d, d, s, n, op);
}

}  // namespace

void reduceInto(void* dst, const void* src, size_t n, DataType t, ReduceOp op) {
  switch (t) {
    case DataType::kFloat32: return reduceT(static_cast<float*>(dst), static_cast<const float*>(src), n, op);
    case DataType::kFloat64: return reduceT(static_cast<double*>(dst), static_cast<const double*>(src), n, op);
    case DataType::kInt32: return reduceT(static_cast<int32_t*>(dst), static_cast<const int32_t*>(src), n, op);
    case DataType::kInt64: return reduceT(static_cast<int64_t*>(dst), static_cast<const int64_t*>(src), n, op);
    case DataType::kBFloat16:
      return reduce16<bf16ToFloatFast, floatToBf16Fast>(static_cast<uint16_t*>(dst), static_cast<const uint16_t*>(src), n, op);
    case DataType::kFloat16:
      return reduceToHalf(static_cast<uint16_t*>(dst), static_cast<const uint16_t*>(dst), static_cast<const uint16_t*>(src), n, op);
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
      return reduceTo16<bf16ToFloatFast, floatToBf16Fast>(static_cast<uint16_t*>(dst), static_cast<const uint16_t*>(a),
                                                  static_cast<const uint16_t*>(b), n, op);
    case DataType::kFloat16:
      return reduceToHalf(static_cast<uint16_t*>(dst), static_cast<const uint16_t*>(a), static_cast<const uint16_t*>(b), n, op);
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
      for (size_t i = 0; i < n; ++i) p[i] = floatToBf16Fast(bf16ToFloatFast(p[i]) / static_cast<float>(worldSize));
      break;
    }
    case DataType::kFloat16: {
      auto* p = static_cast<uint16_t*>(data);
      for (size_t i = 0; i < n; ++i) p[i] = floatToHalfFast(halfToFloatFast(p[i]) / static_cast<float>(worldSize));
      break;
    }
  }
}

}  // namespace dtrain::comm
