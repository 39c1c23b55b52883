// engine.cc: turns a ragged batch of requests into parallel tasks.
//
// Every kind runs in at most three parallel phases over the whole batch:
//   1. projections: row blocks of x W^T (+ b) for every request at once
//      (multi_head, additive, bilinear); no padding, rows are all real tokens;
//   2. attention: one task per (request, example, head, query block), each
//      bounded by its queries' allowed keys;
//   3. output projection (multi_head).
// Tasks are handed out dynamically, so short or causal rows balance out.
#include "core/engine.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/flash_kernel.h"
#include "core/masked_softmax.h"
#include "core/thread_pool.h"

// OpenBLAS's own threads would fight the pool: every BLAS call runs on the
// thread that makes it.
extern "C" void openblas_set_num_threads(int num_threads);

namespace attention {
namespace {

// Query rows per attention task: the kernel's query tile.
constexpr int64_t kQueryBlock = kFlashQueryTile;
// Rows per projection task: a GEMM this tall runs near peak.
constexpr int64_t kProjectionRows = 256;
// Largest multi-head workspace a thread keeps between calls (64 MiB).
constexpr size_t kKeptWorkspaceFloats = size_t{16} << 20;

using ConstMatrixMap = Eigen::Map<const RowMatrix>;
using MatrixMap = Eigen::Map<RowMatrix>;

// out (rows x out_cols) = in (rows x in_cols) * weight^T + bias, or
// in * weight when `transposed` is false (bilinear's q^T W_k).
struct Projection {
  const float* in;
  float* out;
  int64_t rows;
  const RowMatrix* weight;
  const Vector* bias;  // null: none
  bool transposed = true;

  int64_t in_cols() const { return transposed ? weight->cols() : weight->rows(); }
  int64_t out_cols() const { return transposed ? weight->rows() : weight->cols(); }
};

void RunProjections(ThreadPool& pool, const std::vector<Projection>& projections) {
  struct Block {
    const Projection* projection;
    int64_t begin, end;
  };
  std::vector<Block> blocks;
  for (const Projection& p : projections) {
    for (int64_t begin = 0; begin < p.rows; begin += kProjectionRows) {
      blocks.push_back({&p, begin, std::min(p.rows, begin + kProjectionRows)});
    }
  }
  pool.ParallelFor(static_cast<int64_t>(blocks.size()), [&](int64_t i) {
    const Block& block = blocks[i];
    const Projection& p = *block.projection;
    const int64_t rows = block.end - block.begin;
    ConstMatrixMap in(p.in + block.begin * p.in_cols(), rows, p.in_cols());
    MatrixMap out(p.out + block.begin * p.out_cols(), rows, p.out_cols());
    if (p.transposed) {
      out.noalias() = in * p.weight->transpose();
    } else {
      out.noalias() = in * *p.weight;
    }
    if (p.bias) out.rowwise() += p.bias->transpose();
  });
}

// The rows of one tensor of every request, stacked into one (total x cols)
// matrix, so a projection is one GEMM over all tokens of the batch. A lone
// request is used in place.
class StackedRows {
 public:
  template <typename TensorOf>
  StackedRows(std::span<const ValidatedRequest> requests, TensorOf tensor_of) {
    if (requests.size() == 1) {
      data_ = tensor_of(requests[0]).data.data();
      return;
    }
    size_t elements = 0;
    for (const ValidatedRequest& v : requests) elements += tensor_of(v).data.size();
    storage_.reserve(elements);
    for (const ValidatedRequest& v : requests) {
      const auto& data = tensor_of(v).data;
      storage_.insert(storage_.end(), data.begin(), data.end());
    }
    data_ = storage_.data();
  }

  const float* data() const { return data_; }

