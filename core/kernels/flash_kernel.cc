// flash_kernel.cc: the fused attention kernel (online softmax over key tiles).
//
// A tile of query rows meets one tile of keys at a time; the tile kernel of
// the active path (flash_tile.h) computes the tile's scores, keeps a running
// max and sum per row, rescales the unnormalised output and adds P V, all on
// data in L1. Masking differs from PyTorch's -inf fill: docs/api.md replaces
// disallowed scores by -1e6, which is the same as skipping them exactly when
// the row's max score is far enough above -1e6 (their weight underflows to 0
// in float). Rows where that is not so, and the weights path, take the exact
// path: the row's scores are materialised and go through MaskedSoftmaxRow
// (masked_softmax.h), the rule's one home. Rows that still end non-finite
// (float overflow of a finite request) are recomputed in double
// (ExactRowInDouble).
#include "core/kernels/flash_kernel.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <new>
#include <optional>
#include <vector>

#include <Eigen/Core>

#include "core/kernels/finite.h"
#include "core/kernels/flash_terms.h"
#include "core/kernels/flash_tile.h"
#include "core/kernels/masked_softmax.h"

namespace attention {
namespace {

using TileMatrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using ConstTile = Eigen::Map<const TileMatrix, Eigen::Unaligned, Eigen::OuterStride<>>;
using Tile = Eigen::Map<TileMatrix, Eigen::Unaligned, Eigen::OuterStride<>>;
using RowArray = Eigen::Map<Eigen::ArrayXf>;

// float exp(x) is exactly 0 for x < -104 (below the smallest denormal). If a
// row's max allowed score m is at least this far above -1e6, every disallowed
// key's weight exp(-1e6 - m) / sum is exactly 0 in float, so skipping those
// keys is exact; otherwise the row takes the exact path.
constexpr float kMaskedWeightVanishes = 128.0f;

// Floats aligned to a cache line, so the tile kernel's vectors never split one.
class AlignedFloats {
 public:
  float* data() const { return data_.get(); }
  void Grow(int64_t size) {
    if (size <= size_) return;
    data_.reset(static_cast<float*>(
        ::operator new(static_cast<size_t>(size) * sizeof(float), std::align_val_t{64})));
    size_ = size;
  }
  int64_t size() const { return size_; }
  void Release() {
    data_.reset();
    size_ = 0;
  }

 private:
  struct Free {
    void operator()(float* p) const { ::operator delete(p, std::align_val_t{64}); }
  };
  std::unique_ptr<float, Free> data_;
  int64_t size_ = 0;
};

// Per-thread scratch, grown to the largest problem seen and then reused, so
// no tile allocates. Lane-major buffers hold kFlashQueryTile floats per row.
struct Scratch {
  AlignedFloats queries_t;    // head_size x lanes: scale * Q^T of the tile
  AlignedFloats accumulator;  // value_size x lanes: unnormalised output
  AlignedFloats scores;       // kFlashKeyTile x lanes: S, then P in place
  AlignedFloats lanes;        // 4 x lanes: bounds, row max, row sum, rescale
  std::vector<float> exact_row;   // n_k: one row's scores / weights on the exact path
  std::vector<float> value_mean;  // value_size: output of a row with no allowed key
  // A paged problem's keys and values in contiguous rows, for the paths
  // that read them by index (Contiguous).
  std::vector<float> keys, values;
  // A 16-bit session's rows of one block widened to float32, for the
  // kernels that read float32 (PointAtBlock, PairKeysAndValues).
  std::vector<float> widened_keys, widened_values;
  // The BF16 kernel's keys and values in pairs (FlashTile::key_pairs).
  std::vector<uint32_t> key_pairs, value_pairs;

