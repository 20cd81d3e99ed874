#pragma once
// Internal reduction kernels shared by the transports.
#include <cstddef>

#include "dtrain/comm/types.h"

namespace dtrain::comm::detail {

// dst[i] = a[i] (op) b[i] for count elements, with `a` as the LEFT operand exactly as
// reduceInto(a, b) would compute it (same expression, same bits, including NaN and signed-zero
// cases of min/max). dst may be the same buffer as a or b (element-wise in place); any other
// overlap is undefined. Lets the shared-memory path reproduce the TCP algorithms' operand
// order from separate input buffers without first copying the left operand.
void reduceTo(void* dst, const void* a, const void* b, size_t count, DataType t, ReduceOp op);

}  // namespace dtrain::comm::detail
