// run_additive.cc: the runner of additive models,
// s[i,j] = w_v . tanh(W_q q_i + W_k k_j), one query row at a time so the
// (n_q x n_k x h) tensor never exists.
#include <algorithm>
#include <array>
#include <vector>

#include "core/engine/attention_tasks.h"
#include "core/engine/group_scratch.h"
#include "core/kernels/masked_softmax.h"
#include "core/engine/projection.h"
#include "core/engine/runners.h"
#include "core/thread_pool.h"

namespace attention::internal {
namespace {

// What every block of a group reads: W_q q and W_k k of every token of the
// group, (tokens x h) each, stacked as TokenOffsets says.
struct AdditiveGroup {
  const Model& model;
  std::span<const ValidatedRequest> requests;
  std::span<AttentionResult> results;
  Stops stops;
  std::vector<int64_t> query_rows, key_rows;
  const float* projected_queries = nullptr;
  const float* projected_keys = nullptr;
  // Keys whose tanh features are formed at once: bounds the features'
  // memory whatever n_k, and spaces the polls of a long row kStopPollWork
  // apart.
  int64_t keys_per_chunk = 0;
};

// Query rows [begin, end) of one example of one request: a task.
struct QueryBlock {
  size_t request;
  int64_t example, begin, end;
};

std::vector<QueryBlock> QueryBlocks(std::span<const ValidatedRequest> requests) {
  std::vector<QueryBlock> blocks;
  for (size_t r = 0; r < requests.size(); ++r) {
    const AttentionDims& d = requests[r].dims;
    for (int64_t b = 0; b < d.batch; ++b) {
      for (int64_t begin = 0; begin < d.num_queries; begin += kFlashQueryTile) {
        blocks.push_back({r, b, begin, std::min(d.num_queries, begin + kFlashQueryTile)});
      }
    }
  }
  return blocks;
}

// Scores, softmax and output of one block's query rows; returns early once
// the request's stop says so.
void RunBlock(const AdditiveGroup& group, const QueryBlock& block) {
  RequestStop* const stop = group.stops[block.request];
  if (stop != nullptr && stop->Stopped()) return;
  const int64_t hidden = group.model.w_q.rows();
  const ValidatedRequest& v = group.requests[block.request];
  const AttentionDims& d = v.dims;
  AttentionResult& result = group.results[block.request];
  const int64_t b = block.example;
  ConstMatrixMap keys(
      group.projected_keys + (group.key_rows[block.request] + b * d.num_keys) * hidden,
      d.num_keys, hidden);
  ConstMatrixMap queries(
      group.projected_queries + (group.query_rows[block.request] + b * d.num_queries) * hidden,
      d.num_queries, hidden);
  ConstMatrixMap values(ResolvedValues(*v.request).data.data() + b * d.num_keys * d.value_size,
                        d.num_keys, d.value_size);
  MatrixMap output(result.output.data.data() + b * d.num_queries * d.value_size, d.num_queries,
                   d.value_size);
  const Eigen::Map<const Vector> w_v(group.model.w_v.data(), hidden);
  float* weights = WeightsOf(result, b, d);
  const KeyBounds bounds = BoundsOf(v, b);

  thread_local RowMatrix features;  // (keys of a chunk x h) tanh features of one query
  thread_local Vector scores;
  scores.resize(d.num_keys);
  for (int64_t i = block.begin; i < block.end; ++i) {
    const int64_t bound = bounds.Allowed(i, d.num_keys);
    for (int64_t key = 0; key < bound; key += group.keys_per_chunk) {
      if (key > 0 && stop != nullptr && stop->Stopped()) return;
      const int64_t count = std::min(group.keys_per_chunk, bound - key);
      features.resize(count, hidden);
      features = (keys.middleRows(key, count).rowwise() + queries.row(i)).array().tanh();
      scores.segment(key, count).noalias() = features * w_v;
    }
    const int64_t nonzero =
        MaskedSoftmaxRow({scores.data(), static_cast<size_t>(scores.size())}, bound);
    output.row(i).noalias() = scores.head(nonzero).transpose() * values.topRows(nonzero);
    if (weights) std::copy_n(scores.data(), d.num_keys, weights + i * d.num_keys);
  }
  // Only what ordinary requests need stays with the thread.
  if (scores.size() > kKeptKernelScratchFloats) scores.resize(0);
}

}  // namespace

void RunAdditive(ThreadPool& pool, const Model& model, std::span<const ValidatedRequest> requests,
                 std::span<AttentionResult> results, Stops stops) {
  const int64_t hidden = model.w_q.rows();
  AdditiveGroup group{model, requests, results, stops, TokenOffsets(requests, /*keys=*/false),
                      TokenOffsets(requests, /*keys=*/true)};
  std::vector<float> once;
  const std::array<float*, 4> scratch = GroupScratch<4>(
      {group.query_rows.back() * hidden, group.key_rows.back() * hidden,
       StackedFloats(requests, QueriesOf), StackedFloats(requests, KeysOf)},
      once);
  group.projected_queries = scratch[0];
  group.projected_keys = scratch[1];
  RunProjections(pool, {{StackRows(requests, QueriesOf, scratch[2]), scratch[0],
                         group.query_rows.back(), &model.w_q, nullptr},
                        {StackRows(requests, KeysOf, scratch[3]), scratch[1],
                         group.key_rows.back(), &model.w_k, nullptr}},
                 LoneStop(stops));
  group.keys_per_chunk = std::max<int64_t>(
      kFlashKeyTile, kStopPollWork / (hidden * static_cast<int64_t>(kAdditiveHiddenWork)));
  const std::vector<QueryBlock> blocks = QueryBlocks(requests);
  pool.ParallelFor(static_cast<int64_t>(blocks.size()),
                   [&](int64_t t) { RunBlock(group, blocks[t]); });
}

}  // namespace attention::internal