  void Reserve(const FlashProblem& p) {
    queries_t.Grow(p.head_size * kFlashQueryTile);
    accumulator.Grow(p.value_size * kFlashQueryTile);
    scores.Grow(kFlashKeyTile * kFlashQueryTile);
    lanes.Grow(4 * kFlashQueryTile);
    if (static_cast<int64_t>(value_mean.size()) < p.value_size) value_mean.resize(p.value_size);
  }
  // The exact path's row, sized when a row first takes it.
  float* ExactRow(int64_t num_keys) {
    if (static_cast<int64_t>(exact_row.size()) < num_keys) exact_row.resize(num_keys);
    return exact_row.data();
  }
  void Trim() {
    if (queries_t.size() > kKeptKernelScratchFloats) queries_t.Release();
    if (accumulator.size() > kKeptKernelScratchFloats) accumulator.Release();
    if (static_cast<int64_t>(exact_row.capacity()) > kKeptKernelScratchFloats) {
      std::vector<float>().swap(exact_row);
    }
    if (static_cast<int64_t>(value_mean.capacity()) > kKeptKernelScratchFloats) {
      std::vector<float>().swap(value_mean);
    }
    for (std::vector<float>* rows : {&keys, &values, &widened_keys, &widened_values}) {
      if (static_cast<int64_t>(rows->capacity()) > kKeptKernelScratchFloats) {
        std::vector<float>().swap(*rows);
      }
    }
    for (std::vector<uint32_t>* pairs : {&key_pairs, &value_pairs}) {
      if (static_cast<int64_t>(pairs->capacity()) > kKeptKernelScratchFloats) {
        std::vector<uint32_t>().swap(*pairs);
      }
    }
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
// Summed in double: a float sum of huge values can overflow where the mean
// does not.
void ValueMean(const FlashProblem& p, float* mean) {
  p.CompleteValues();
  Eigen::Map<Eigen::RowVectorXf>(mean, p.value_size) =
      (ValueRows(p, 0, p.num_keys).cast<double>().colwise().sum() /
       static_cast<double>(p.num_keys))
          .cast<float>();
}

// The rule for one row in double, for a row whose float scores or sums
// overflowed: no product or sum of float inputs overflows a double (each
// score is below d * FLT_MAX^3), so a finite request gets the rule's answer.
// Writes the output row, and the row's n_k weights when `weights` is set.
void ExactRowInDouble(const FlashProblem& p, int64_t row, float* weights) {
  const int64_t n_k = p.num_keys;
  const int64_t bound = p.AllowedKeys(row);
  const double scale = p.scale;
  const Eigen::VectorXd q = QueryRows(p, row, 1).row(0).transpose().cast<double>();
  thread_local std::vector<double> scores;
  scores.assign(n_k, static_cast<double>(kMaskedScore));
  double max_score = bound < n_k ? static_cast<double>(kMaskedScore)
                                 : -std::numeric_limits<double>::infinity();
  for (int64_t j = 0; j < bound; ++j) {
    const Eigen::VectorXd k = KeyRows(p, j, 1).row(0).transpose().cast<double>();
    double s;
    if (p.distance) {
      s = -0.5 * scale * (q - k).squaredNorm();
    } else {
      s = scale * q.dot(k) + (p.key_bias != nullptr ? p.key_bias[j] : 0.0);
    }
    scores[j] = s;
    max_score = std::max(max_score, s);
  }
  double sum = 0;
  for (double& s : scores) {
    s = std::exp(s - max_score);
    sum += s;
  }
  Eigen::RowVectorXd out = Eigen::RowVectorXd::Zero(p.value_size);
  if (bound < n_k && scores[bound] != 0) p.CompleteValues();  // disallowed keys all weigh alike
  for (int64_t j = 0; j < n_k; ++j) {
    scores[j] /= sum;
    if (scores[j] != 0) out += scores[j] * ValueRows(p, j, 1).row(0).cast<double>();
    if (weights != nullptr) weights[j] = static_cast<float>(scores[j]);
  }
  OutputRows(p, row, 1).row(0) = out.cast<float>();
  if (n_k > kKeptKernelScratchFloats) std::vector<double>().swap(scores);
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
  if (weighted_keys > key_end) p.CompleteValues();
  Tile w(weights, rows, weighted_keys, Eigen::OuterStride<>(weights_stride));
  OutputRows(p, row, rows).noalias() = w * ValueRows(p, 0, weighted_keys);
  for (int64_t r = 0; r < rows; ++r) {
    float* out = p.output + (row + r) * p.output_stride;
    if (FirstNonFinite({out, static_cast<size_t>(p.value_size)}) >= 0 ||
        FirstNonFinite({weights + r * weights_stride, static_cast<size_t>(n_k)}) >= 0) {
      ExactRowInDouble(p, row + r, weights + r * weights_stride);
    }
  }
}

// Rows [first, first + count) of `blocks` (one block's), `stride` elements
// apart from `column`, as float32 rows (see PagedKeyRows).
const float* BlockRowsOf(const FlashProblem& p, const float* const* blocks, int64_t column,
                         int64_t stride, int64_t first, int64_t count,
                         std::vector<float>& widened) {
  const int64_t offset = column + (first % p.block_rows) * stride;
  if (p.kv_dtype == KvDtype::kFloat32) return blocks[first / p.block_rows] + offset;
  widened.resize(count * stride);
  WidenKvRows(ActiveIsa(), p.kv_dtype,
              reinterpret_cast<const uint16_t*>(blocks[first / p.block_rows]) + offset,
              count * stride, widened.data());
  return widened.data();
}

// Rows [0, n_k) of a paged problem's blocks, `width` elements from
// `column` of each, as float32 into `out` (n_k x width).
void GatherBlocks(const FlashProblem& p, const float* const* blocks, int64_t stride, int64_t column,
                  int64_t width, std::vector<float>& out) {
  out.resize(p.num_keys * width);
  std::vector<float> widened;
  for (int64_t j = 0; j < p.num_keys; ++j) {
    const float* row = BlockRowsOf(p, blocks, column, stride, j, 1, widened);
    std::copy_n(row, width, out.data() + j * width);
  }
}

// A paged problem as a contiguous one, for the exact paths, which read keys
// and values by index: rows whose allowed scores sit near -1e6 or overflow,
// rows with no allowed key, and the weights path. Rare, so the copy is
// made only then.
FlashProblem Contiguous(const FlashProblem& p, Scratch& scratch) {
  FlashProblem contiguous = p;
  GatherBlocks(p, p.key_blocks, p.key_stride, p.block_column, p.head_size, scratch.keys);
  GatherBlocks(p, p.value_blocks, p.value_stride, p.value_block_column, p.value_size,
               scratch.values);
  contiguous.key_blocks = contiguous.value_blocks = nullptr;
  contiguous.kv_dtype = KvDtype::kFloat32;
  contiguous.keys = scratch.keys.data();
  contiguous.values = scratch.values.data();
  contiguous.key_stride = p.head_size;
  contiguous.value_stride = p.value_size;
  return contiguous;
}

// Points the tile at the block that holds key tile.key_begin of a paged
// problem, and ends its keys at that block's end. A 16-bit session's rows
// go to the one-row kernel as held (`rowwise`), to the lane kernel widened
// from tile.key_begin on, one block at most per call.
void PointAtBlock(const FlashProblem& p, FlashTile& tile, bool rowwise, Scratch& scratch) {
  const int64_t block = tile.key_begin / p.block_rows;
  tile.key_base = block * p.block_rows;
  tile.key_end = std::min(tile.key_end, tile.key_base + p.block_rows);
  if (p.kv_dtype == KvDtype::kFloat32) {
    tile.keys = p.key_blocks[block] + p.block_column;
    tile.values = p.value_blocks[block] + p.value_block_column;
  } else if (rowwise) {
    tile.kv_dtype = p.kv_dtype;
    tile.keys16 = reinterpret_cast<const uint16_t*>(p.key_blocks[block]) + p.block_column;
    tile.values16 =
        reinterpret_cast<const uint16_t*>(p.value_blocks[block]) + p.value_block_column;
  } else {
    const int64_t count = tile.key_end - tile.key_begin;
    tile.keys = BlockRowsOf(p, p.key_blocks, p.block_column, p.key_stride, tile.key_begin, count,
                            scratch.widened_keys);
    tile.values = BlockRowsOf(p, p.value_blocks, p.value_block_column, p.value_stride,
                              tile.key_begin, count, scratch.widened_values);
    tile.key_base = tile.key_begin;
  }
}

// Gives a row-by-row tile of a paged problem, pointed at its block, the
// start of the next block's rows of the same head, for its prefetches.
void PointAtNextBlock(const FlashProblem& p, FlashTile& tile) {
  const int64_t next = tile.key_end / p.block_rows;
  const int64_t element = KvDtypeBytes(p.kv_dtype);
  tile.next_keys = reinterpret_cast<const char*>(p.key_blocks[next]) + p.block_column * element;
  tile.next_values =
      reinterpret_cast<const char*>(p.value_blocks[next]) + p.value_block_column * element;
}

// FlashAttention for at most kFlashQueryTile rows starting at `row`: the
// path's tile kernel (flash_tile.h) on the tile's queries, then each row
// normalised, or handed to the value mean or the exact path.
// Keys per kernel call between two polls of the problem's WorkStop: about
// kStopPollWork units of a full query tile, a multiple of the key tile so
// that chunking changes no result.
int64_t KeysPerPoll(const FlashProblem& p) {
  const int64_t per_key = kFlashQueryTile * (p.head_size + p.value_size + 16);
  return std::max<int64_t>(1, kStopPollWork / per_key / kFlashKeyTile) * kFlashKeyTile;
}

// The row kernel's output row, accumulator / sum, with the flag
// store_output sets: tile.rescale[0] NaN when the output, max or sum is not
// finite or the sum is 0.
void StoreRow(const FlashTile& tile, float* output) {
  const float sum = tile.row_sum[0];
  bool finite = std::isfinite(tile.row_max[0]) && std::isfinite(sum) && sum != 0.0f;
  const float inverse_sum = 1.0f / sum;
  for (int64_t c = 0; c < tile.value_size; ++c) {
    output[c] = tile.accumulator_t[c] * inverse_sum;
    finite = finite && std::isfinite(output[c]);
  }
  tile.rescale[0] = finite ? 0.0f : std::numeric_limits<float>::quiet_NaN();
}

// Keys and values [0, key_end) of `p` in the BF16 kernel's pairs
// (FlashTilePath::pair_keys), into the scratch: once for all the query tiles
// of a FlashAttention call, where pairing them per tile was about a tenth
// of the kernel's instructions at n_k = 512. Blocks hold an even number of
// rows, so a paged problem's blocks are paired one by one into the same
// rows.
void PairKeysAndValues(const FlashProblem& p, const FlashTilePath& path, int64_t key_end,
                       Scratch& scratch) {
  const int64_t key_words = (p.head_size + 1) / 2;
  scratch.key_pairs.resize(key_end * key_words);
  scratch.value_pairs.resize((key_end + 1) / 2 * p.value_size);
  const int64_t block_rows = p.paged() ? p.block_rows : std::max<int64_t>(key_end, 1);
  for (int64_t first = 0; first < key_end; first += block_rows) {
    const int64_t count = std::min(block_rows, key_end - first);
    const float* keys =
        p.paged() ? BlockRowsOf(p, p.key_blocks, p.block_column, p.key_stride, first, count,
                                scratch.widened_keys)
                  : p.keys + first * p.key_stride;
    const float* values =
        p.paged() ? BlockRowsOf(p, p.value_blocks, p.value_block_column, p.value_stride, first,
                                count, scratch.widened_values)
                  : p.values + first * p.value_stride;
    path.pair_keys(keys, p.key_stride, count, p.head_size,
                   scratch.key_pairs.data() + first * key_words);
    path.pair_values(values, p.value_stride, count, p.value_size,
                     scratch.value_pairs.data() + first / 2 * p.value_size);
  }
}

// Most rows a tile runs row by row on the path's one-row kernel: a
// decoding step's token, or a grouped-query group of them (flash_tile.h's
// lane kernel would compute a whole group of 16 or 32 lanes for them).
constexpr int64_t kRowwiseRows = 8;
// Keys each row of a row-by-row tile visits before the next row's turn: the
// keys and values of one block, which stay in L2 for the other rows, so the
// rows share one read of them from memory.
constexpr int64_t kRowwiseKeys = 4 * kFlashKeyTile;

// Whether a tile of `rows` rows runs row by row on the path's one-row kernel.
bool Rowwise(const FlashTilePath& path, int64_t rows) {
  return rows <= kRowwiseRows && path.row_kernel != nullptr;
}

// Row r of a row-by-row tile as a tile of its own: its scaled query,
// output, max, sum and flag (FlashTilePath::row_kernel's layout).
FlashTile RowTile(const FlashTile& tile, int64_t r) {
  FlashTile row = tile;
  row.queries_t = tile.queries_t + r * tile.head_size;
  row.accumulator_t = tile.accumulator_t + r * tile.value_size;
  row.row_max = tile.row_max + r;
  row.row_sum = tile.row_sum + r;
  row.rescale = tile.rescale + r;
  row.bounds = tile.bounds + r;
  row.rows = 1;
  return row;
}

// The tile of rows [row, row + rows) of `p` set up for the path's kernel:
// each lane's bound, the scaled queries, the keys, values and scratch.
// Returns the tile's largest bound (the keys it visits).
int64_t PrepareTile(const FlashProblem& p, const FlashTilePath& path, int64_t row, int64_t rows,
                    Scratch& scratch, FlashTile& tile) {
  float* bounds = scratch.lanes.data();
  tile.bounds = bounds;
  tile.row_max = bounds + kFlashQueryTile;
  tile.row_sum = bounds + 2 * kFlashQueryTile;
  tile.rescale = bounds + 3 * kFlashQueryTile;
  int64_t key_end = 0, min_bound = p.num_keys;
  // Lanes the kernel reads: rows rounded up to its group of two vectors,
  // which divides kFlashPaddedLanes on every path.
  const int64_t lanes = (rows + kFlashPaddedLanes - 1) / kFlashPaddedLanes * kFlashPaddedLanes;
  if (p.bounds.valid_lens == nullptr && !p.bounds.causal) {
    // One bound for every row (no mask, or one valid length per example).
    key_end = min_bound = p.AllowedKeys(row);
    std::fill(bounds, bounds + rows, static_cast<float>(key_end));
  } else {
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t bound = p.AllowedKeys(row + r);
      bounds[r] = static_cast<float>(bound);
      key_end = std::max(key_end, bound);
      min_bound = std::min(min_bound, bound);
    }
  }
  std::fill(bounds + rows, bounds + lanes, 0.0f);
  if (Rowwise(path, rows)) {
    // Each row's scale * q as a row, and an empty share (the lowest max, a
    // zero sum and output) for a row whose keys do not begin at 0.
    for (int64_t r = 0; r < rows; ++r) {
      const float* query = p.queries + (row + r) * p.query_stride;
      float* scaled = scratch.queries_t.data() + r * p.head_size;
      for (int64_t c = 0; c < p.head_size; ++c) scaled[c] = p.scale * query[c];
    }
    std::fill_n(tile.row_max, rows, std::numeric_limits<float>::lowest());
    std::fill_n(tile.row_sum, rows, 0.0f);
    std::fill_n(scratch.accumulator.data(), rows * p.value_size, 0.0f);
  } else {
    path.load_queries(p.queries + row * p.query_stride, p.query_stride, rows, p.head_size, p.scale,
                      scratch.queries_t.data());
  }
  tile.queries_t = scratch.queries_t.data();
  tile.keys = p.keys;
  tile.key_bias = p.key_bias;
  tile.values = p.values;
  tile.key_stride = p.key_stride;
  tile.value_stride = p.value_stride;
  tile.head_size = p.head_size;
  tile.value_size = p.value_size;
  tile.rows = rows;
  tile.min_bound = min_bound;
  tile.accumulator_t = scratch.accumulator.data();
  tile.scores = scratch.scores.data();
  tile.key_pairs = scratch.key_pairs.data();
  tile.value_pairs = scratch.value_pairs.data();
  return key_end;
}

// VisitKeys for a row-by-row tile: kRowwiseKeys keys (or a paged problem's
// block) at a time, each row over those of them it allows (the one-row kernel visits allowed keys only).
bool VisitRows(const FlashProblem& p, const FlashTilePath& path, const FlashTile& tile,
               int64_t begin, int64_t end) {
  const int64_t poll = p.stop != nullptr ? KeysPerPoll(p) : end;
  int64_t since_poll = 0;
  // A paged problem's keys a block at a time: a row's kernel call reads one.
  const int64_t step = p.paged() ? p.block_rows : kRowwiseKeys;
  // Rows that all visit the same keys (a grouped-query group of a decoding
  // step) go to the kernel together, which reads (and at 16 bits widens)
  // each key and value once for all of them.
  const bool together = tile.rows > 1 &&
                        std::all_of(tile.bounds, tile.bounds + tile.rows,
                                    [&](float bound) { return bound == tile.bounds[0]; });
  for (int64_t first = begin; first < end;) {
    const int64_t last = std::min(end, (first / step + 1) * step);
    FlashTile held = tile;  // the block's keys and values, for every row
    held.key_begin = first;
    held.key_end = last;
    if (p.paged()) {
      PointAtBlock(p, held, /*rowwise=*/true, ThreadScratch());
      if (last < end) PointAtNextBlock(p, held);
    }
    if (together) {
      path.row_kernel(held);
    } else {
      for (int64_t r = 0; r < tile.rows; ++r) {
        FlashTile row = RowTile(held, r);
        row.key_end = std::min(last, static_cast<int64_t>(tile.bounds[r]));
        if (row.key_begin >= row.key_end) continue;
        path.row_kernel(row);
      }
    }
    since_poll += (last - first) * tile.rows;
    first = last;
    if (since_poll >= poll && first < end) {
      if (p.Stopped()) return false;
      since_poll = 0;
    }
  }
  return true;
}

// The tile's kernel over keys [begin, end), continuing the running max, sum
// and output of the keys before `begin` (none when it is 0). Without a
// WorkStop, one call over every key; with one, a chunk between polls.
// False when the problem's WorkStop stopped it.
bool VisitKeys(const FlashProblem& p, const FlashTilePath& path, FlashTile& tile, int64_t begin,
               int64_t end) {
  if (Rowwise(path, tile.rows)) return VisitRows(p, path, tile, begin, end);
  const int64_t chunk = p.stop != nullptr ? KeysPerPoll(p) : std::max<int64_t>(end - begin, 1);
  const auto kernel = path.kernel;
  tile.key_begin = begin;
  do {
    tile.key_end = std::min(end, tile.key_begin + chunk);
    if (p.paged()) PointAtBlock(p, tile, /*rowwise=*/false, ThreadScratch());
    kernel(tile);
    tile.key_begin = tile.key_end;
  } while (tile.key_begin < end && !p.Stopped());
  return tile.key_begin >= end;
}

bool FlashQueryTile(const FlashProblem& p, const FlashTilePath& path, int64_t row, int64_t rows,
                    Scratch& scratch) {
  const int64_t dv = p.value_size;
  FlashTile tile;
  const int64_t key_end = PrepareTile(p, path, row, rows, scratch, tile);
  const float* bounds = tile.bounds;
  const bool rowwise = Rowwise(path, rows);
  if (!VisitKeys(p, path, tile, 0, key_end)) return false;

  // Every row normalised, out_i = acc_i / l_i (if any key was visited);
  // the rows below that need another answer overwrite theirs.
  const float* nonfinite = tile.rescale;  // NaN where a row overflowed (store_output)
  if (key_end > 0 && rowwise) {
    for (int64_t r = 0; r < rows; ++r) {
      tile.rescale[r] = 0.0f;
      if (bounds[r] > 0) StoreRow(RowTile(tile, r), p.output + (row + r) * p.output_stride);
    }
  } else if (key_end > 0) {
    path.store_output(tile, p.output + row * p.output_stride, p.output_stride);
  }
  // Without a query bias, one pass over the lanes (which the compiler
  // vectorises) finds whether any row needs another answer than its
  // normalised output: most tiles have none.
  const float* row_max = tile.row_max;
  if (key_end > 0 && p.query_bias == nullptr) {
    const float num_keys = static_cast<float>(p.num_keys);
    int redo = 0;
    for (int64_t r = 0; r < rows; ++r) {
      redo |= (bounds[r] == 0) | std::isnan(nonfinite[r]) |
              ((bounds[r] < num_keys) & (row_max[r] < kMaskedScore + kMaskedWeightVanishes));
    }
    if (redo == 0) return true;
  }
  bool have_mean = false;
  // The problem the rows below read by index: a paged one gathered, once.
  std::optional<FlashProblem> gathered;
  auto exact = [&]() -> const FlashProblem& {
    if (!p.paged()) return p;
    if (!gathered) gathered = Contiguous(p, scratch);
    return *gathered;
  };
  for (int64_t r = 0; r < rows; ++r) {
    float* out = p.output + (row + r) * p.output_stride;
    // The query bias cancels in the softmax over allowed keys; it matters
    // only when comparing the true max score with -1e6.
    const float true_max =
        tile.row_max[r] + (p.query_bias != nullptr ? p.query_bias[row + r] : 0.0f);
    // Float overflow: scores of +-inf (or inf - inf), or an unnormalised
    // output beyond FLT_MAX (store_output's probe covers the row's max and
    // sum; the query bias may overflow on its own).
    const bool overflow = std::isnan(nonfinite[r]) || !std::isfinite(true_max);
    // Allowed scores near or below -1e6: disallowed keys carry weight.
    const bool masked_keys_weigh =
        bounds[r] < p.num_keys && true_max < kMaskedScore + kMaskedWeightVanishes;
    if (bounds[r] > 0 && !overflow && !masked_keys_weigh) continue;
    if (bounds[r] == 0) {
      if (!have_mean) ValueMean(exact(), scratch.value_mean.data());
      have_mean = true;
      std::copy_n(scratch.value_mean.data(), dv, out);
    } else if (overflow) {
      ExactRowInDouble(exact(), row + r, nullptr);
    } else {
      ExactRows(exact(), row + r, 1, scratch.ExactRow(p.num_keys), p.num_keys);
    }
  }
  return true;
}

// FlashAttentionOverKeys on the path's kernel: the tile starts from an
// empty share (the lowest max, a zero sum and output), so a range that
// begins past key 0 continues from nothing, and its share is copied out
// of the kernel's lanes.
bool TileOverKeys(const FlashProblem& p, const FlashTilePath& path, int64_t row, int64_t rows,
                  int64_t key_begin, int64_t key_end, const KeyRangePart& part,
                  Scratch& scratch) {
  FlashTile tile;
  const int64_t end = std::min(key_end, PrepareTile(p, path, row, rows, scratch, tile));
  const bool rowwise = Rowwise(path, rows);
  if (!rowwise) {
    std::fill_n(tile.row_max, kFlashQueryTile, std::numeric_limits<float>::lowest());
    std::fill_n(tile.row_sum, kFlashQueryTile, 0.0f);
    std::fill_n(tile.accumulator_t, p.value_size * kFlashQueryTile, 0.0f);
  }
  if (key_begin < end && !VisitKeys(p, path, tile, key_begin, end)) return false;
  std::copy_n(tile.row_max, rows, part.max);
  std::copy_n(tile.row_sum, rows, part.sum);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < p.value_size; ++c) {
      part.accumulator[r * p.value_size + c] =
          rowwise ? tile.accumulator_t[r * p.value_size + c]
                  : tile.accumulator_t[c * kFlashQueryTile + r];
    }
  }
  return true;
}

// MergeKeyRanges' last step on the path's kernel: out = acc / sum, unless
// the row needs another answer than its normalised output, which the
// unsplit kernel then gives it.
void FinishMerged(const FlashProblem& p, int64_t row, float max, float sum,
                  const float* accumulator) {
  const int64_t bound = p.AllowedKeys(row);
  const float true_max = max + (p.query_bias != nullptr ? p.query_bias[row] : 0.0f);
  bool answered = bound > 0 && std::isfinite(true_max) && std::isfinite(sum) && sum != 0.0f &&
                  !(bound < p.num_keys && true_max < kMaskedScore + kMaskedWeightVanishes);
  float* out = p.output + row * p.output_stride;
  if (answered) {
    const float inverse_sum = 1.0f / sum;
    for (int64_t c = 0; c < p.value_size; ++c) {
      out[c] = accumulator[c] * inverse_sum;
      answered = answered && std::isfinite(out[c]);
    }
  }
  if (!answered) FlashAttention(p, row, row + 1);
}

}  // namespace

