// flash_terms.cc: attention with score terms (ALiBi, soft-capping, sinks) and
// sliding windows, the flash way: a tile of query rows meets the keys its
// rows allow, [min First(i), max Allowed(i)), in chunks; each chunk's scores
// are one product, the terms apply element-wise, an online softmax keeps
// each row's max and sum, and P V is one product. Keys outside the tile's
// window are never read, so compute follows the allowed keys. The -1e6 rule
// for disallowed keys (docs/api.md) is the same as skipping them exactly
// when a row's largest logit (its allowed scores and its sink) is far
// enough above -1e6; a row where it is not, a row with no allowed key, a
// row that overflowed, and every row whose weights are asked for take the
// exact path: the whole row of n_k scores plus the sink, in double.
#include "core/kernels/flash_terms.h"

#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "core/kernels/masked_softmax.h"

namespace attention::internal {
namespace {

using Matrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using ConstRows = Eigen::Map<const Matrix, Eigen::Unaligned, Eigen::OuterStride<>>;
using Rows = Eigen::Map<Matrix, Eigen::Unaligned, Eigen::OuterStride<>>;

// Keys per chunk: one block of a paged problem, so a chunk's keys are rows
// of one matrix.
constexpr int64_t kChunkKeys = 4 * kFlashKeyTile;
// As in flash_kernel.cc: exp(-1e6 - m) is 0 in float once m is this far above
// -1e6, so skipping disallowed keys is exact.
constexpr float kMaskedWeightVanishes = 128.0f;

// Rows [j, j + count) of the keys (values), within one block of a paged
// problem, as float32 rows: a 16-bit session's widened into the thread's
// buffer of keys (values), which the next call of the same reuses.
const float* KeyRow(const FlashProblem& p, int64_t j, int64_t count = 1) {
  if (!p.paged()) return p.keys + j * p.key_stride;
  thread_local std::vector<float> widened;
  return PagedKeyRows(p, j, count, widened);
}
const float* ValueRow(const FlashProblem& p, int64_t j, int64_t count = 1) {
  if (!p.paged()) return p.values + j * p.value_stride;
  thread_local std::vector<float> widened;
  return PagedValueRows(p, j, count, widened);
}

// Keys [begin, end) as rows of one matrix: end within begin's block.
int64_t ChunkEnd(const FlashProblem& p, int64_t begin, int64_t end) {
  const int64_t limit = p.paged() ? (begin / p.block_rows + 1) * p.block_rows : begin + kChunkKeys;
  return std::min({end, limit, begin + kChunkKeys});
}

// The score of key j for query row i before masking, from its dot product.
template <typename T>
T Scored(const FlashProblem& p, T dot, int64_t i, int64_t j) {
  T s = static_cast<T>(p.scale) * dot;
  if (p.terms.alibi_slope != 0) {
    s += static_cast<T>(p.terms.alibi_slope) * static_cast<T>(j - (p.bounds.first_query + i));
  }
  if (p.terms.softcap != 0) {
    const T cap = static_cast<T>(p.terms.softcap);
    s = cap * std::tanh(s / cap);
  }
  return s;
}

// The rule for row i, in double: every key's score (-1e6 where
// disallowed), the sink, the softmax, the output; and the row's n_k
// weights when `weights` is set.
void ExactRow(const FlashProblem& p, int64_t i, float* weights) {
  const int64_t n_k = p.num_keys, first = p.bounds.First(i), held = p.first_held_key;
  const int64_t bound = p.AllowedKeys(i);
  thread_local std::vector<double> scores;
  scores.assign(n_k, static_cast<double>(kMaskedScore));
  // Keys no longer held take no part: weight 0.
  std::fill_n(scores.begin(), held, -std::numeric_limits<double>::infinity());
  const float* q = p.queries + i * p.query_stride;
  double max_score = p.terms.has_sink ? static_cast<double>(p.terms.sink)
                                      : -std::numeric_limits<double>::infinity();
  for (int64_t j = held; j < n_k; ++j) {
    if (j >= first && j < bound) {
      const float* k = KeyRow(p, j);
      double dot = 0;
      for (int64_t c = 0; c < p.head_size; ++c) dot += static_cast<double>(q[c]) * k[c];
      scores[j] = Scored(p, dot, i, j);
    }
    max_score = std::max(max_score, scores[j]);
  }
  double sum = p.terms.has_sink ? std::exp(static_cast<double>(p.terms.sink) - max_score) : 0.0;
  for (double& s : scores) {
    s = std::exp(s - max_score);
    sum += s;
  }
  std::vector<double> out(p.value_size, 0.0);
  bool completed = false;
  for (int64_t j = 0; j < n_k; ++j) {
    const double w = scores[j] / sum;
    if (weights != nullptr) weights[j] = static_cast<float>(w);
    if (w == 0) continue;
    if (j >= bound && !completed) {
      p.CompleteValues();
      completed = true;
    }
    const float* v = ValueRow(p, j);
    for (int64_t c = 0; c < p.value_size; ++c) out[c] += w * v[c];
  }
  float* output = p.output + i * p.output_stride;
  for (int64_t c = 0; c < p.value_size; ++c) output[c] = static_cast<float>(out[c]);
  if (n_k > kKeptKernelScratchFloats) std::vector<double>().swap(scores);
}

// Per-thread buffers of one query tile.
struct TileScratch {
  Matrix scores, accumulator;
  std::vector<float> row_max, row_sum;
};

// The online pass of rows [row, row + rows) over the keys they allow within
// [lo, hi): each row's max, sum of exp(s - max) and unnormalised output in
// `t`. False when the problem's WorkStop stopped it.
bool OnlineKeys(const FlashProblem& p, int64_t row, int64_t rows, int64_t lo, int64_t hi,
                TileScratch& t) {
  int64_t key_begin = p.num_keys, key_end = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t first = p.bounds.First(row + r), bound = p.AllowedKeys(row + r);
    if (first >= bound) continue;
    key_begin = std::min(key_begin, first);
    key_end = std::max(key_end, bound);
  }
  key_begin = std::max(key_begin, lo);
  key_end = std::min(key_end, hi);
  t.accumulator.setZero(rows, p.value_size);
  t.row_max.assign(rows, -std::numeric_limits<float>::infinity());
  t.row_sum.assign(rows, 0.0f);
  const ConstRows queries(p.queries + row * p.query_stride, rows, p.head_size,
                          Eigen::OuterStride<>(p.query_stride));
  for (int64_t begin = key_begin; begin < key_end;) {
    if (p.Stopped()) return false;
    const int64_t end = ChunkEnd(p, begin, key_end), count = end - begin;
    const ConstRows keys(KeyRow(p, begin, count), count, p.head_size,
                         Eigen::OuterStride<>(p.key_stride));
    t.scores.noalias() = queries * keys.transpose();
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t first = p.bounds.First(row + r), bound = p.AllowedKeys(row + r);
      float chunk_max = -std::numeric_limits<float>::infinity();
      for (int64_t c = 0; c < count; ++c) {
        const int64_t j = begin + c;
        float& s = t.scores(r, c);
        s = j >= first && j < bound ? Scored(p, s, row + r, j)
                                    : -std::numeric_limits<float>::infinity();
        chunk_max = std::max(chunk_max, s);
      }
      const float new_max = std::max(t.row_max[r], chunk_max);
      if (new_max == -std::numeric_limits<float>::infinity()) {
        t.scores.row(r).setZero();
        continue;
      }
      const float rescale = std::exp(t.row_max[r] - new_max);
      t.row_max[r] = new_max;
      t.row_sum[r] *= rescale;
      t.accumulator.row(r) *= rescale;
      t.scores.row(r) = (t.scores.row(r).array() - new_max).exp().matrix();
      t.row_sum[r] += t.scores.row(r).sum();
    }
    const ConstRows values(ValueRow(p, begin, count), count, p.value_size,
                           Eigen::OuterStride<>(p.value_stride));
    t.accumulator.noalias() += t.scores * values;
    begin = end;
  }
  return true;
}

}  // namespace

