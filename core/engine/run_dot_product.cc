// run_dot_product.cc: the runner of the dot-product family (dot_product,
// distance, bilinear), whose scores all take the flash kernel's one form
// s = scale q'.k + r_i + c_j (core/kernels/flash_kernel.h); dot_product also
// over grouped heads (4-D rows), one problem per (example, query head), and
// with a request's sliding window and soft-cap.
#include <vector>

#include "core/engine/attention_tasks.h"
#include "core/engine/group_scratch.h"
#include "core/engine/projection.h"
#include "core/engine/runners.h"
#include "core/thread_pool.h"

namespace attention::internal {
namespace {

// bilinear: q' = q^T W_k, so q'.k = q.(W_k k); one GEMM over all queries of
// the group, into `once` or the thread's scratch.
const float* MappedQueries(ThreadPool& pool, const Model& model,
                           std::span<const ValidatedRequest> requests, int64_t total_queries,
                           Stops stops, std::vector<float>& once) {
  const auto [stacked_queries, mapped] = GroupScratch<2>(
      {StackedFloats(requests, QueriesOf), total_queries * model.w_k.cols()}, once);
  RunProjections(pool, {{StackRows(requests, QueriesOf, stacked_queries), mapped, total_queries,
                         &model.w_k, nullptr, /*transposed=*/false}},
                 LoneStop(stops));
  return mapped;
}

// distance: -scale/2 |q - k|^2 = scale q.k - scale/2 |q|^2 - scale/2 |k|^2,
// so each query row and key row of a request gets its -scale/2 |x|^2 bias.
struct DistanceBiases {
  std::vector<float> queries, keys;
};

DistanceBiases DistanceBiasesOf(const ValidatedRequest& v) {
  const AttentionDims& d = v.dims;
  const float half_scale = 0.5f * d.scale;
  ConstMatrixMap q(v.request->queries.data.data(), d.batch * d.num_queries, d.query_size);
  ConstMatrixMap k(ResolvedKeys(*v.request).data.data(), d.batch * d.num_keys, d.key_size);
  DistanceBiases biases{std::vector<float>(q.rows()), std::vector<float>(k.rows())};
  Eigen::Map<Vector>(biases.queries.data(), q.rows()) = -half_scale * q.rowwise().squaredNorm();
  Eigen::Map<Vector>(biases.keys.data(), k.rows()) = -half_scale * k.rowwise().squaredNorm();
  return biases;
}

// The problem of example b of request v, head h (grouped heads: query head
// h on kv head h / (H / H_kv); otherwise the one head, 0), whose queries
// (already mapped for bilinear) start at `queries`.
FlashProblem ExampleProblem(const Model& model, const ValidatedRequest& v, int64_t b, int64_t h,
                            const float* queries, const DistanceBiases& biases,
                            AttentionResult& result, RequestStop* stop) {
  const AttentionRequest& request = *v.request;
  const AttentionDims& d = v.dims;
  const int64_t head_size = d.key_size;
  const int64_t heads = d.num_heads, kv_heads = d.num_kv_heads;
  const int64_t kv_head = h / (heads / kv_heads);
  FlashProblem p;
  p.queries = queries + (b * d.num_queries * heads + h) * head_size;
  p.keys = ResolvedKeys(request).data.data() + (b * d.num_keys * kv_heads + kv_head) * d.key_size;
  p.values =
      ResolvedValues(request).data.data() + (b * d.num_keys * kv_heads + kv_head) * d.value_size;
  p.output = result.output.data.data() + (b * d.num_queries * heads + h) * d.value_size;
  p.query_stride = heads * head_size;
  p.key_stride = kv_heads * d.key_size;
  p.value_stride = kv_heads * d.value_size;
  p.output_stride = heads * d.value_size;
  p.num_queries = d.num_queries;
  p.num_keys = d.num_keys;
  p.head_size = head_size;
  p.value_size = d.value_size;
  p.scale = d.scale;
  if (!biases.queries.empty()) {
    p.query_bias = biases.queries.data() + b * d.num_queries;
    p.key_bias = biases.keys.data() + b * d.num_keys;
  }
  p.bounds = BoundsOf(v, b);
  p.bounds.window = request.sliding_window.value_or(0);
  p.terms.softcap = request.softcap.value_or(0.0f);
  p.distance = model.kind == Kind::kDistance;
  if (model.kind == Kind::kDotProduct) p.precision = model.precision;
  p.stop = stop;
  return p;
}

}  // namespace

void RunDotProductFamily(ThreadPool& pool, const Model& model,
                         std::span<const ValidatedRequest> requests,
                         std::span<AttentionResult> results, Stops stops) {
  const size_t n = requests.size();
  const std::vector<int64_t> query_rows = TokenOffsets(requests, /*keys=*/false);
  std::vector<float> once;
  const float* mapped_queries =
      model.kind == Kind::kBilinear
          ? MappedQueries(pool, model, requests, query_rows.back(), stops, once)
          : nullptr;
  std::vector<DistanceBiases> biases(n);
  if (model.kind == Kind::kDistance) {
    for (size_t r = 0; r < n; ++r) biases[r] = DistanceBiasesOf(requests[r]);
  }

  // Tasks point into `problems`: reserve it whole so it never reallocates.
  std::vector<FlashProblem> problems;
  size_t num_problems = 0;
  for (size_t r = 0; r < n; ++r) num_problems += requests[r].dims.batch * requests[r].dims.num_heads;
  problems.reserve(num_problems);
  std::vector<AttentionTask> tasks;
  for (size_t r = 0; r < n; ++r) {
    const AttentionDims& d = requests[r].dims;
    const float* queries = mapped_queries ? mapped_queries + query_rows[r] * d.key_size
                                          : requests[r].request->queries.data.data();
    for (int64_t b = 0; b < d.batch; ++b) {
      for (int64_t h = 0; h < d.num_heads; ++h) {
        problems.push_back(
            ExampleProblem(model, requests[r], b, h, queries, biases[r], results[r], stops[r]));
        AddTasks(problems.back(), WeightsOf(results[r], b * d.num_heads + h, d), tasks);
      }
    }
  }
  RunAttention(pool, tasks);
}

}  // namespace attention::internal
