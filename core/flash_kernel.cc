// flash_kernel.cc: the fused attention kernel (tiled GEMMs + online softmax).
//
// The design follows PyTorch's CPU flash attention: a tile of query rows meets
// one tile of keys at a time; the tile's scores come from one GEMM, an online
// softmax keeps a running max and sum per row and rescales the unnormalised
// output, and a second GEMM adds P V. Masking differs from PyTorch's -inf
// fill: docs/api.md replaces disallowed scores by -1e6, which is the same as
// skipping them exactly when the row's max score is far enough above -1e6
// (their weight underflows to 0 in float). Rows where that is not so, and the
// weights path, take the exact path: the row's scores are materialised and
// go through MaskedSoftmaxRow (masked_softmax.h), the rule's one home.
#include "core/flash_kernel.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "core/masked_softmax.h"
#include "core/model.h"

namespace attention {
namespace {

using ConstTile = Eigen::Map<const RowMatrix, Eigen::Unaligned, Eigen::OuterStride<>>;
using Tile = Eigen::Map<RowMatrix, Eigen::Unaligned, Eigen::OuterStride<>>;
using RowArray = Eigen::Map<Eigen::ArrayXf>;

// Keys per key tile: the scores tile (kFlashQueryTile x kKeyTile floats) and
// a key/value tile of head size 64 stay in L2 across the two GEMMs.
constexpr int64_t kKeyTile = 256;

// float exp(x) is exactly 0 for x < -104 (below the smallest denormal). If a
// row's max allowed score m is at least this far above -1e6, every disallowed
// key's weight exp(-1e6 - m) / sum is exactly 0 in float, so skipping those
// keys is exact; otherwise the row takes the exact path.
constexpr float kMaskedWeightVanishes = 128.0f;

// Per-thread scratch, grown to the largest problem seen and then reused, so
// no tile allocates.
struct Scratch {
  std::vector<float> scores;       // kFlashQueryTile x kKeyTile: S, then P in place
  std::vector<float> accumulator;  // kFlashQueryTile x value_size: unnormalised output
  std::vector<float> row_max;      // kFlashQueryTile: running max of the allowed scores
  std::vector<float> row_sum;      // kFlashQueryTile: running sum of exp(s - row_max)
  std::vector<int64_t> bounds;     // kFlashQueryTile: allowed keys per row
  std::vector<float> exact_row;    // n_k: one row's scores / weights on the exact path
  std::vector<float> value_mean;   // value_size: output of a row with no allowed key

  void Reserve(const FlashProblem& p) {
    Grow(scores, kFlashQueryTile * kKeyTile);
    Grow(accumulator, kFlashQueryTile * p.value_size);
    Grow(row_max, kFlashQueryTile);
    Grow(row_sum, kFlashQueryTile);
    Grow(exact_row, p.num_keys);
    Grow(value_mean, p.value_size);
    if (static_cast<int64_t>(bounds.size()) < kFlashQueryTile) bounds.resize(kFlashQueryTile);
  }