void TermsFinish(const FlashProblem& p, int64_t row, int64_t rows, const float* max,
                 const float* sum, const float* accumulator) {
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t i = row + r;
    const int64_t allowed = std::max<int64_t>(0, p.AllowedKeys(i) - p.bounds.First(i));
    const float m = max[r];
    const float top = p.terms.has_sink ? std::max(m, p.terms.sink) : m;
    const bool masked_keys_weigh = allowed < p.num_keys && top < kMaskedScore + kMaskedWeightVanishes;
    if (allowed == 0 || masked_keys_weigh || !std::isfinite(m) || !std::isfinite(sum[r])) {
      ExactRow(p, i, nullptr);
      continue;
    }
    const float kept = std::exp(m - top);
    const float total = sum[r] * kept + (p.terms.has_sink ? std::exp(p.terms.sink - top) : 0.0f);
    Eigen::Map<Eigen::RowVectorXf> output(p.output + i * p.output_stride, p.value_size);
    output = Eigen::Map<const Eigen::RowVectorXf>(accumulator + r * p.value_size, p.value_size) *
             (kept / total);
    if (!output.allFinite()) ExactRow(p, i, nullptr);
  }
}

bool TermsOverKeys(const FlashProblem& p, int64_t row, int64_t rows, int64_t key_begin,
                   int64_t key_end, const KeyRangePart& part) {
  thread_local TileScratch scratch;
  if (!OnlineKeys(p, row, rows, key_begin, key_end, scratch)) return false;
  std::copy_n(scratch.row_max.begin(), rows, part.max);
  std::copy_n(scratch.row_sum.begin(), rows, part.sum);
  std::copy_n(scratch.accumulator.data(), rows * p.value_size, part.accumulator);
  return true;
}

namespace {

// Rows [row, row + rows) on the online path; the rows that need the exact
// path are recomputed there. False when the problem's WorkStop stopped it.
bool OnlineTile(const FlashProblem& p, int64_t row, int64_t rows, TileScratch& t) {
  if (!OnlineKeys(p, row, rows, 0, p.num_keys, t)) return false;
  TermsFinish(p, row, rows, t.row_max.data(), t.row_sum.data(), t.accumulator.data());
  return true;
}

}  // namespace

bool TermsAttention(const FlashProblem& problem, int64_t query_begin, int64_t query_end,
                    float* weights, int64_t weights_stride) {
  if (weights != nullptr) {
    for (int64_t i = query_begin; i < query_end; ++i) {
      if (problem.Stopped()) return false;
      ExactRow(problem, i, weights + i * weights_stride);
    }
    return true;
  }
  thread_local TileScratch scratch;
  for (int64_t row = query_begin; row < query_end; row += kFlashQueryTile) {
    if (!OnlineTile(problem, row, std::min(kFlashQueryTile, query_end - row), scratch)) {
      return false;
    }
  }
  if (scratch.scores.size() > kKeptKernelScratchFloats) scratch.scores.resize(0, 0);
  if (scratch.accumulator.size() > kKeptKernelScratchFloats) scratch.accumulator.resize(0, 0);
  return true;
}

}  // namespace attention::internal
