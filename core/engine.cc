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

namespace attention {
namespace {

// Query rows per attention task: enough to amortise a key tile's reuse,
// small enough that a long sequence spreads over every thread.
constexpr int64_t kQueryBlock = 64;
// Rows per projection task: a GEMM this tall runs near peak.
constexpr int64_t kProjectionRows = 256;

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
  // bilinear: q' = q^T W_k, so q'.k = q.(W_k k).
  std::vector<std::vector<float>> mapped_queries(n);
  // distance: -scale/2 |q - k|^2 = scale q.k - scale/2 |q|^2 - scale/2 |k|^2.
  std::vector<std::vector<float>> query_norms(n), key_norms(n);
  if (model.kind == Kind::kBilinear) {
    std::vector<Projection> projections;
    for (size_t r = 0; r < n; ++r) {
      const AttentionDims& d = requests[r].dims;
      mapped_queries[r].resize(d.batch * d.num_queries * d.key_size);
      projections.push_back({requests[r].request->queries.data.data(), mapped_queries[r].data(),
                             d.batch * d.num_queries, &model.w_k, nullptr, false});
    }
    RunProjections(pool, projections);
  }
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
    const float* queries =
        mapped_queries[r].empty() ? request.queries.data.data() : mapped_queries[r].data();
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
  std::vector<std::vector<float>> projected_queries(n), projected_keys(n);
  std::vector<Projection> projections;
  for (size_t r = 0; r < n; ++r) {
    const AttentionDims& d = requests[r].dims;
    projected_queries[r].resize(d.batch * d.num_queries * hidden);
    projected_keys[r].resize(d.batch * d.num_keys * hidden);
    projections.push_back({requests[r].request->queries.data.data(), projected_queries[r].data(),
                           d.batch * d.num_queries, &model.w_q, nullptr});
    projections.push_back({ResolvedKeys(*requests[r].request).data.data(),
                           projected_keys[r].data(), d.batch * d.num_keys, &model.w_k, nullptr});
  }
  RunProjections(pool, projections);

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
    ConstMatrixMap keys(projected_keys[block.request].data() + b * d.num_keys * hidden,
                        d.num_keys, hidden);
    ConstMatrixMap queries(projected_queries[block.request].data() + b * d.num_queries * hidden,
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
void RunMultiHead(ThreadPool& pool, const Model& model,
                  std::span<const ValidatedRequest> requests, std::span<AttentionResult> results) {
  const size_t n = requests.size();
  const int64_t width = model.output_size;  // E
  const int64_t heads = model.num_heads;
  const int64_t head_size = width / heads;
  std::vector<std::vector<float>> q(n), k(n), v(n), concat(n);
  std::vector<Projection> projections;
  for (size_t r = 0; r < n; ++r) {
    const AttentionRequest& request = *requests[r].request;
    const AttentionDims& d = requests[r].dims;
    q[r].resize(d.batch * d.num_queries * width);
    k[r].resize(d.batch * d.num_keys * width);
    v[r].resize(d.batch * d.num_keys * width);
    concat[r].resize(d.batch * d.num_queries * width);
    projections.push_back({request.queries.data.data(), q[r].data(), d.batch * d.num_queries,
                           &model.w_q, &model.b_q});
    projections.push_back({ResolvedKeys(request).data.data(), k[r].data(), d.batch * d.num_keys,
                           &model.w_k, &model.b_k});
    projections.push_back({ResolvedValues(request).data.data(), v[r].data(),
                           d.batch * d.num_keys, &model.w_v, &model.b_v});
  }
  RunProjections(pool, projections);

  std::vector<FlashProblem> problems;
  size_t num_problems = 0;
  for (size_t r = 0; r < n; ++r) num_problems += requests[r].dims.batch * heads;
  problems.reserve(num_problems);
  std::vector<AttentionTask> tasks;
  for (size_t r = 0; r < n; ++r) {
    const AttentionDims& d = requests[r].dims;
    for (int64_t b = 0; b < d.batch; ++b) {
      for (int64_t h = 0; h < heads; ++h) {
        FlashProblem p;
        const int64_t column = h * head_size;
        p.queries = q[r].data() + b * d.num_queries * width + column;
        p.keys = k[r].data() + b * d.num_keys * width + column;
        p.values = v[r].data() + b * d.num_keys * width + column;
        p.output = concat[r].data() + b * d.num_queries * width + column;
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

  projections.clear();
  for (size_t r = 0; r < n; ++r) {
    const AttentionDims& d = requests[r].dims;
    projections.push_back({concat[r].data(), results[r].output.data.data(),
                           d.batch * d.num_queries, &model.w_o, &model.b_o});
  }
  RunProjections(pool, projections);
}

}  // namespace

Engine::Engine(EngineOptions options)
    : pool_(std::make_unique<ThreadPool>(options.num_threads)) {}

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
