// engine.cc: turns a ragged batch of requests into parallel tasks.
//
// A batch runs as consecutive groups of requests (see kGroupFloats); every
// kind runs a group in at most three parallel phases over all its requests:
//   1. projections: row blocks of x W^T (+ b) for every request at once
//      (multi_head, additive, bilinear); no padding, rows are all real tokens;
//   2. attention: one task per (request, example, head, query block), each
//      bounded by its queries' allowed keys;
//   3. output projection (multi_head).
// Tasks are handed out dynamically, so short or causal rows balance out.
// A request with a StopCheck is polled between blocks of its work (its
// RequestStop); once stopped, its remaining tasks return at once.
#include "core/engine.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <deque>
#include <mutex>
#include <vector>

#include "absl/strings/str_cat.h"

#include "core/blas.h"
#include "core/finite.h"
#include "core/flash_kernel.h"
#include "core/flash_tile.h"
#include "core/masked_softmax.h"
#include "core/packed_gemm.h"
#include "core/thread_pool.h"


namespace attention {
namespace {

// Rows per projection task: a GEMM this tall runs near peak.
constexpr int64_t kProjectionRows = 256;
// Largest scratch a thread keeps between calls (16 MiB; see GroupScratch):
// the four (tokens x E) buffers of one multi_head request of 2,048 tokens
// at E = 512, the largest shape BENCHMARKS.md measures. Larger scratch (an
// additive model's n_k x h key projections, say) is freed after its run, so
// a thread's memory returns near its level before an oversized request.
constexpr int64_t kKeptScratchFloats = int64_t{1} << 22;
// Most floats of token rows one group holds (GroupFloats: query + key rows
// times the widest row): 2 MiB, 2,048 token rows of multi_head E=256, i.e. 32
// small (B=1 n=32) or one large (B=8 n=128) request. Scratch then stays a few
// MiB whatever the batch (about four buffers of this size: stacked inputs,
// projections, concatenated heads, stacked output), in cache between phases
// and reused run after run. One execution over the whole batch grew every
// buffer with it: 64 large requests took 576 MiB more memory and 1.5-1.8x
// the CPU per request of one alone (attention-bench batch/, BENCHMARKS.md).
// Bounds of 2^18 to 2^21 measured alike within the noise (64 large: 14.6-15.5
// ms CPU per request; 64 small: 0.33-0.37 ms). This one keeps a large
// request whole, whose 1,024 query rows already fill 256-row GEMM blocks, so
// merging more only adds copies, and 32 small ones fill four such blocks.
constexpr int64_t kGroupFloats = int64_t{1} << 19;

// A request's stop, shared by every task that computes it: asks its
// StopCheck and keeps the first non-OK answer.
class RequestStop final : public WorkStop {
 public:
  explicit RequestStop(const StopCheck& check) : check_(check) {}

  bool Stopped() override {
    if (stopped_.load(std::memory_order_acquire)) return true;
    absl::Status why = check_();
    if (why.ok()) return false;
    std::lock_guard<std::mutex> lock(mu_);
    if (!stopped_.load(std::memory_order_relaxed)) {
      why_ = std::move(why);
      stopped_.store(true, std::memory_order_release);
    }
    return true;
  }
  // After the run: OK, or why the request stopped.
  absl::Status why() const {
    std::lock_guard<std::mutex> lock(mu_);
    return why_;
  }

 private:
  const StopCheck& check_;
  std::atomic<bool> stopped_{false};
  mutable std::mutex mu_;
  absl::Status why_;
};

// Each request's stop, or null for one never asked.
using Stops = std::span<RequestStop* const>;

// The stop of a group of one request, else null. A request over the group
// bound, where a stop matters, is always a group of its own (Engine::Run).
WorkStop* LoneStop(Stops stops) { return stops.size() == 1 ? stops[0] : nullptr; }

using ConstMatrixMap = Eigen::Map<const RowMatrix>;
using MatrixMap = Eigen::Map<RowMatrix>;
using StridedMatrixMap = Eigen::Map<RowMatrix, Eigen::Unaligned, Eigen::OuterStride<>>;

// A packed task: rows x panels. With few rows the panels give the tasks
// (a 1-row product over N = 1024 is 8 tasks of 128 columns); with many the
// rows do, and 96 rows (a multiple of 8 and 3 rows per micro-kernel) of 4
// panels read the same 4 x 128 KiB of panels (K = 1024) from L2 12-32 times.
constexpr int64_t kPackedGemmRowBlock = 96;
constexpr int64_t kPackedGemmPanelBlock = 4;

// out (rows x out_cols) = in (rows x in_cols) * weight^T + bias, or
// in * weight when `transposed` is false (bilinear's q^T W_k).
struct Projection {
  const float* in;
  float* out;
  int64_t rows;
  const RowMatrix* weight;
  const Vector* bias;  // null: none
  bool transposed = true;
  // The same weight and bias packed (core/packed_gemm.h); null or empty: none.
  const PackedWeights* packed = nullptr;
  int64_t out_stride = 0;  // floats between output rows; 0: out_cols()