namespace internal {

const float* PagedKeyRows(const FlashProblem& p, int64_t first, int64_t count,
                          std::vector<float>& widened) {
  return BlockRowsOf(p, p.key_blocks, p.block_column, p.key_stride, first, count, widened);
}

const float* PagedValueRows(const FlashProblem& p, int64_t first, int64_t count,
                            std::vector<float>& widened) {
  return BlockRowsOf(p, p.value_blocks, p.value_block_column, p.value_stride, first, count,
                     widened);
}

}  // namespace internal

bool SplitsKeys(const FlashProblem& problem) { return !PairsKeysPerCall(problem); }

bool FlashAttentionOverKeys(const FlashProblem& problem, int64_t query_begin, int64_t query_end,
                            int64_t key_begin, int64_t key_end, const KeyRangePart& part) {
  const int64_t rows = query_end - query_begin;
  if (problem.has_terms()) {
    return internal::TermsOverKeys(problem, query_begin, rows, key_begin, key_end, part);
  }
  Scratch& scratch = ThreadScratch();
  scratch.Reserve(problem);
  const FlashTilePath path = FlashTilePathFor(ActiveIsa(), problem.precision);
  const bool completed = !problem.Stopped() && TileOverKeys(problem, path, query_begin, rows,
                                                            key_begin, key_end, part, scratch);
  scratch.Trim();
  return completed;
}