  static void Grow(std::vector<float>& buffer, int64_t size) {
    if (static_cast<int64_t>(buffer.size()) < size) buffer.resize(size);
  }
};

Scratch& ThreadScratch() {
  thread_local Scratch scratch;
  return scratch;
}

// Rows [first, first + count) of a row-major matrix of `width` columns.
ConstTile Rows(const float* data, int64_t stride, int64_t first, int64_t count, int64_t width) {
  return ConstTile(data + first * stride, count, width, Eigen::OuterStride<>(stride));
}

// Q (rows x head_size), K (keys x head_size), V (keys x value_size) and the
// output (rows x value_size), from a given row.
ConstTile QueryRows(const FlashProblem& p, int64_t row, int64_t rows) {
  return Rows(p.queries, p.query_stride, row, rows, p.head_size);
}
ConstTile KeyRows(const FlashProblem& p, int64_t key, int64_t keys) {
  return Rows(p.keys, p.key_stride, key, keys, p.head_size);
}
ConstTile ValueRows(const FlashProblem& p, int64_t key, int64_t keys) {
  return Rows(p.values, p.value_stride, key, keys, p.value_size);
}
Tile OutputRows(const FlashProblem& p, int64_t row, int64_t rows) {
  return Tile(p.output + row * p.output_stride, rows, p.value_size,
              Eigen::OuterStride<>(p.output_stride));
}

// scores[r, c] = scale * q_{row+r} . k_{key+c} + key_bias[key+c]
// (the query bias is left to the callers: it is constant along a row).
void ScoreTile(const FlashProblem& p, int64_t row, int64_t rows, int64_t key, int64_t keys,
               Tile scores) {
  scores.noalias() = p.scale * QueryRows(p, row, rows) * KeyRows(p, key, keys).transpose();
  if (p.key_bias != nullptr) {
    scores.rowwise() += Eigen::Map<const Eigen::RowVectorXf>(p.key_bias + key, keys);
  }
}

// mean_j v_j over all n_k keys: the output of a row with no allowed key,
// whose n_k scores are all -1e6 and so weigh 1/n_k each.
void ValueMean(const FlashProblem& p, float* mean) {
  Eigen::Map<Eigen::RowVectorXf>(mean, p.value_size) =
      ValueRows(p, 0, p.num_keys).colwise().sum() / static_cast<float>(p.num_keys);
}

// Exact path for rows [row, row + rows):
//   s[i,j] = score(i,j) if j < bound(i) else -1e6;  w = softmax_j(s);  out_i = w_i V
// `weights` (rows x n_k, row stride weights_stride) receives w.
void ExactRows(const FlashProblem& p, int64_t row, int64_t rows, float* weights,
               int64_t weights_stride) {
  const int64_t n_k = p.num_keys;
  int64_t key_end = 0;
  for (int64_t r = 0; r < rows; ++r) key_end = std::max(key_end, p.AllowedKeys(row + r));
  if (key_end > 0) {
    ScoreTile(p, row, rows, 0, key_end, Tile(weights, rows, key_end, Eigen::OuterStride<>(weights_stride)));
  }
  // Columns of w that can be nonzero, for the final GEMM.
  int64_t weighted_keys = key_end;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t bound = p.AllowedKeys(row + r);
    float* scores = weights + r * weights_stride;
    if (p.query_bias != nullptr) RowArray(scores, bound) += p.query_bias[row + r];
    weighted_keys = std::max(
        weighted_keys, MaskedSoftmaxRow({scores, static_cast<size_t>(n_k)}, bound));
  }
  Tile w(weights, rows, weighted_keys, Eigen::OuterStride<>(weights_stride));
  OutputRows(p, row, rows).noalias() = w * ValueRows(p, 0, weighted_keys);
}

// Online softmax over one key tile for row r, scores s = S[r, :keys] of which
// the first `allowed` are allowed:
//   m' = max(m, max_j s_j);  P_j = exp(s_j - m') (0 if disallowed);
//   l' = exp(m - m') l + sum_j P_j;  acc *= exp(m - m')
void OnlineSoftmaxRow(float* s, int64_t keys, int64_t allowed, float& row_max, float& row_sum,
                      float* accumulator, int64_t value_size) {
  RowArray tile(s, keys);
  if (allowed == 0) {
    tile.setZero();
    return;
  }
  tile.tail(keys - allowed).setZero();
  auto scores = tile.head(allowed);
  const float new_max = std::max(row_max, scores.maxCoeff());
  // The first allowed tile has row_max = -inf: the factor is exp(-inf) = 0,
  // and new_max is finite, so no inf - inf = NaN arises.
  const float rescale = std::exp(row_max - new_max);
  scores = (scores - new_max).exp();
  row_sum = row_sum * rescale + scores.sum();
  if (rescale != 1.0f) RowArray(accumulator, value_size) *= rescale;
  row_max = new_max;
}

// FlashAttention for at most kFlashQueryTile rows starting at `row`.
void FlashQueryTile(const FlashProblem& p, int64_t row, int64_t rows, Scratch& scratch) {
  const int64_t dv = p.value_size;
  int64_t* bounds = scratch.bounds.data();
  int64_t key_end = 0;
  for (int64_t r = 0; r < rows; ++r) {
    bounds[r] = p.AllowedKeys(row + r);
    key_end = std::max(key_end, bounds[r]);
  }
  float* row_max = scratch.row_max.data();
  float* row_sum = scratch.row_sum.data();
  std::fill_n(row_max, rows, -std::numeric_limits<float>::infinity());
  std::fill_n(row_sum, rows, 0.0f);
  // acc: (rows x dv), unnormalised output.
  Tile acc(scratch.accumulator.data(), rows, dv, Eigen::OuterStride<>(dv));
  acc.setZero();

  for (int64_t key = 0; key < key_end; key += kKeyTile) {
    const int64_t keys = std::min(kKeyTile, key_end - key);
    // S: (rows x keys), scores of this tile; becomes P in place.
    Tile scores(scratch.scores.data(), rows, keys, Eigen::OuterStride<>(kKeyTile));
    ScoreTile(p, row, rows, key, keys, scores);
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t allowed = std::clamp<int64_t>(bounds[r] - key, 0, keys);
      OnlineSoftmaxRow(&scores(r, 0), keys, allowed, row_max[r], row_sum[r], &acc(r, 0), dv);
    }
    // acc += P V_tile: (rows x keys) (keys x dv).
    acc.noalias() += scores * ValueRows(p, key, keys);
  }