  int64_t in_cols() const { return transposed ? weight->cols() : weight->rows(); }
  int64_t out_cols() const { return transposed ? weight->rows() : weight->cols(); }
  int64_t out_row_stride() const { return out_stride != 0 ? out_stride : out_cols(); }
  // Projections with packed weights (multi_head models, PackProjections) run
  // on them (core/packed_gemm.h) on the avx512 and avx2 paths, whatever their
  // rows; the others, and all on the portable path, on the BLAS. Measured
  // per shape, one thread, E x E weights, attention-bench
  // projection/M:m/E:e/gemm:packed|blas (BENCHMARKS.md, "Projections"):
  // on avx512 the packed kernel is never slower: equal at 1 row (both read
  // the weights once, memory-bound), 4-5x at 8 rows (the BLAS repacks all of
  // E x E for 8 rows), 1.4-2x at 32-64, and still 1.01-1.17x at 512-2048
  // rows, where the BLAS packs once per 256-row block: no crossover to
  // switch at. On avx2 1.2-2x up to 64 rows, equal at 512. The portable
  // kernel is scalar (GCC's baseline target): 1.2x slower at 8 rows and
  // 4.5x at 64 than the BLAS, whose kernels OpenBLAS picks itself there.
  bool UsesPackedWeights() const {
    return packed != nullptr && !packed->empty() && ActiveIsa() != Isa::kPortable;
  }
  // The same product over rows [first, first + count) only.
  Projection Rows(int64_t first, int64_t count) const {
    Projection part = *this;
    part.in += first * in_cols();
    part.out += first * out_row_stride();
    part.rows = count;
    return part;
  }
};

// Rows [begin, end) of a projection on the calling thread: on the packed
// weights' panels [panel_begin, panel_end), or (panel_end 0) on the BLAS.
void ProjectBlock(const Projection& p, int64_t begin, int64_t end, int64_t panel_begin,
                  int64_t panel_end) {
  if (panel_end > 0) {
    PackedKernelFor(ActiveIsa())({p.in, p.in_cols(), p.out, p.out_row_stride(), p.packed}, begin,
                                 end, panel_begin, panel_end);
    return;
  }
  const int64_t rows = end - begin;
  ConstMatrixMap in(p.in + begin * p.in_cols(), rows, p.in_cols());
  StridedMatrixMap out(p.out + begin * p.out_row_stride(), rows, p.out_cols(),
                       Eigen::OuterStride<>(p.out_row_stride()));
  // The bias is written first and the product added to it (BLAS beta = 1),
  // so the output is not read and written again after the product.
  if (p.bias) {
    out.rowwise() = p.bias->transpose();
  } else {
    out.setZero();
  }
  if (p.transposed) {
    out.noalias() += in * p.weight->transpose();
  } else {
    out.noalias() += in * *p.weight;
  }
}

// With a `stop`, each block asks it first, so a stopped request's
// remaining blocks are skipped (a block is at most a few milliseconds of
// one core). Only a group of one request passes its stop (LoneStop): the
// rows of a larger group's products belong to all of its requests.
void RunProjections(ThreadPool& pool, const std::vector<Projection>& projections,
                    WorkStop* stop = nullptr) {
  // A BLAS block is rows [begin, end) of every column; a packed block also
  // names its panels [panel_begin, panel_end) (panel_end 0 for the BLAS).
  struct Block {
    const Projection* projection;
    int64_t begin, end;
    int64_t panel_begin = 0, panel_end = 0;
  };
  std::vector<Block> blocks;
  for (const Projection& p : projections) {
    if (p.UsesPackedWeights()) {
      const int64_t panels = p.packed->panels();
      for (int64_t begin = 0; begin < p.rows; begin += kPackedGemmRowBlock) {
        for (int64_t panel = 0; panel < panels; panel += kPackedGemmPanelBlock) {
          blocks.push_back({&p, begin, std::min(p.rows, begin + kPackedGemmRowBlock), panel,
                            std::min(panels, panel + kPackedGemmPanelBlock)});
        }
      }
      continue;
    }
    for (int64_t begin = 0; begin < p.rows; begin += kProjectionRows) {
      blocks.push_back({&p, begin, std::min(p.rows, begin + kProjectionRows)});
    }
  }
  pool.ParallelFor(static_cast<int64_t>(blocks.size()), [&](int64_t i) {
    if (stop != nullptr && stop->Stopped()) return;
    const Block& block = blocks[i];
    ProjectBlock(*block.projection, block.begin, block.end, block.panel_begin, block.panel_end);
  });
}

std::vector<float>& KeptScratch() {
  thread_local std::vector<float> kept;
  return kept;
}

// Consecutive buffers of the given sizes (floats) for one group. Fresh
// vectors would be zero-filled, and page-faulted in again on every run once
// glibc hands their memory back to the kernel (mmap'd, or trimmed off the top
// of the heap), so the calling thread keeps its scratch across runs; groups
// are bounded (kGroupFloats), so it stays a few MiB. A rare huge request gets
// `once` instead, so no thread keeps gigabytes for the rest of its life.
// Contents are left over: every element is written before it is read.
template <size_t N>
std::array<float*, N> GroupScratch(const std::array<int64_t, N>& sizes, std::vector<float>& once) {
  int64_t total = 0;
  for (int64_t size : sizes) total += size;
  std::vector<float>& memory = total <= kKeptScratchFloats ? KeptScratch() : once;
  if (memory.size() < static_cast<size_t>(total)) memory.resize(total);
  std::array<float*, N> buffers;
  float* next = memory.data();
  for (size_t i = 0; i < N; ++i) {
    buffers[i] = next;
    next += sizes[i];
  }
  return buffers;
}

using TensorOf = const TensorView& (*)(const ValidatedRequest&);
const TensorView& QueriesOf(const ValidatedRequest& v) { return v.request->queries; }
const TensorView& KeysOf(const ValidatedRequest& v) { return ResolvedKeys(*v.request); }
const TensorView& ValuesOf(const ValidatedRequest& v) { return ResolvedValues(*v.request); }

// Floats StackRows() needs: none for a lone request, used in place.
int64_t StackedFloats(std::span<const ValidatedRequest> requests, TensorOf tensor_of) {
  if (requests.size() == 1) return 0;
  int64_t floats = 0;
  for (const ValidatedRequest& v : requests) floats += static_cast<int64_t>(tensor_of(v).data.size());
  return floats;
}

// The rows of one tensor of every request, stacked into `destination` as one
// (tokens x cols) matrix, so a projection is one GEMM over all tokens of the
// group. A lone request is used in place.
const float* StackRows(std::span<const ValidatedRequest> requests, TensorOf tensor_of,
                       float* destination) {
  if (requests.size() == 1) return tensor_of(requests[0]).data.data();
  float* next = destination;
  for (const ValidatedRequest& v : requests) {
    next = std::copy(tensor_of(v).data.begin(), tensor_of(v).data.end(), next);
  }
  return destination;
}

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

// One attention task: rows [begin, end) of a problem, and where its weights go.
struct AttentionTask {
  const FlashProblem* problem;
  float* weights;  // the problem's (n_q x n_k) weights, or null
  int64_t begin, end;
};

void AddTasks(const FlashProblem& problem, float* weights, std::vector<AttentionTask>& tasks) {
  for (int64_t begin = 0; begin < problem.num_queries; begin += kFlashQueryTile) {
    tasks.push_back({&problem, weights, begin, std::min(problem.num_queries, begin + kFlashQueryTile)});
  }
}

void RunAttention(ThreadPool& pool, const std::vector<AttentionTask>& tasks) {
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

float* WeightsOf(AttentionResult& result, int64_t slice, const AttentionDims& dims) {
  if (result.attention_weights.data.empty()) return nullptr;
  return result.attention_weights.data.data() + slice * dims.num_queries * dims.num_keys;
}

// dot_product, distance and bilinear: s = scale q'.k + r_i + c_j.
void RunDotProductFamily(ThreadPool& pool, const Model& model,
                         std::span<const ValidatedRequest> requests,
                         std::span<AttentionResult> results, Stops stops) {
  const size_t n = requests.size();
  // bilinear: q' = q^T W_k, so q'.k = q.(W_k k); one GEMM over all queries.
  const std::vector<int64_t> query_rows = TokenOffsets(requests, /*keys=*/false);
  std::vector<float> once;
  float* mapped_queries = nullptr;
  if (model.kind == Kind::kBilinear) {
    const auto [stacked_queries, mapped] = GroupScratch<2>(
        {StackedFloats(requests, QueriesOf), query_rows.back() * model.w_k.cols()}, once);
    RunProjections(pool, {{StackRows(requests, QueriesOf, stacked_queries), mapped,
                           query_rows.back(), &model.w_k, nullptr, /*transposed=*/false}},
                   LoneStop(stops));
    mapped_queries = mapped;
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
    const float* queries = mapped_queries ? mapped_queries + query_rows[r] * d.key_size
                                          : request.queries.data.data();
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
      p.bounds = BoundsOf(requests[r], b);
      p.distance = model.kind == Kind::kDistance;
      p.stop = stops[r];
      problems.push_back(p);
      AddTasks(problems.back(), WeightsOf(results[r], b, d), tasks);
    }
  }
  RunAttention(pool, tasks);
}

// additive: s[i,j] = w_v . tanh(W_q q_i + W_k k_j), one row at a time so the
// (n_q x n_k x h) tensor never exists.
void RunAdditive(ThreadPool& pool, const Model& model, std::span<const ValidatedRequest> requests,
                 std::span<AttentionResult> results, Stops stops) {
  const size_t n = requests.size();
  const int64_t hidden = model.w_q.rows();
  const std::vector<int64_t> query_rows = TokenOffsets(requests, /*keys=*/false);
  const std::vector<int64_t> key_rows = TokenOffsets(requests, /*keys=*/true);
  // W_q q and W_k k of every token of the group, (tokens x h) each.
  // Named pointers rather than a structured binding: the tasks capture them.
  std::vector<float> once;
  const std::array<float*, 4> scratch = GroupScratch<4>(
      {query_rows.back() * hidden, key_rows.back() * hidden, StackedFloats(requests, QueriesOf),
       StackedFloats(requests, KeysOf)},
      once);
  const float* const projected_queries = scratch[0];
  const float* const projected_keys = scratch[1];
  RunProjections(pool, {{StackRows(requests, QueriesOf, scratch[2]), scratch[0],
                         query_rows.back(), &model.w_q, nullptr},
                        {StackRows(requests, KeysOf, scratch[3]), scratch[1], key_rows.back(),
                         &model.w_k, nullptr}},
                 LoneStop(stops));

  struct Block {
    size_t request;
    int64_t example, begin, end;
  };
  std::vector<Block> blocks;
  for (size_t r = 0; r < n; ++r) {
    const AttentionDims& d = requests[r].dims;
    for (int64_t b = 0; b < d.batch; ++b) {
      for (int64_t begin = 0; begin < d.num_queries; begin += kFlashQueryTile) {
        blocks.push_back({r, b, begin, std::min(d.num_queries, begin + kFlashQueryTile)});
      }
    }
  }
  const Eigen::Map<const Vector> w_v(model.w_v.data(), hidden);
  // Keys whose tanh features are formed at once: bounds the features'
  // memory whatever n_k, and spaces the polls of a long row kStopPollWork
  // apart.
  const int64_t keys_per_chunk = std::max<int64_t>(
      kFlashKeyTile, kStopPollWork / (hidden * static_cast<int64_t>(kAdditiveHiddenWork)));
  pool.ParallelFor(static_cast<int64_t>(blocks.size()), [&](int64_t t) {
    const Block& block = blocks[t];
    RequestStop* const stop = stops[block.request];
    if (stop != nullptr && stop->Stopped()) return;
    const ValidatedRequest& v = requests[block.request];
    const AttentionDims& d = v.dims;
    AttentionResult& result = results[block.request];
    const int64_t b = block.example;
    ConstMatrixMap keys(
        projected_keys + (key_rows[block.request] + b * d.num_keys) * hidden, d.num_keys,
        hidden);
    ConstMatrixMap queries(
        projected_queries + (query_rows[block.request] + b * d.num_queries) * hidden,
        d.num_queries, hidden);
    ConstMatrixMap values(ResolvedValues(*v.request).data.data() + b * d.num_keys * d.value_size,
                          d.num_keys, d.value_size);
    MatrixMap output(result.output.data.data() + b * d.num_queries * d.value_size,
                     d.num_queries, d.value_size);
    float* weights = WeightsOf(result, b, d);
    const KeyBounds bounds = BoundsOf(v, b);

    thread_local RowMatrix features;  // (keys of a chunk x h) tanh features of one query
    thread_local Vector scores;
    scores.resize(d.num_keys);
    for (int64_t i = block.begin; i < block.end; ++i) {
      const int64_t bound = bounds.Allowed(i, d.num_keys);
      for (int64_t key = 0; key < bound; key += keys_per_chunk) {
        if (key > 0 && stop != nullptr && stop->Stopped()) return;
        const int64_t count = std::min(keys_per_chunk, bound - key);
        features.resize(count, hidden);
        features = (keys.middleRows(key, count).rowwise() + queries.row(i)).array().tanh();
        scores.segment(key, count).noalias() = features * w_v;
      }
      const int64_t nonzero = MaskedSoftmaxRow({scores.data(), static_cast<size_t>(scores.size())}, bound);
      output.row(i).noalias() = scores.head(nonzero).transpose() * values.topRows(nonzero);
      if (weights) std::copy_n(scores.data(), d.num_keys, weights + i * d.num_keys);
    }
    // Only what ordinary requests need stays with the thread.
    if (scores.size() > kKeptKernelScratchFloats) scores.resize(0);
  });
}

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
    std::call_once(done_, [this] {
      ProjectBlock(rest_, 0, rest_.rows, 0, rest_.UsesPackedWeights() ? rest_.packed->panels() : 0);
    });
  }

