#pragma once
// Large buffers and page faults.
#include <cstddef>
#include <vector>

namespace dtrain {

// Asks for transparent huge pages (2 MiB) on the whole 2 MiB pages inside [p, p + bytes),
// before the memory is first touched: on the VMs here a page fault costs ~12 us, so faulting
// in a fresh 50 MB buffer 4 KiB at a time takes ~150 ms, several times the work done with it.
// A hint: without THP (or with it off) nothing changes. Thread-safe.
void adviseHugePages(void* p, size_t bytes);

// v = n copies of value, in a fresh allocation whose pages are asked to be huge before they
// are first touched (for the large buffers a worker allocates once: weights, gradients,
// optimizer state).
template <typename T>
void assignFresh(std::vector<T>& v, size_t n, const T& value = T()) {
  std::vector<T>().swap(v);
  v.reserve(n);
  adviseHugePages(v.data(), n * sizeof(T));
  v.assign(n, value);
}

}  // namespace dtrain