  Tile out = OutputRows(p, row, rows);
  bool have_mean = false;
  for (int64_t r = 0; r < rows; ++r) {
    // The query bias cancels in the softmax over allowed keys; it matters
    // only when comparing the true max score with -1e6.
    const float true_max = row_max[r] + (p.query_bias != nullptr ? p.query_bias[row + r] : 0.0f);
    if (bounds[r] == 0) {
      if (!have_mean) ValueMean(p, scratch.value_mean.data());
      have_mean = true;
      out.row(r) = Eigen::Map<const Eigen::RowVectorXf>(scratch.value_mean.data(), dv);
    } else if (bounds[r] < p.num_keys && true_max < kMaskedScore + kMaskedWeightVanishes) {
      // Allowed scores near or below -1e6: disallowed keys carry weight.
      ExactRows(p, row + r, 1, scratch.exact_row.data(), p.num_keys);
    } else {
      out.row(r) = acc.row(r) / row_sum[r];
    }
  }
}

}  // namespace

int64_t KeyBounds::Allowed(int64_t query, int64_t num_keys) const {
  const int64_t length = valid_lens != nullptr ? valid_lens[query] : valid_len;
  int64_t bound = std::min(num_keys, std::max<int64_t>(length, 0));
  if (causal) bound = std::min(bound, query + 1);
  return bound;
}

void FlashAttention(const FlashProblem& problem, int64_t query_begin, int64_t query_end) {
  // Queries (n_q x head_size), keys (n_k x head_size), values (n_k x value_size),
  // output (n_q x value_size); rows [query_begin, query_end) are computed.
  if (query_begin >= query_end) return;
  Scratch& scratch = ThreadScratch();
  scratch.Reserve(problem);
  for (int64_t row = query_begin; row < query_end; row += kFlashQueryTile) {
    FlashQueryTile(problem, row, std::min(kFlashQueryTile, query_end - row), scratch);
  }
}

void AttentionWithWeights(const FlashProblem& problem, int64_t query_begin, int64_t query_end,
                          float* weights, int64_t weights_stride) {
  // As FlashAttention; weights (n_q x n_k) rows [query_begin, query_end) double
  // as the score buffer, so this path needs no scratch.
  for (int64_t row = query_begin; row < query_end; row += kFlashQueryTile) {
    ExactRows(problem, row, std::min(kFlashQueryTile, query_end - row),
              weights + row * weights_stride, weights_stride);
  }
}

}  // namespace attention