 private:
  const Projection rest_;
  std::once_flag done_;
};

// multi_head: project, attend per head on column slices, project the concat.
// Each of the four projections is one GEMM over the tokens of every request.
void RunMultiHead(ThreadPool& pool, const Model& model,
                  std::span<const ValidatedRequest> requests, std::span<AttentionResult> results,
                  Stops stops) {
  const size_t n = requests.size();
  const int64_t width = model.output_size;  // E
  const int64_t heads = model.num_heads;
  const int64_t head_size = width / heads;
  const std::vector<int64_t> query_rows = TokenOffsets(requests, /*keys=*/false);
  const std::vector<int64_t> key_rows = TokenOffsets(requests, /*keys=*/true);
  const int64_t total_queries = query_rows.back(), total_keys = key_rows.back();

  // (tokens x E) projections of every request, stacked like the inputs, the
  // concatenated heads and, for more than one request, their stacked output.
  // Self-attention (keys and values omitted): Q, K and V side by side, three
  // products over the same tokens into one (tokens x 3E) buffer, stored
  // where q, k and v (consecutive, tokens x E each) would be.
  const bool self_attention =
      std::all_of(requests.begin(), requests.end(), [](const ValidatedRequest& r) {
        return !r.request->keys.has_value() && !r.request->values.has_value();
      });
  std::vector<float> once;
  const auto [q, k, v, concat, stacked_output, stacked_queries, stacked_keys, stacked_values] =
      GroupScratch<8>({total_queries * width, total_keys * width, total_keys * width,
                       total_queries * width, n == 1 ? 0 : total_queries * width,
                       StackedFloats(requests, QueriesOf),
                       self_attention ? 0 : StackedFloats(requests, KeysOf),
                       self_attention ? 0 : StackedFloats(requests, ValuesOf)},
                      once);
  const int64_t qkv_stride = self_attention ? 3 * width : width;
  const float* const queries_in = StackRows(requests, QueriesOf, stacked_queries);
  // Each example's key and value rows that are read (RowsRead), in order.
  std::vector<int64_t> keys_read, values_read;
  for (const ValidatedRequest& request : requests) {
    for (int64_t b = 0; b < request.dims.batch; ++b) {
      const RowsRead read = RowsReadOf(request, b);
      keys_read.push_back(read.keys);
      values_read.push_back(read.values);
    }
  }
  const Projection keys_whole{self_attention ? queries_in : StackRows(requests, KeysOf, stacked_keys),
                              self_attention ? q + width : k, total_keys, &model.w_k, &model.b_k,
                              true, &model.packed_k, qkv_stride};
  const Projection values_whole{
      self_attention ? queries_in : StackRows(requests, ValuesOf, stacked_values),
      self_attention ? q + 2 * width : v, total_keys, &model.w_v, &model.b_v, true,
      &model.packed_v, qkv_stride};
  std::vector<Projection> projections = {
      {queries_in, q, total_queries, &model.w_q, &model.b_q, true, &model.packed_q, qkv_stride}};
  AddReadRows(requests, keys_read, keys_whole, projections);
  AddReadRows(requests, values_read, values_whole, projections);
  RunProjections(pool, projections, LoneStop(stops));

  // Tasks point into `problems`: reserve it whole so it never reallocates.
  std::vector<FlashProblem> problems;
  size_t num_problems = 0;
  for (size_t r = 0; r < n; ++r) num_problems += requests[r].dims.batch * heads;
  problems.reserve(num_problems);
  std::vector<AttentionTask> tasks;
  std::deque<PendingValueRows> pending_values;
  size_t example = 0;
  for (size_t r = 0; r < n; ++r) {
    const AttentionDims& d = requests[r].dims;
    for (int64_t b = 0; b < d.batch; ++b, ++example) {
      const int64_t query_row = query_rows[r] + b * d.num_queries;
      const int64_t key_row = key_rows[r] + b * d.num_keys;
      PendingValues* pending = nullptr;
      if (values_read[example] < d.num_keys) {
        pending = &pending_values.emplace_back(values_whole.Rows(
            key_row + values_read[example], d.num_keys - values_read[example]));
      }
      for (int64_t h = 0; h < heads; ++h) {
        FlashProblem p;
        const int64_t column = h * head_size;
        p.queries = q + query_row * qkv_stride + column;
        p.keys = keys_whole.out + key_row * qkv_stride + column;
        p.values = values_whole.out + key_row * qkv_stride + column;
        p.pending_values = pending;
        p.output = concat + query_row * width + column;
        p.query_stride = p.key_stride = p.value_stride = qkv_stride;
        p.output_stride = width;
        p.num_queries = d.num_queries;
        p.num_keys = d.num_keys;
        p.head_size = p.value_size = head_size;
        p.scale = d.scale;
        p.bounds = BoundsOf(requests[r], b);
        p.stop = stops[r];
        problems.push_back(p);
        AddTasks(problems.back(), WeightsOf(results[r], b * heads + h, d), tasks);
      }
    }
  }
  RunAttention(pool, tasks);

  if (n == 1) {
    RunProjections(pool, {{concat, results[0].output.data.data(), total_queries,
                           &model.w_o, &model.b_o, true, &model.packed_o}},
                   LoneStop(stops));
    return;
  }
  RunProjections(pool, {{concat, stacked_output, total_queries, &model.w_o, &model.b_o, true,
                         &model.packed_o}});
  for (size_t r = 0; r < n; ++r) {
    std::copy_n(stacked_output + query_rows[r] * width, results[r].output.data.size(),
                results[r].output.data.begin());
  }
}