void MergeKeyRanges(const FlashProblem& problem, int64_t query_begin, int64_t query_end,
                    std::span<const KeyRangePart> parts) {
  const int64_t rows = query_end - query_begin, dv = problem.value_size;
  std::vector<float> max(rows), sum(rows), accumulator(rows * dv);
  for (int64_t r = 0; r < rows; ++r) {
    // The largest max of the parts that saw an allowed key (an empty
    // share's is the lowest float or -inf), each share rescaled to it.
    float m = -std::numeric_limits<float>::infinity();
    for (const KeyRangePart& part : parts) {
      // A NaN max (a share that overflowed) makes the row's NaN, so the
      // row is computed again.
      if (std::isnan(part.max[r]) || part.max[r] > std::numeric_limits<float>::lowest()) {
        m = std::isnan(m) ? m : std::isnan(part.max[r]) ? part.max[r] : std::max(m, part.max[r]);
      }
    }
    float l = 0;
    float* acc = accumulator.data() + r * dv;
    for (const KeyRangePart& part : parts) {
      if (!std::isnan(part.max[r]) && !(part.max[r] > std::numeric_limits<float>::lowest())) {
        continue;
      }
      const float factor = std::exp(part.max[r] - m);
      l += factor * part.sum[r];
      const float* share = part.accumulator + r * dv;
      for (int64_t c = 0; c < dv; ++c) acc[c] += factor * share[c];
    }
    max[r] = m;
    sum[r] = l;
  }
  if (problem.has_terms()) {
    internal::TermsFinish(problem, query_begin, rows, max.data(), sum.data(), accumulator.data());
    return;
  }
  for (int64_t r = 0; r < rows; ++r) {
    FinishMerged(problem, query_begin + r, max[r], sum[r], accumulator.data() + r * dv);
  }
}

