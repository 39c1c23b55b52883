// attention_tasks.h: the flash kernel's problems split into tasks of query
// tiles and run over the pool, for the runners of the dot-product
// family and multi_head (internal to the engine).
#pragma once

#include <cstdint>
#include <vector>

#include "core/engine/engine.h"
#include "core/kernels/flash_kernel.h"

namespace attention {

class ThreadPool;

namespace internal {

// The length mask and causal flag of example b, in the kernel's terms.
KeyBounds BoundsOf(const ValidatedRequest& v, int64_t b);

// Where the attention weights of slice `slice` (an example, or an (example,
// head)) go: into the result's weights, or null when none were asked for.
float* WeightsOf(AttentionResult& result, int64_t slice, const AttentionDims& dims);

// One attention task: rows [begin, end) of a problem, and where its weights go.
struct AttentionTask {
  const FlashProblem* problem;
  float* weights;  // the problem's (n_q x n_k) weights, or null
  int64_t begin, end;
};

// One task per query tile of `problem`, which must outlive the tasks.
void AddTasks(const FlashProblem& problem, float* weights, std::vector<AttentionTask>& tasks);

// Runs the tasks over the pool. Where there are many more tasks than
// threads, adjacent query tiles of a problem whose keys the kernel pairs per
// call (PairsKeysPerCall: bf16 on the avx512_bf16 path) run as one task.
// With `split_keys`, where there are fewer tasks than kSplitTasksPerThread
// per thread, a task without weights over at least 2 kMinSplitKeys keys
// is cut into ranges of its keys (FlashAttentionOverKeys), as many as bring
// the tasks to that count, each range at least kMinSplitKeys long; the
// ranges' parts are merged (MergeKeyRanges) once every range is done.
void RunAttention(ThreadPool& pool, const std::vector<AttentionTask>& tasks,
                  bool split_keys = false);

// Tasks per thread below which split_keys cuts keys: enough for the
// dynamic hand-out to even out ranges that run slower than others on a
// shared machine.
inline constexpr int64_t kSplitTasksPerThread = 4;
// Fewest keys of a range: a range's fixed costs (the query tile's set-up,
// its share written and merged) stay well under a percent of its keys'.
inline constexpr int64_t kMinSplitKeys = 1024;

}  // namespace internal
}  // namespace attention
