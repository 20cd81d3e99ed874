#include "dtrain/common/memory.h"

#include <sys/mman.h>

#include <cstdint>

namespace dtrain {

void adviseHugePages(void* p, size_t bytes) {
  constexpr uintptr_t kHuge = 2u << 20;
  const auto begin = reinterpret_cast<uintptr_t>(p);
  const uintptr_t first = (begin + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t last = (begin + bytes) & ~(kHuge - 1);
  if (p && last > first) ::madvise(reinterpret_cast<void*>(first), last - first, MADV_HUGEPAGE);  // (errors: no THP)
}

}  // namespace dtrain