int64_t KeyBounds::Allowed(int64_t query, int64_t num_keys) const {
  const int64_t length = valid_lens != nullptr ? valid_lens[query] : valid_len;
  int64_t bound = std::min(num_keys, std::max<int64_t>(length, 0));
  if (causal) bound = std::min(bound, query + 1);
  return bound;
}

bool FlashAttention(const FlashProblem& problem, int64_t query_begin, int64_t query_end) {
  // Queries (n_q x head_size), keys (n_k x head_size), values (n_k x value_size),
  // output (n_q x value_size); rows [query_begin, query_end) are computed.
  if (query_begin >= query_end) return true;
  if (problem.has_terms()) return internal::TermsAttention(problem, query_begin, query_end, nullptr, 0);
  Scratch& scratch = ThreadScratch();
  scratch.Reserve(problem);
  const FlashTilePath path = FlashTilePathFor(ActiveIsa(), problem.precision);
  if (path.pair_keys != nullptr) {
    int64_t key_end = 0;
    for (int64_t row = query_begin; row < query_end; ++row) {
      key_end = std::max(key_end, problem.AllowedKeys(row));
    }
    PairKeysAndValues(problem, path, key_end, scratch);
  }
  bool completed = true;
  for (int64_t row = query_begin; row < query_end && completed; row += kFlashQueryTile) {
    completed =
        !problem.Stopped() &&
        FlashQueryTile(problem, path, row, std::min(kFlashQueryTile, query_end - row), scratch);
  }
  // A thread keeps only what ordinary problems need: an oversized one (very
  // wide rows, or the exact path over a very long row) gives its memory back.
  scratch.Trim();
  return completed;
}

