#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

namespace dtrain::comm {

enum class DataType { kFloat32, kFloat64, kInt32, kInt64, kBFloat16, kFloat16 };
enum class ReduceOp { kSum, kAvg, kMin, kMax };

size_t elementSize(DataType t);
const char* name(DataType t);   // "float", "double", "int32", "int64", "bfloat16", "half"
const char* name(ReduceOp op);  // "sum", "avg", "min", "max"
// Parses the names above (and "float32", "float64", "fp16", "bf16"); throws SpecError.
DataType parseDataType(const std::string& s);
ReduceOp parseReduceOp(const std::string& s);

// dst[i] = dst[i] (op) src[i] for count elements. The operand order is fixed, so the same
// inputs give the same bits on every rank. Avg is reduced as Sum; finishAvg divides after.
void reduceInto(void* dst, const void* src, size_t count, DataType t, ReduceOp op);
void finishAvg(void* data, size_t count, DataType t, int worldSize);

// 16-bit float conversions (round to nearest even).
float bf16ToFloat(uint16_t v);
uint16_t floatToBf16(float f);
float halfToFloat(uint16_t v);
uint16_t floatToHalf(float f);

}  // namespace dtrain::comm