// A request's share of a group's bound: its query and key rows times the
// widest row any stacked buffer holds for it (inputs, a projection to E or to
// additive's h, or the output).
int64_t GroupFloats(const Model& model, const AttentionDims& d) {
  const int64_t widest = std::max({d.query_size, d.key_size, d.value_size, d.output_size,
                                   static_cast<int64_t>(model.w_q.rows())});
  return d.batch * (d.num_queries + d.num_keys) * widest;
}

void RunGroup(ThreadPool& pool, const Model& model, std::span<const ValidatedRequest> requests,
              std::span<AttentionResult> results, Stops stops) {
  switch (model.kind) {
    case Kind::kDotProduct:
    case Kind::kDistance:
    case Kind::kBilinear:
      RunDotProductFamily(pool, model, requests, results, stops);
      break;
    case Kind::kAdditive:
      RunAdditive(pool, model, requests, results, stops);
      break;
    case Kind::kMultiHead:
      RunMultiHead(pool, model, requests, results, stops);
      break;
  }
}

float LargestMagnitude(const TensorView& t) {
  float largest = 0;
  for (float x : t.data) largest = std::max(largest, std::abs(x));
  return largest;
}

// OK when the answer is finite. The kernels recompute overflowing score
// rows in double, so what is left is a finite request whose answer itself
// overflows float32 (projections or sums of huge weights and inputs):
// refused rather than answered with inf or NaN.
absl::Status CheckFinite(const Model& model, const ValidatedRequest& v,
                         const AttentionResult& result) {
  for (const auto& [name, tensor] : {std::pair<const char*, const Tensor*>{"output", &result.output},
                                    {"attention_weights", &result.attention_weights}}) {
    if (const int64_t at = FirstNonFinite(tensor->data); at >= 0) {
      const AttentionRequest& request = *v.request;
      const float largest = std::max({LargestMagnitude(request.queries),
                                      LargestMagnitude(ResolvedKeys(request)),
                                      LargestMagnitude(ResolvedValues(request))});
      return absl::InvalidArgumentError(absl::StrCat(
          name, "[", at, "]: expected a finite value, got ", tensor->data[at],
          ": the request overflows float32 on model '", model.name, "' (scale ", v.dims.scale,
          ", largest input magnitude ", largest, "); send a smaller scale or smaller values"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

Engine::Engine(EngineOptions options)
    : pool_(std::make_unique<ThreadPool>(options.num_threads)),
      max_group_floats_(options.max_group_floats > 0 ? options.max_group_floats : kGroupFloats) {
  RunBlasOnCallingThread();
}

Engine::~Engine() = default;

int Engine::num_threads() const { return pool_->num_threads(); }

absl::StatusOr<AttentionResult> Engine::Attend(const Model& model, const AttentionRequest& request,
                                               const Limits& limits) {
  absl::StatusOr<AttentionDims> dims = Validate(model, request, limits);
  if (!dims.ok()) return dims.status();
  const ValidatedRequest validated{&request, *dims, {}};
  AttentionResult result;
  Run(model, {&validated, 1}, {&result, 1});
  if (!result.status.ok()) return result.status;
  return result;
}

void Engine::Run(const Model& model, std::span<const ValidatedRequest> requests,
                 std::span<AttentionResult> results) {
  for (size_t r = 0; r < requests.size(); ++r) {
    const AttentionDims& d = requests[r].dims;
    results[r].output.shape = {d.batch, d.num_queries, d.output_size};
    results[r].output.data.assign(d.output_elements(), 0.0f);
    results[r].status = absl::OkStatus();
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
  // A stop only for requests long enough to be polled at all.
  std::deque<RequestStop> stop_storage;
  std::vector<RequestStop*> stops(requests.size(), nullptr);
  for (size_t r = 0; r < requests.size(); ++r) {
    if (requests[r].stop && RequestWork(model, requests[r].dims) >= kStopPollWork) {
      stops[r] = &stop_storage.emplace_back(requests[r].stop);
    }
  }
  // Each group as one execution over the whole pool; a request over the
  // bound is a group of its own.
  for (size_t begin = 0; begin < requests.size();) {
    int64_t floats = GroupFloats(model, requests[begin].dims);
    size_t end = begin + 1;
    while (end < requests.size() &&
           floats + GroupFloats(model, requests[end].dims) <= max_group_floats_) {
      floats += GroupFloats(model, requests[end++].dims);
    }
    RunGroup(*pool_, model, requests.subspan(begin, end - begin),
             results.subspan(begin, end - begin), Stops(stops).subspan(begin, end - begin));
    begin = end;
  }
  for (size_t r = 0; r < requests.size(); ++r) {
    absl::Status status = stops[r] != nullptr ? stops[r]->why() : absl::OkStatus();
    if (status.ok()) status = CheckFinite(model, requests[r], results[r]);
    if (!status.ok()) results[r] = {.output = {}, .attention_weights = {}, .status = status};
  }
}

}  // namespace attention
