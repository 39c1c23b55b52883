// attention_tasks.cc: flash problems as query-tile tasks (attention_tasks.h).
#include "core/engine/attention_tasks.h"

#include <algorithm>

#include "core/thread_pool.h"

namespace attention::internal {

KeyBounds BoundsOf(const ValidatedRequest& v, int64_t b) {
  const AttentionRequest& request = *v.request;
  KeyBounds bounds;
  bounds.causal = request.causal;
  switch (v.dims.length_mask) {
    case AttentionDims::LengthMask::kNone:
      break;
    case AttentionDims::LengthMask::kPerExample:
      bounds.valid_len = request.valid_lens[b];
      break;
    case AttentionDims::LengthMask::kPerQuery:
      bounds.valid_lens = request.valid_lens.data() + b * v.dims.num_queries;
      break;
  }
  return bounds;
}

float* WeightsOf(AttentionResult& result, int64_t slice, const AttentionDims& dims) {
  if (result.attention_weights.data.empty()) return nullptr;
  return result.attention_weights.data.data() + slice * dims.num_queries * dims.num_keys;
}

void AddTasks(const FlashProblem& problem, float* weights, std::vector<AttentionTask>& tasks) {
  for (int64_t begin = 0; begin < problem.num_queries; begin += kFlashQueryTile) {
    tasks.push_back({&problem, weights, begin, std::min(problem.num_queries, begin + kFlashQueryTile)});
  }
}

namespace {

// Tasks per thread that merging query tiles leaves at least: enough for the
// dynamic hand-out (thread_pool.h) to even out uneven tiles (causal or
// masked ones).
constexpr int64_t kTasksPerThread = 8;

// `tasks` with up to `tiles` adjacent query tiles of a problem whose keys and
// values are paired per call (PairsKeysPerCall) in one task, so that they
// are paired once for all of them; other tasks as they were.
std::vector<AttentionTask> MergeTiles(const std::vector<AttentionTask>& tasks, int64_t tiles) {
  std::vector<AttentionTask> merged;
  merged.reserve(tasks.size());
  int64_t tiles_in_last = 0;
  for (const AttentionTask& task : tasks) {
    if (!merged.empty()) {
      AttentionTask& last = merged.back();
      if (last.problem == task.problem && last.end == task.begin && tiles_in_last < tiles &&
          last.weights == nullptr && task.weights == nullptr &&
          PairsKeysPerCall(*task.problem)) {
        last.end = task.end;
        ++tiles_in_last;
        continue;
      }
    }
    merged.push_back(task);
    tiles_in_last = 1;
  }
  return merged;
}

void RunEach(ThreadPool& pool, const std::vector<AttentionTask>& tasks) {
  pool.ParallelFor(static_cast<int64_t>(tasks.size()), [&](int64_t i) {
    const AttentionTask& task = tasks[i];
    // A stopped problem's RequestStop remembers why; nothing to do here.
    if (task.weights) {
      AttentionWithWeights(*task.problem, task.begin, task.end, task.weights,
                           task.problem->num_keys);
    } else {
      FlashAttention(*task.problem, task.begin, task.end);
    }
  });
}

}  // namespace

void RunAttention(ThreadPool& pool, const std::vector<AttentionTask>& tasks) {
  const int64_t tiles =
      static_cast<int64_t>(tasks.size()) / (kTasksPerThread * pool.num_threads());
  if (tiles < 2) return RunEach(pool, tasks);
  RunEach(pool, MergeTiles(tasks, tiles));
}

}  // namespace attention::internal