bool PairsKeysPerCall(const FlashProblem& problem) {
  return !problem.has_terms() && FlashTilePathFor(ActiveIsa(), problem.precision).pair_keys != nullptr;
}

bool AttentionWithWeights(const FlashProblem& problem, int64_t query_begin, int64_t query_end,
                          float* weights, int64_t weights_stride) {
  if (problem.has_terms()) {
    return internal::TermsAttention(problem, query_begin, query_end, weights, weights_stride);
  }
  if (problem.paged()) {
    Scratch& scratch = ThreadScratch();
    const bool completed = AttentionWithWeights(Contiguous(problem, scratch), query_begin,
                                                query_end, weights, weights_stride);
    scratch.Trim();
    return completed;
  }
  // As FlashAttention; weights (n_q x n_k) rows [query_begin, query_end) double
  // as the score buffer, so this path needs no scratch. With a WorkStop,
  // fewer rows at a time when rows are long, so polls stay about
  // kStopPollWork apart.
  const int64_t per_row = problem.num_keys * (problem.head_size + problem.value_size + 16);
  const int64_t rows_per_call =
      problem.stop != nullptr ? std::clamp<int64_t>(kStopPollWork / per_row, 1, kFlashQueryTile)
                              : kFlashQueryTile;
  for (int64_t row = query_begin; row < query_end; row += rows_per_call) {
    if (problem.Stopped()) return false;
    ExactRows(problem, row, std::min(rows_per_call, query_end - row),
              weights + row * weights_stride, weights_stride);
  }
  return true;
}

}  // namespace attention
