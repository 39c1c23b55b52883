// run_multi_head.cc: the runner of multi_head models: project queries, keys
// and values, position them (Hugging Face's qk-norm and rotary), attend per
// head on column slices (query head h on kv head h / (H / H_kv)), project
// the concatenated heads. Each of the four projections is one GEMM over the
// tokens of every request of the group.
#include <algorithm>
#include <deque>
#include <mutex>
#include <vector>

#include "core/engine/attention_tasks.h"
#include "core/engine/group_scratch.h"
#include "core/engine/positions.h"
#include "core/engine/projection.h"
#include "core/engine/runners.h"
#include "core/thread_pool.h"

namespace attention::internal {
namespace {

// Key and value rows example b of a request needs projected before its
// attention. Scores stop at each query's bound, so keys at or past the
// largest bound are never read: keys [0, max_i bound(i)). Values: the same
// rows, or all n_k when some query has no allowed key (e.g. valid length 0:
// its answer is the mean of every value row). The one other reader of the
// value rows past them is a query whose allowed scores sit near or below
// -1e6, which gives its disallowed keys weight; that is known only once its
// scores are, so those rows are projected then (PendingValueRows).
struct RowsRead {
  int64_t keys = 0, values = 0;
};

RowsRead RowsReadOf(const ValidatedRequest& v, int64_t b) {
  const KeyBounds bounds = BoundsOf(v, b);
  const int64_t n_k = v.dims.num_keys;
  int64_t read = 0;
  bool some_query_sees_none = false;
  for (int64_t i = 0; i < v.dims.num_queries && !(read == n_k && some_query_sees_none); ++i) {
    const int64_t allowed = bounds.Allowed(i, n_k);
    read = std::max(read, allowed);
    some_query_sees_none = some_query_sees_none || allowed == 0;
  }
  return {read, some_query_sees_none ? n_k : read};
}

// Projections of the key (or value) rows each example reads, `read[e]` of
// the n_k rows of example e (requests' examples in order), as few products
// as that allows: consecutive examples whose rows are all read make one.
// `in` and `out` hold every example's n_k rows, stacked.
void AddReadRows(std::span<const ValidatedRequest> requests, const std::vector<int64_t>& read,
                 const Projection& whole, std::vector<Projection>& projections) {
  int64_t run_begin = 0, run_end = 0;  // stacked rows of the current product
  auto flush = [&] {
    if (run_end > run_begin) projections.push_back(whole.Rows(run_begin, run_end - run_begin));
  };
  int64_t first = 0;  // the example's first stacked row
  size_t example = 0;
  for (const ValidatedRequest& v : requests) {
    for (int64_t b = 0; b < v.dims.batch; ++b, ++example, first += v.dims.num_keys) {
      if (first != run_end) {
        flush();
        run_begin = first;
      }
      run_end = first + read[example];
      if (read[example] < v.dims.num_keys) {
        flush();
        run_begin = run_end = first + v.dims.num_keys;
      }
    }
  }
  flush();
}

// The value rows of one example that RowsRead left out, projected by the
// first query that needs them, on its own thread (the pool is busy with the
// attention that asks): a rare path, taken only by scores near -1e6.
class PendingValueRows final : public PendingValues {
 public:
  explicit PendingValueRows(const Projection& rest) : rest_(rest) {}

  void Complete() override {
    std::call_once(done_, [this] { ProjectAll(rest_); });
  }

