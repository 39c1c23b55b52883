// group_scratch.h: the memory one group of requests runs in, and its inputs
// stacked into it, so that a projection is one GEMM over every token of the
// group (internal to the engine).
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <vector>

#include "core/engine/engine.h"
#include "core/huge_pages.h"

namespace attention::internal {

// Largest scratch kept between calls (16 MiB; see GroupScratch):
// the four (tokens x E) buffers of one multi_head request of 2,048 tokens
// at E = 512, the largest shape BENCHMARKS.md measures. Larger scratch (an
// additive model's n_k x h key projections, say) is freed after its run, so
// the kept memory returns near its level before an oversized request.
inline constexpr int64_t kKeptScratchFloats = int64_t{1} << 22;

// The buffers a run keeps between runs: a group's floats (GroupScratch),
// its projections' input pairs and their bf16 weights widened
// (projection.cc).
struct KeptBuffers {
  std::vector<float> floats;
  std::vector<uint32_t> pairs;
  std::vector<float> widened;
};

// The engine's kept buffers, lent to one Engine::Run call at a time. Kept
// by the calling thread instead, they would start empty on every thread
// that calls Run: the server's first call of a model runs on that model's
// batcher thread, which had computed nothing, and paid the page faults of
// growing them (three quarters of that call's faults; a fault costs 13-17
// us of CPU on the benchmarks' VM: BENCHMARKS.md, "The first call").
// Lent by the engine, they are the ones its warm-up grew, whatever thread
// ran it; and a server keeps one set per call computing at once rather than
// one per thread that ever called.
class ScratchPool {
 public:
  // While it lives, KeptBuffersOfThread() on the constructing thread is a
  // set of the pool's: the one returned last (the warmest), or a new one.
  class Lease {
   public:
    explicit Lease(ScratchPool& pool);
    ~Lease();
    Lease(const Lease&) = delete;
    Lease& operator=(const Lease&) = delete;

   private:
    ScratchPool& pool_;
    std::unique_ptr<KeptBuffers> buffers_;
    KeptBuffers* previous_;  // the thread's lease before this one, if any
  };

  // Bytes the pool's sets hold while none is lent (for a log).
  int64_t Bytes();

 private:
  std::mutex mu_;
  std::vector<std::unique_ptr<KeptBuffers>> free_;  // guarded by mu_
};

// The buffers of the calling thread's lease, or else its own (decoding
// steps, Engine::RunSteps, keep theirs per thread).
KeptBuffers& KeptBuffersOfThread();

// The floats of KeptBuffersOfThread().
inline std::vector<float>& KeptScratch() { return KeptBuffersOfThread().floats; }

// Consecutive buffers of the given sizes (floats) for one group. Fresh
// vectors would be zero-filled, and page-faulted in again on every run once
// glibc hands their memory back to the kernel (mmap'd, or trimmed off the top
// of the heap), so the scratch is kept across runs (KeptScratch); groups
// are bounded (Engine::Run), so it stays a few MiB. A rare huge request gets
// `once` instead, so no buffer keeps gigabytes for the rest of its life.
// Contents are left over: every element is written before it is read.
template <size_t N>
std::array<float*, N> GroupScratch(const std::array<int64_t, N>& sizes, std::vector<float>& once) {
  int64_t total = 0;
  for (int64_t size : sizes) total += size;
  std::vector<float>& memory = total <= kKeptScratchFloats ? KeptScratch() : once;
  GrowOnHugePages(memory, static_cast<size_t>(total));
  std::array<float*, N> buffers;
  float* next = memory.data();
  for (size_t i = 0; i < N; ++i) {
    buffers[i] = next;
    next += sizes[i];
  }
  return buffers;
}

// One input tensor of a request: its queries, keys or values.
using TensorOf = const TensorView& (*)(const ValidatedRequest&);
const TensorView& QueriesOf(const ValidatedRequest& v);
const TensorView& KeysOf(const ValidatedRequest& v);
const TensorView& ValuesOf(const ValidatedRequest& v);

// Floats StackRows() needs: none for a lone request, used in place.
int64_t StackedFloats(std::span<const ValidatedRequest> requests, TensorOf tensor_of);

// The rows of one tensor of every request, stacked into `destination` as one
// (tokens x cols) matrix, so a projection is one GEMM over all tokens of the
// group. A lone request is used in place.
const float* StackRows(std::span<const ValidatedRequest> requests, TensorOf tensor_of,
                       float* destination);

// Token offset of each request in a stacking of its n_q (or n_k) rows, and
// the total last.
std::vector<int64_t> TokenOffsets(std::span<const ValidatedRequest> requests, bool keys);

}  // namespace attention::internal
