// huge_pages.h: large per-call buffers (outputs, weights, a group's
// projections) backed by transparent huge pages where the kernel offers
// them, so that filling one faults in 2 MiB at a time instead of 4 KiB.
//
// A call's buffers are fresh memory every time they outgrow what is kept
// (they are given back so that one large request does not hold its memory
// for the process's life). Filling 100 MiB of fresh 4 KiB pages costs some
// 25,000 page faults, which on the virtual machines the benchmarks ran on
// took as long as half the arithmetic of a 2,048-token prefill of a
// Llama-3-8B-shaped layer (BENCHMARKS.md, "Attention layers"). With
// transparent huge pages in "madvise" mode, Debian's default, only memory
// advised MADV_HUGEPAGE gets them.
#pragma once

#include <cstddef>
#include <type_traits>
#include <vector>

namespace attention {

// Buffers below this are left to malloc's heap as they are: few faults, and
// a huge page would round them up.
inline constexpr size_t kHugePageAdviceBytes = size_t{4} << 20;

// Advises the 2 MiB-aligned pages inside [begin, begin + bytes) to be huge
// pages when first touched. Only advice: where the kernel refuses it,
// buffers stay on small pages and only speed changes.
void AdviseHugePages(const void* begin, size_t bytes);

// Makes room for `count` elements in `buffer`: when it must grow to a large
// size, its contents are dropped and the fresh memory advised before any
// page of it is touched. The size is unchanged; resize or assign next.
template <typename T>
void ReserveOnHugePages(std::vector<T>& buffer, size_t count) {
  static_assert(std::is_trivially_copyable_v<T>);
  if (buffer.capacity() >= count || count * sizeof(T) < kHugePageAdviceBytes) return;
  std::vector<T> fresh;
  fresh.reserve(count);
  AdviseHugePages(fresh.data(), count * sizeof(T));
  buffer.swap(fresh);
}

// buffer = count copies of value, on huge pages when large.
template <typename T>
void AssignOnHugePages(std::vector<T>& buffer, size_t count, T value) {
  ReserveOnHugePages(buffer, count);
  buffer.assign(count, value);
}

// Grows buffer to at least count elements whose contents are left over
// (the caller writes every element before reading it), on huge pages when
// large.
template <typename T>
void GrowOnHugePages(std::vector<T>& buffer, size_t count) {
  if (buffer.size() >= count) return;
  ReserveOnHugePages(buffer, count);
  buffer.resize(count);
}

}  // namespace attention