 private:
  std::vector<float> storage_;
  const float* data_ = nullptr;
};

// Token offset of each request in a stacking of its n_q (or n_k) rows.
std::vector<int64_t> TokenOffsets(std::span<const ValidatedRequest> requests, bool keys) {
  std::vector<int64_t> offsets;
  int64_t total = 0;
  for (const ValidatedRequest& v : requests) {
    offsets.push_back(total);
    total += v.dims.batch * (keys ? v.dims.num_keys : v.dims.num_queries);
  }
  offsets.push_back(total);
  return offsets;
}

// The length mask and causal flag of example b, in the kernel's terms.
void SetMask(const ValidatedRequest& v, int64_t b, FlashProblem& problem) {
  const AttentionRequest& request = *v.request;
  problem.causal = request.causal;
  switch (v.dims.length_mask) {
    case AttentionDims::LengthMask::kNone:
      break;
    case AttentionDims::LengthMask::kPerExample:
      problem.valid_len = request.valid_lens[b];
      break;
    case AttentionDims::LengthMask::kPerQuery:
      problem.valid_lens = request.valid_lens.data() + b * v.dims.num_queries;
      break;
  }
}

// One attention task: rows [begin, end) of a problem, and where its weights go.
struct AttentionTask {
  const FlashProblem* problem;
  float* weights;  // the problem's (n_q x n_k) weights, or null
  int64_t begin, end;
};

void AddTasks(const FlashProblem& problem, float* weights, std::vector<AttentionTask>& tasks) {
  for (int64_t begin = 0; begin < problem.num_queries; begin += kQueryBlock) {
    tasks.push_back({&problem, weights, begin, std::min(problem.num_queries, begin + kQueryBlock)});
  }
}

void RunAttention(ThreadPool& pool, const std::vector<AttentionTask>& tasks) {
  pool.ParallelFor(static_cast<int64_t>(tasks.size()), [&](int64_t i) {
    const AttentionTask& task = tasks[i];
    if (task.weights) {
      AttentionWithWeights(*task.problem, task.begin, task.end, task.weights,
                           task.problem->num_keys);
    } else {
      FlashAttention(*task.problem, task.begin, task.end);
    }
  });
}

float* WeightsOf(AttentionResult& result, int64_t slice, const AttentionDims& dims) {
  if (result.attention_weights.data.empty()) return nullptr;
  return result.attention_weights.data.data() + slice * dims.num_queries * dims.num_keys;
}

// dot_product, distance and bilinear: s = scale q'.k + r_i + c_j.
void RunDotProductFamily(ThreadPool& pool, const Model& model,
                         std::span<const ValidatedRequest> requests,
                         std::span<AttentionResult> results) {
  const size_t n = requests.size();
  // bilinear: q' = q^T W_k, so q'.k = q.(W_k k); one GEMM over all queries.
  const std::vector<int64_t> query_rows = TokenOffsets(requests, /*keys=*/false);
  std::vector<float> mapped_queries;
  if (model.kind == Kind::kBilinear) {
    const StackedRows queries_in(requests, [](const ValidatedRequest& v) -> const TensorView& {
      return v.request->queries;
    });
    mapped_queries.resize(query_rows.back() * model.w_k.cols());
    RunProjections(pool, {{queries_in.data(), mapped_queries.data(), query_rows.back(),
                           &model.w_k, nullptr, /*transposed=*/false}});
  }
  // distance: -scale/2 |q - k|^2 = scale q.k - scale/2 |q|^2 - scale/2 |k|^2.
  std::vector<std::vector<float>> query_norms(n), key_norms(n);
  if (model.kind == Kind::kDistance) {
    for (size_t r = 0; r < n; ++r) {
      const AttentionDims& d = requests[r].dims;
      const float half_scale = 0.5f * d.scale;
      ConstMatrixMap q(requests[r].request->queries.data.data(), d.batch * d.num_queries,
                       d.query_size);
      ConstMatrixMap k(ResolvedKeys(*requests[r].request).data.data(), d.batch * d.num_keys,
                       d.key_size);
      query_norms[r].resize(q.rows());
      key_norms[r].resize(k.rows());
      Eigen::Map<Vector>(query_norms[r].data(), q.rows()) =
          -half_scale * q.rowwise().squaredNorm();
      Eigen::Map<Vector>(key_norms[r].data(), k.rows()) = -half_scale * k.rowwise().squaredNorm();
    }
  }

  // Tasks point into `problems`: reserve it whole so it never reallocates.
  std::vector<FlashProblem> problems;
  size_t num_problems = 0;
  for (size_t r = 0; r < n; ++r) num_problems += requests[r].dims.batch;
  problems.reserve(num_problems);
  std::vector<AttentionTask> tasks;
  for (size_t r = 0; r < n; ++r) {
    const AttentionRequest& request = *requests[r].request;
    const AttentionDims& d = requests[r].dims;
    const float* queries = mapped_queries.empty()
                               ? request.queries.data.data()
                               : mapped_queries.data() + query_rows[r] * d.key_size;
    const int64_t head_size = d.key_size;
    for (int64_t b = 0; b < d.batch; ++b) {
      FlashProblem p;
      p.queries = queries + b * d.num_queries * head_size;
      p.keys = ResolvedKeys(request).data.data() + b * d.num_keys * d.key_size;
      p.values = ResolvedValues(request).data.data() + b * d.num_keys * d.value_size;
      p.output = results[r].output.data.data() + b * d.num_queries * d.value_size;
      p.query_stride = head_size;
      p.key_stride = d.key_size;
      p.value_stride = d.value_size;
      p.output_stride = d.value_size;
      p.num_queries = d.num_queries;
      p.num_keys = d.num_keys;
      p.head_size = head_size;
      p.value_size = d.value_size;
      p.scale = d.scale;
      if (!query_norms[r].empty()) {
        p.query_bias = query_norms[r].data() + b * d.num_queries;
        p.key_bias = key_norms[r].data() + b * d.num_keys;
      }
      SetMask(requests[r], b, p);
      problems.push_back(p);
      AddTasks(problems.back(), WeightsOf(results[r], b, d), tasks);
    }
  }
  RunAttention(pool, tasks);
}

// additive: s[i,j] = w_v . tanh(W_q q_i + W_k k_j), one row at a time so the
// (n_q x n_k x h) tensor never exists.
void RunAdditive(ThreadPool& pool, const Model& model, std::span<const ValidatedRequest> requests,
                 std::span<AttentionResult> results) {
  const size_t n = requests.size();
  const int64_t hidden = model.w_q.rows();
  const std::vector<int64_t> query_rows = TokenOffsets(requests, /*keys=*/false);
  const std::vector<int64_t> key_rows = TokenOffsets(requests, /*keys=*/true);
  const StackedRows queries_in(requests, [](const ValidatedRequest& v) -> const TensorView& {
    return v.request->queries;
  });
  const StackedRows keys_in(requests, [](const ValidatedRequest& v) -> const TensorView& {
    return ResolvedKeys(*v.request);
  });
  // W_q q and W_k k of every token of the batch, (tokens x h) each.
  std::vector<float> projected_queries(query_rows.back() * hidden);
  std::vector<float> projected_keys(key_rows.back() * hidden);
  RunProjections(pool,
                 {{queries_in.data(), projected_queries.data(), query_rows.back(), &model.w_q, nullptr},
                  {keys_in.data(), projected_keys.data(), key_rows.back(), &model.w_k, nullptr}});

  struct Block {
    size_t request;
    int64_t example, begin, end;
  };
  std::vector<Block> blocks;
  for (size_t r = 0; r < n; ++r) {
    const AttentionDims& d = requests[r].dims;
    for (int64_t b = 0; b < d.batch; ++b) {
      for (int64_t begin = 0; begin < d.num_queries; begin += kQueryBlock) {
        blocks.push_back({r, b, begin, std::min(d.num_queries, begin + kQueryBlock)});
      }
    }
  }
  const Eigen::Map<const Vector> w_v(model.w_v.data(), hidden);
  pool.ParallelFor(static_cast<int64_t>(blocks.size()), [&](int64_t t) {
    const Block& block = blocks[t];
    const ValidatedRequest& v = requests[block.request];
    const AttentionDims& d = v.dims;
    AttentionResult& result = results[block.request];
    const int64_t b = block.example;
    ConstMatrixMap keys(
        projected_keys.data() + (key_rows[block.request] + b * d.num_keys) * hidden, d.num_keys,
        hidden);
    ConstMatrixMap queries(
        projected_queries.data() + (query_rows[block.request] + b * d.num_queries) * hidden,
        d.num_queries, hidden);
    ConstMatrixMap values(ResolvedValues(*v.request).data.data() + b * d.num_keys * d.value_size,
                          d.num_keys, d.value_size);
    MatrixMap output(result.output.data.data() + b * d.num_queries * d.value_size,
                     d.num_queries, d.value_size);
    float* weights = WeightsOf(result, b, d);
    FlashProblem mask;
    mask.num_queries = d.num_queries;
    mask.num_keys = d.num_keys;
    SetMask(v, b, mask);

    thread_local RowMatrix features;  // (allowed keys x h) tanh features of one query
    thread_local Vector scores;
    scores.resize(d.num_keys);
    for (int64_t i = block.begin; i < block.end; ++i) {
      const int64_t bound = AllowedKeys(mask, i);
      if (bound > 0) {
        features.resize(bound, hidden);
        features = (keys.topRows(bound).rowwise() + queries.row(i)).array().tanh();
        scores.head(bound).noalias() = features * w_v;
      }
      const int64_t nonzero = MaskedSoftmaxRow({scores.data(), static_cast<size_t>(scores.size())}, bound);
      output.row(i).noalias() = scores.head(nonzero).transpose() * values.topRows(nonzero);
      if (weights) std::copy_n(scores.data(), d.num_keys, weights + i * d.num_keys);
    }
  });
}

// multi_head: project, attend per head on column slices, project the concat.
// Each of the four projections is one GEMM over the tokens of every request.
void RunMultiHead(ThreadPool& pool, const Model& model,
                  std::span<const ValidatedRequest> requests, std::span<AttentionResult> results) {
  const size_t n = requests.size();
  const int64_t width = model.output_size;  // E
  const int64_t heads = model.num_heads;
  const int64_t head_size = width / heads;
  const std::vector<int64_t> query_rows = TokenOffsets(requests, /*keys=*/false);
  const std::vector<int64_t> key_rows = TokenOffsets(requests, /*keys=*/true);
  const int64_t total_queries = query_rows.back(), total_keys = key_rows.back();

  const StackedRows queries_in(requests, [](const ValidatedRequest& v) -> const TensorView& {
    return v.request->queries;
  });
  const StackedRows keys_in(requests, [](const ValidatedRequest& v) -> const TensorView& {
    return ResolvedKeys(*v.request);
  });
  const StackedRows values_in(requests, [](const ValidatedRequest& v) -> const TensorView& {
    return ResolvedValues(*v.request);
  });
  // (tokens x E) projections of every request, stacked like the inputs, and
  // the concatenated heads, in a per-thread buffer kept across calls: fresh
  // vectors would be zero-filled and page-faulted in on every call. Every
  // element is written before it is read. A rare huge request gets its own
  // buffer, so no thread keeps gigabytes for the rest of its life.
  const size_t needed = 2 * (total_queries + total_keys) * width;
  thread_local std::vector<float> kept;
  std::vector<float> once;
  std::vector<float>& workspace = needed <= kKeptWorkspaceFloats ? kept : once;
  if (workspace.size() < needed) workspace.resize(needed);
  float* const q = workspace.data();
  float* const k = q + total_queries * width;
  float* const v = k + total_keys * width;
  float* const concat = v + total_keys * width;
  RunProjections(pool, {{queries_in.data(), q, total_queries, &model.w_q, &model.b_q},
                        {keys_in.data(), k, total_keys, &model.w_k, &model.b_k},
                        {values_in.data(), v, total_keys, &model.w_v, &model.b_v}});

  // Tasks point into `problems`: reserve it whole so it never reallocates.
  std::vector<FlashProblem> problems;
  size_t num_problems = 0;
  for (size_t r = 0; r < n; ++r) num_problems += requests[r].dims.batch * heads;
  problems.reserve(num_problems);
  std::vector<AttentionTask> tasks;
  for (size_t r = 0; r < n; ++r) {
    const AttentionDims& d = requests[r].dims;
    for (int64_t b = 0; b < d.batch; ++b) {
      const int64_t query_row = query_rows[r] + b * d.num_queries;
      const int64_t key_row = key_rows[r] + b * d.num_keys;
      for (int64_t h = 0; h < heads; ++h) {
        FlashProblem p;
        const int64_t column = h * head_size;
        p.queries = q + query_row * width + column;
        p.keys = k + key_row * width + column;
        p.values = v + key_row * width + column;
        p.output = concat + query_row * width + column;
        p.query_stride = p.key_stride = p.value_stride = p.output_stride = width;
        p.num_queries = d.num_queries;
        p.num_keys = d.num_keys;
        p.head_size = p.value_size = head_size;
        p.scale = d.scale;
        SetMask(requests[r], b, p);
        problems.push_back(p);
        AddTasks(problems.back(), WeightsOf(results[r], b * heads + h, d), tasks);
      }
    }
  }
  RunAttention(pool, tasks);

  if (n == 1) {
    RunProjections(pool, {{concat, results[0].output.data.data(), total_queries,
                           &model.w_o, &model.b_o}});
    return;
  }
  std::vector<float> output(total_queries * width);
  RunProjections(pool, {{concat, output.data(), total_queries, &model.w_o, &model.b_o}});
  for (size_t r = 0; r < n; ++r) {
    std::copy_n(output.begin() + query_rows[r] * width, results[r].output.data.size(),
                results[r].output.data.begin());
  }
}

}  // namespace

Engine::Engine(EngineOptions options)
    : pool_(std::make_unique<ThreadPool>(options.num_threads)) {
  openblas_set_num_threads(1);
}

Engine::~Engine() = default;

int Engine::num_threads() const { return pool_->num_threads(); }

absl::StatusOr<AttentionResult> Engine::Attend(const Model& model, const AttentionRequest& request,
                                               const Limits& limits) {
  absl::StatusOr<AttentionDims> dims = Validate(model, request, limits);
  if (!dims.ok()) return dims.status();
  const ValidatedRequest validated{&request, *dims};
  AttentionResult result;
  Run(model, {&validated, 1}, {&result, 1});
  return result;
}

void Engine::Run(const Model& model, std::span<const ValidatedRequest> requests,
                 std::span<AttentionResult> results) {
  for (size_t r = 0; r < requests.size(); ++r) {
    const AttentionDims& d = requests[r].dims;
    results[r].output.shape = {d.batch, d.num_queries, d.output_size};
    results[r].output.data.assign(d.output_elements(), 0.0f);
    if (requests[r].request->return_attention_weights) {
      results[r].attention_weights.shape =
          model.kind == Kind::kMultiHead
              ? std::vector<int64_t>{d.batch, d.num_heads, d.num_queries, d.num_keys}
              : std::vector<int64_t>{d.batch, d.num_queries, d.num_keys};
      results[r].attention_weights.data.assign(d.weight_elements(), 0.0f);
    } else {
      results[r].attention_weights = {};
    }
  }
  switch (model.kind) {
    case Kind::kDotProduct:
    case Kind::kDistance:
    case Kind::kBilinear:
      RunDotProductFamily(*pool_, model, requests, results);
      break;
    case Kind::kAdditive:
      RunAdditive(*pool_, model, requests, results);
      break;
    case Kind::kMultiHead:
      RunMultiHead(*pool_, model, requests, results);
      break;
  }
}

}  // namespace attention
