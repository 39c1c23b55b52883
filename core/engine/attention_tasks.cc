// attention_tasks.cc: flash problems as query-tile tasks (attention_tasks.h).
#include "core/engine/attention_tasks.h"

#include <algorithm>
#include <utility>

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

void RunTask(const AttentionTask& task) {
  // A stopped problem's RequestStop remembers why; nothing to do here.
  if (task.weights) {
    AttentionWithWeights(*task.problem, task.begin, task.end, task.weights,
                         task.problem->num_keys);
  } else {
    FlashAttention(*task.problem, task.begin, task.end);
  }
}

void RunEach(ThreadPool& pool, const std::vector<AttentionTask>& tasks) {
  pool.ParallelFor(static_cast<int64_t>(tasks.size()),
                   [&](int64_t i) { RunTask(tasks[i]); });
}

// One unit of work of a split run: a whole task (parts 0), or range
// `range` of a task's keys [key_begin, key_end) into the task's parts.
struct Piece {
  int64_t task;
  int64_t key_begin = 0, key_end = 0;
  int64_t range = 0, ranges = 0;
};

// Keys [lo, hi) that some row of `task` allows.
std::pair<int64_t, int64_t> KeysOf(const AttentionTask& task) {
  const FlashProblem& p = *task.problem;
  int64_t lo = p.num_keys, hi = 0;
  for (int64_t i = task.begin; i < task.end; ++i) {
    lo = std::min(lo, p.bounds.First(i));
    hi = std::max(hi, p.AllowedKeys(i));
  }
  return {std::min(lo, hi), hi};
}

// RunAttention with split_keys, for fewer tasks than the pool keeps busy.
void RunSplit(ThreadPool& pool, const std::vector<AttentionTask>& tasks, int64_t want) {
  const int64_t count = static_cast<int64_t>(tasks.size());
  const int64_t ranges_per_task = (want + count - 1) / count;
  std::vector<Piece> pieces;
  std::vector<int64_t> first_part(count, 0);  // of the task's parts in `parts`
  int64_t part_floats = 0;
  for (int64_t t = 0; t < count; ++t) {
    const AttentionTask& task = tasks[t];
    const auto [lo, hi] = KeysOf(task);
    const int64_t ranges = std::min(ranges_per_task, (hi - lo) / kMinSplitKeys);
    if (task.weights != nullptr || ranges < 2 || !SplitsKeys(*task.problem)) {
      pieces.push_back({t});
      continue;
    }
    // Ranges of whole key tiles, so each begins where the unsplit kernel
    // would begin a tile.
    const int64_t length = ((hi - lo + ranges - 1) / ranges + kFlashKeyTile - 1) / kFlashKeyTile *
                           kFlashKeyTile;
    first_part[t] = part_floats;
    const int64_t rows = task.end - task.begin;
    const int64_t used = (hi - lo + length - 1) / length;
    for (int64_t range = 0; range < used; ++range) {
      const int64_t begin = lo + range * length;
      pieces.push_back({t, begin, std::min(hi, begin + length), range, used});
    }
    part_floats += used * rows * (2 + task.problem->value_size);
  }
  std::vector<float> floats(part_floats);
  // Part `range` of task t: its rows' max, sum and accumulator.
  const auto part = [&](const Piece& piece) {
    const AttentionTask& task = tasks[piece.task];
    const int64_t rows = task.end - task.begin;
    float* base = floats.data() + first_part[piece.task] +
                  piece.range * rows * (2 + task.problem->value_size);
    return KeyRangePart{base, base + rows, base + 2 * rows};
  };
  std::vector<char> completed(pieces.size(), 1);
  pool.ParallelFor(static_cast<int64_t>(pieces.size()), [&](int64_t i) {
    const Piece& piece = pieces[i];
    const AttentionTask& task = tasks[piece.task];
    if (piece.ranges == 0) {
      RunTask(task);
      return;
    }
    completed[i] = FlashAttentionOverKeys(*task.problem, task.begin, task.end, piece.key_begin,
                                          piece.key_end, part(piece));
  });
  // Each split task's parts merged, unless a range stopped (its problem's
  // RequestStop remembers why).
  for (size_t i = 0; i < pieces.size();) {
    const Piece& piece = pieces[i];
    if (piece.ranges == 0) {
      ++i;
      continue;
    }
    std::vector<KeyRangePart> parts;
    bool whole = true;
    for (int64_t r = 0; r < piece.ranges; ++r) {
      parts.push_back(part(pieces[i + r]));
      whole = whole && completed[i + r] != 0;
    }
    const AttentionTask& task = tasks[piece.task];
    if (whole) MergeKeyRanges(*task.problem, task.begin, task.end, parts);
    i += piece.ranges;
  }
}

}  // namespace

void RunAttention(ThreadPool& pool, const std::vector<AttentionTask>& tasks, bool split_keys) {
  const int64_t want = kSplitTasksPerThread * pool.num_threads();
  if (split_keys && pool.num_threads() > 1 && static_cast<int64_t>(tasks.size()) < want) {
    return RunSplit(pool, tasks, want);
  }
  const int64_t tiles =
      static_cast<int64_t>(tasks.size()) / (kTasksPerThread * pool.num_threads());
  if (tiles < 2) return RunEach(pool, tasks);
  RunEach(pool, MergeTiles(tasks, tiles));
}

}  // namespace attention::internal
