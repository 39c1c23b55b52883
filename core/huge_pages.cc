// huge_pages.cc: MADV_HUGEPAGE over the aligned interior of a buffer.
#include "core/huge_pages.h"

#include <sys/mman.h>

#include <cstdint>

namespace attention {

void AdviseHugePages(const void* begin, size_t bytes) {
  constexpr uintptr_t kHugePage = uintptr_t{2} << 20;
  const uintptr_t start = reinterpret_cast<uintptr_t>(begin);
  const uintptr_t first = (start + kHugePage - 1) & ~(kHugePage - 1);
  const uintptr_t last = (start + bytes) & ~(kHugePage - 1);
  if (last <= first) return;
  // Advice only: an error (no THP in this kernel) leaves small pages.
  madvise(reinterpret_cast<void*>(first), last - first, MADV_HUGEPAGE);
}

}  // namespace attention