 private:
  const Projection rest_;
  std::once_flag done_;
};

// One group's projections, stacked like the inputs, where the heads read
// them: queries (tokens x H hd), keys and values (tokens x H_kv hd).
// Self-attention (keys and values omitted): Q, K and V side by side, three
// products over the same tokens into one (tokens x (H + 2 H_kv) hd) buffer.
struct MultiHeadGroup {
  std::vector<int64_t> query_rows, key_rows;  // TokenOffsets
  int64_t query_width = 0;                    // H hd
  int64_t kv_width = 0;                       // H_kv hd
  int64_t query_stride = 0, kv_stride = 0;    // floats between rows of q, and of k and v
  Projection queries, keys, values;           // the whole of each, all rows
  std::vector<int64_t> keys_read, values_read;  // RowsReadOf, per example
  float* concat = nullptr;                    // (tokens x H hd) concatenated heads
  float* stacked_output = nullptr;            // (tokens x E), for more than one request
};

bool AllSelfAttention(std::span<const ValidatedRequest> requests) {
  return std::all_of(requests.begin(), requests.end(), [](const ValidatedRequest& r) {
    return !r.request->keys.has_value() && !r.request->values.has_value();
  });
}

// The group's buffers, in `once` or the thread's scratch, and the inputs'
// projections into them.
MultiHeadGroup PlanGroup(const Model& model, std::span<const ValidatedRequest> requests,
                         std::vector<float>& once) {
  MultiHeadGroup g;
  g.query_rows = TokenOffsets(requests, /*keys=*/false);
  g.key_rows = TokenOffsets(requests, /*keys=*/true);
  g.query_width = QueryWidth(model);
  g.kv_width = KvWidth(model);
  const int64_t qw = g.query_width, kw = g.kv_width, width = model.output_size;
  const int64_t total_queries = g.query_rows.back(), total_keys = g.key_rows.back();
  const bool self_attention = AllSelfAttention(requests);
  const auto [q, k, v, concat, stacked_output, stacked_queries, stacked_keys, stacked_values] =
      GroupScratch<8>({total_queries * (self_attention ? qw + 2 * kw : qw),
                       self_attention ? 0 : total_keys * kw, self_attention ? 0 : total_keys * kw,
                       total_queries * qw, requests.size() == 1 ? 0 : total_queries * width,
                       StackedFloats(requests, QueriesOf),
                       self_attention ? 0 : StackedFloats(requests, KeysOf),
                       self_attention ? 0 : StackedFloats(requests, ValuesOf)},
                      once);
  g.query_stride = self_attention ? qw + 2 * kw : qw;
  g.kv_stride = self_attention ? qw + 2 * kw : kw;
  g.concat = concat;
  g.stacked_output = stacked_output;
  const float* const queries_in = StackRows(requests, QueriesOf, stacked_queries);
  g.queries = {queries_in, q, total_queries, &model.w_q, &model.b_q, true, &model.packed_q,
               g.query_stride};
  g.keys = {self_attention ? queries_in : StackRows(requests, KeysOf, stacked_keys),
            self_attention ? q + qw : k, total_keys, &model.w_k, &model.b_k, true,
            &model.packed_k, g.kv_stride};
  g.values = {self_attention ? queries_in : StackRows(requests, ValuesOf, stacked_values),
              self_attention ? q + qw + kw : v, total_keys, &model.w_v, &model.b_v, true,
              &model.packed_v, g.kv_stride};
  for (const ValidatedRequest& request : requests) {
    for (int64_t b = 0; b < request.dims.batch; ++b) {
      const RowsRead read = RowsReadOf(request, b);
      g.keys_read.push_back(read.keys);
      g.values_read.push_back(read.values);
    }
  }
  return g;
}

// Hugging Face layers: qk-norm and rotary on the projected queries and keys,
// each token at its position (the request's position_ids, or its index).
void PositionQueriesAndKeys(ThreadPool& pool, const Model& model, const MultiHeadGroup& g,
                            std::span<const ValidatedRequest> requests) {
  if (!TransformsRows(model.terms)) return;
  std::vector<int64_t> query_positions, key_positions;
  for (const ValidatedRequest& v : requests) {
    for (int64_t b = 0; b < v.dims.batch; ++b) {
      AppendPositions(*v.request, b, v.dims.num_queries, query_positions);
      if (!v.request->keys) continue;
      for (int64_t j = 0; j < v.dims.num_keys; ++j) key_positions.push_back(j);
    }
  }
  const int64_t hd = HeadSize(model);
  const ProjectedRows queries{g.queries.out, g.query_stride, g.query_rows.back(), model.num_heads,
                              &model.terms.q_norm};
  const ProjectedRows keys{g.keys.out, g.kv_stride, g.key_rows.back(), KvHeads(model),
                           &model.terms.k_norm};
  if (key_positions.empty()) {
    const ProjectedRows both[] = {queries, keys};
    PositionRows(pool, model.terms, hd, both, query_positions);
    return;
  }
  PositionRows(pool, model.terms, hd, {&queries, 1}, query_positions);
  PositionRows(pool, model.terms, hd, {&keys, 1}, key_positions);
}

// The problem of head h of an example whose rows start at query_row and
// key_row of the group's stacking: its queries' columns, and those of the
// kv head it reads, h / (H / H_kv).
FlashProblem HeadProblem(const Model& model, const MultiHeadGroup& g, const ValidatedRequest& v,
                         int64_t b, int64_t h, int64_t query_row, int64_t key_row) {
  const AttentionDims& d = v.dims;
  const int64_t head_size = HeadSize(model);
  const int64_t column = h * head_size;
  const int64_t kv_column = h / (model.num_heads / KvHeads(model)) * head_size;
  FlashProblem p;
  p.queries = g.queries.out + query_row * g.query_stride + column;
  p.keys = g.keys.out + key_row * g.kv_stride + kv_column;
  p.values = g.values.out + key_row * g.kv_stride + kv_column;
  p.output = g.concat + query_row * g.query_width + column;
  p.query_stride = g.query_stride;
  p.key_stride = p.value_stride = g.kv_stride;
  p.output_stride = g.query_width;
  p.num_queries = d.num_queries;
  p.num_keys = d.num_keys;
  p.head_size = p.value_size = head_size;
  p.scale = d.scale;
  p.bounds = BoundsOf(v, b);
  p.bounds.window = model.terms.sliding_window;
  p.terms = HeadTerms(model.terms, h);
  return p;
}

// Every head of every example into the concatenated heads.
void AttendHeads(ThreadPool& pool, const Model& model, const MultiHeadGroup& g,
                 std::span<const ValidatedRequest> requests, std::span<AttentionResult> results,
                 Stops stops) {
  const int64_t heads = model.num_heads;
  // Tasks point into `problems`: reserve it whole so it never reallocates.
  std::vector<FlashProblem> problems;
  size_t num_problems = 0;
  for (const ValidatedRequest& v : requests) num_problems += v.dims.batch * heads;
  problems.reserve(num_problems);
  std::vector<AttentionTask> tasks;
  std::deque<PendingValueRows> pending_values;
  size_t example = 0;
  for (size_t r = 0; r < requests.size(); ++r) {
    const AttentionDims& d = requests[r].dims;
    for (int64_t b = 0; b < d.batch; ++b, ++example) {
      const int64_t query_row = g.query_rows[r] + b * d.num_queries;
      const int64_t key_row = g.key_rows[r] + b * d.num_keys;
      PendingValues* pending = nullptr;
      if (g.values_read[example] < d.num_keys) {
        pending = &pending_values.emplace_back(g.values.Rows(
            key_row + g.values_read[example], d.num_keys - g.values_read[example]));
      }
      for (int64_t h = 0; h < heads; ++h) {
        FlashProblem& p = problems.emplace_back(
            HeadProblem(model, g, requests[r], b, h, query_row, key_row));
        p.pending_values = pending;
        p.precision = model.precision;
        p.stop = stops[r];
        AddTasks(p, WeightsOf(results[r], b * heads + h, d), tasks);
      }
    }
  }
  RunAttention(pool, tasks);
}

// The output projection of the concatenated heads, straight into a lone
// request's result, or stacked and copied out to each.
void ProjectOutput(ThreadPool& pool, const Model& model, const MultiHeadGroup& g,
                   std::span<AttentionResult> results, Stops stops) {
  const int64_t total_queries = g.query_rows.back();
  if (results.size() == 1) {
    RunProjections(pool, {{g.concat, results[0].output.data.data(), total_queries, &model.w_o,
                           &model.b_o, true, &model.packed_o}},
                   LoneStop(stops));
    return;
  }
  RunProjections(pool, {{g.concat, g.stacked_output, total_queries, &model.w_o, &model.b_o, true,
                         &model.packed_o}});
  for (size_t r = 0; r < results.size(); ++r) {
    std::copy_n(g.stacked_output + g.query_rows[r] * model.output_size,
                results[r].output.data.size(), results[r].output.data.begin());
  }
}

}  // namespace

void RunMultiHead(ThreadPool& pool, const Model& model,
                  std::span<const ValidatedRequest> requests, std::span<AttentionResult> results,
                  Stops stops) {
  std::vector<float> once;
  const MultiHeadGroup g = PlanGroup(model, requests, once);
  std::vector<Projection> projections = {g.queries};
  AddReadRows(requests, g.keys_read, g.keys, projections);
  AddReadRows(requests, g.values_read, g.values, projections);
  RunProjections(pool, projections, LoneStop(stops));
  PositionQueriesAndKeys(pool, model, g, requests);
  AttendHeads(pool, model, g, requests, results, stops);
  ProjectOutput(pool, model, g, results, stops);
}

}  // namespace attention::internal
