// flash_tile.cc: the fused tile kernel (flash_tile.h), compiled by Highway
// once per vector path (core/kernels/isa_dispatch.h), with the query tile's
// transpose into lanes and the output's back into rows. FlashTilePathFor
// picks among them, and among the avx512_bf16 path's BF16 kernel
// (flash_tile_bf16.cc) for bf16 models.
#include "core/kernels/flash_tile.h"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "core/kernels/float16.h"
#include "core/kernels/isa_dispatch.h"
#include "core/kernels/packed_gemm.h"
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "core/kernels/flash_tile.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
// Highway's headers come after foreach_target, which re-includes this file per target.
#include "hwy/cache_control.h"
#include "hwy/contrib/math/math-inl.h"
#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace attention {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

using D = hn::ScalableTag<float>;
using V = hn::Vec<D>;
static_assert(kFlashPaddedLanes % (2 * HWY_LANES(float)) == 0 &&
              kFlashQueryTile % kFlashPaddedLanes == 0);

// Key rows per score micro-kernel and value columns per P V micro-kernel.
// Each works on two query vectors, so it holds 2 x this many accumulators,
// two loaded vectors and a broadcast: 19 of AVX-512's 32 registers, 13 of
// AVX2's 16 — enough independent FMAs to cover their latency on two ports.
#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
constexpr int kBlock = 8;
#else
constexpr int kBlock = 5;
#endif

// Scores of keys [key, key + R) for the two query vectors at `lane`:
// scores[j][lane..] = k_j . (scale q) + key_bias[j].
template <int R>
HWY_INLINE void ScoreKeys(const FlashTile& t, int64_t key, int64_t lane, float* scores) {
  const D d;
  const size_t n = hn::Lanes(d);
  V acc0[R], acc1[R];
  for (int r = 0; r < R; ++r) acc0[r] = acc1[r] = hn::Zero(d);
  const float* k = t.keys + (key - t.key_base) * t.key_stride;
  const float* q = t.queries_t + lane;
  for (int64_t c = 0; c < t.head_size; ++c) {
    const V q0 = hn::LoadU(d, q + c * kFlashQueryTile);
    const V q1 = hn::LoadU(d, q + c * kFlashQueryTile + n);
    for (int r = 0; r < R; ++r) {
      const V kc = hn::Set(d, k[r * t.key_stride + c]);
      acc0[r] = hn::MulAdd(kc, q0, acc0[r]);
      acc1[r] = hn::MulAdd(kc, q1, acc1[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    const V bias = t.key_bias != nullptr ? hn::Set(d, t.key_bias[key + r]) : hn::Zero(d);
    float* row = scores + r * kFlashQueryTile + lane;
    hn::StoreU(hn::Add(acc0[r], bias), d, row);
    hn::StoreU(hn::Add(acc1[r], bias), d, row + n);
  }
}

// ScoreKeys for the last `count` (< kBlock) keys of a tile in one pass: key
// by key, each pass would be a chain of head_size dependent FMAs, and a
// masked tile's length is rarely a multiple of kBlock.
template <int R = kBlock - 1>
HWY_INLINE void ScoreTail(const FlashTile& t, int64_t key, int64_t count, int64_t lane,
                          float* scores) {
  if constexpr (R > 0) {
    if (count == R) return ScoreKeys<R>(t, key, lane, scores);
    ScoreTail<R - 1>(t, key, count, lane, scores);
  }
}

// exp(x) for the kernel's arguments, scores minus a running max, so x <= 0
// (or NaN, or -inf once a row has overflowed: those give 0, as with
// Highway's Exp). Highway's Exp takes any sign and goes down to the smallest
// denormal; here a result below the smallest normal float (x < -87) is 0,
// which moves a row's sum and output, whose largest term is exp(0) = 1, by
// less than one part in 1e37, and x / ln 2 is rounded to an integer by one
// add of 1.5 * 2^23, whose low mantissa bits then hold it. About ten vector
// operations fewer per exp than Highway's, with its reduction and
// polynomial: exp(r) = 1 + r + r^2 p(r) for r = x - q ln 2, |r| <= ln 2 / 2.
HWY_INLINE V ExpOfNonPositive(D d, V x) {
  const hn::RebindToSigned<D> di;
  const V round = hn::Set(d, 12582912.0f);  // 1.5 * 2^23
  const V shifted = hn::MulAdd(x, hn::Set(d, 1.44269504088896341f), round);
  const V q = hn::Sub(shifted, round);
  // ln 2 in two parts, so q ln 2 is exact to float precision.
  V r = hn::MulAdd(q, hn::Set(d, -0.693145751953125f), x);
  r = hn::MulAdd(q, hn::Set(d, -1.428606765330187045e-6f), r);
  const V r2 = hn::Mul(r, r);
  const V p01 = hn::MulAdd(hn::Set(d, 0.166666671633720397949219f), r, hn::Set(d, 0.5f));
  const V p23 = hn::MulAdd(hn::Set(d, 0.00833336077630519866943359f), r,
                           hn::Set(d, 0.0416664853692054748535156f));
  const V p45 = hn::MulAdd(hn::Set(d, 0.000198527617612853646278381f), r,
                           hn::Set(d, 0.00139304355252534151077271f));
  const V p = hn::MulAdd(hn::MulAdd(p45, r2, p23), r2, p01);
  const V exp_r = hn::Add(hn::MulAdd(p, r2, r), hn::Set(d, 1.0f));
  // 2^q: q + 127 into the exponent field (q >= -126 wherever it is kept).
  const auto exponent = hn::Add(hn::Sub(hn::BitCast(di, shifted), hn::BitCast(di, round)),
                                hn::Set(di, 127));
  const V two_to_q = hn::BitCast(d, hn::ShiftLeft<23>(exponent));
  return hn::IfThenElseZero(hn::Ge(x, hn::Set(d, -87.0f)), hn::Mul(exp_r, two_to_q));
}

// Online softmax of one query vector over the tile's keys [key, key + keys):
//   m' = max(m, max_j s_j);  P_j = exp(s_j - m') (0 if disallowed);
//   l' = exp(m - m') l + sum_j P_j;  rescale = exp(m - m')
// P replaces the scores in place. `masked`: some live lane's bound falls
// inside the tile, so keys must be compared with the bounds.
HWY_INLINE void SoftmaxVector(const FlashTile& t, int64_t key, int64_t keys, int64_t lane,
                              bool masked) {
  const D d;
  const V old_max = hn::LoadU(d, t.row_max + lane);
  const V bound = hn::LoadU(d, t.bounds + lane);
  float* scores = t.scores + lane;
  V max = old_max;
  for (int64_t j = 0; j < keys; ++j) {
    V s = hn::LoadU(d, scores + j * kFlashQueryTile);
    if (masked) s = hn::IfThenElse(hn::Lt(hn::Set(d, static_cast<float>(key + j)), bound), s, max);
    max = hn::Max(max, s);
  }
  V sum = hn::Zero(d);
  for (int64_t j = 0; j < keys; ++j) {
    float* row = scores + j * kFlashQueryTile;
    V p = ExpOfNonPositive(d, hn::Sub(hn::LoadU(d, row), max));
    if (masked) p = hn::IfThenElseZero(hn::Lt(hn::Set(d, static_cast<float>(key + j)), bound), p);
    hn::StoreU(p, d, row);
    sum = hn::Add(sum, p);
  }
  // The first key tile starts from a zero sum and output: no factor.
  if (key == 0) {
    hn::StoreU(sum, d, t.row_sum + lane);
    hn::StoreU(max, d, t.row_max + lane);
    return;
  }
  // Lanes with no allowed key yet keep the lowest float as max: the factor
  // is exp(0) = 1 on nothing, or exp(lowest - m') = 0 once a key is allowed.
  const V rescale = ExpOfNonPositive(d, hn::Sub(old_max, max));
  hn::StoreU(rescale, d, t.rescale + lane);
  hn::StoreU(hn::MulAdd(hn::LoadU(d, t.row_sum + lane), rescale, sum), d, t.row_sum + lane);
  hn::StoreU(max, d, t.row_max + lane);
}

// acc[col..col+C][lane..] = rescale acc + sum_j v_j[col..] P_j, for the two
// query vectors at `lane`. The first key tile starts from zero.
template <int C>
HWY_INLINE void AccumulateColumns(const FlashTile& t, int64_t key, int64_t keys, int64_t lane,
                                  int64_t col) {
  const D d;
  const size_t n = hn::Lanes(d);
  V acc0[C], acc1[C];
  float* acc = t.accumulator_t + col * kFlashQueryTile + lane;
  if (key == 0) {
    for (int c = 0; c < C; ++c) acc0[c] = acc1[c] = hn::Zero(d);
  } else {
    const V rescale0 = hn::LoadU(d, t.rescale + lane);
    const V rescale1 = hn::LoadU(d, t.rescale + lane + n);
    for (int c = 0; c < C; ++c) {
      acc0[c] = hn::Mul(hn::LoadU(d, acc + c * kFlashQueryTile), rescale0);
      acc1[c] = hn::Mul(hn::LoadU(d, acc + c * kFlashQueryTile + n), rescale1);
    }
  }
  const float* v = t.values + (key - t.key_base) * t.value_stride + col;
  const float* p = t.scores + lane;
  for (int64_t j = 0; j < keys; ++j) {
    const V p0 = hn::LoadU(d, p + j * kFlashQueryTile);
    const V p1 = hn::LoadU(d, p + j * kFlashQueryTile + n);
    for (int c = 0; c < C; ++c) {
      const V vc = hn::Set(d, v[j * t.value_stride + c]);
      acc0[c] = hn::MulAdd(vc, p0, acc0[c]);
      acc1[c] = hn::MulAdd(vc, p1, acc1[c]);
    }
  }
  for (int c = 0; c < C; ++c) {
    hn::StoreU(acc0[c], d, acc + c * kFlashQueryTile);
    hn::StoreU(acc1[c], d, acc + c * kFlashQueryTile + n);
  }
}

// AccumulateColumns for the last `count` (< kBlock) value columns in one
// pass, as ScoreTail does for keys: column by column, each pass would be two
// chains of dependent FMAs over the tile's keys. On AVX2, where kBlock is 5,
// head sizes 32 and 64 leave 2 and 4 such columns.
template <int C = kBlock - 1>
HWY_INLINE void AccumulateTail(const FlashTile& t, int64_t key, int64_t keys, int64_t lane,
                               int64_t col, int64_t count) {
  if constexpr (C > 0) {
    if (count == C) return AccumulateColumns<C>(t, key, keys, lane, col);
    AccumulateTail<C - 1>(t, key, keys, lane, col, count);
  }
}

void FlashTileImpl(const FlashTile& t) {
  const D d;
  const int64_t n = static_cast<int64_t>(hn::Lanes(d));
  const int64_t group = 2 * n;  // lanes per micro-kernel
  const int64_t lanes = (t.rows + group - 1) / group * group;
  if (t.key_begin == 0) {
    for (int64_t lane = 0; lane < lanes; lane += n) {
      hn::StoreU(hn::Set(d, std::numeric_limits<float>::lowest()), d, t.row_max + lane);
      hn::StoreU(hn::Zero(d), d, t.row_sum + lane);
    }
  }
  for (int64_t key = t.key_begin; key < t.key_end; key += kFlashKeyTile) {
    const int64_t keys = t.key_end - key < kFlashKeyTile ? t.key_end - key : kFlashKeyTile;
    const bool masked = key + keys > t.min_bound;
    for (int64_t lane = 0; lane < lanes; lane += group) {
      int64_t j = 0;
      for (; j + kBlock <= keys; j += kBlock) {
        ScoreKeys<kBlock>(t, key + j, lane, t.scores + j * kFlashQueryTile);
      }
      ScoreTail(t, key + j, keys - j, lane, t.scores + j * kFlashQueryTile);
      SoftmaxVector(t, key, keys, lane, masked);
      SoftmaxVector(t, key, keys, lane + n, masked);
      int64_t col = 0;
      for (; col + kBlock <= t.value_size; col += kBlock) {
        AccumulateColumns<kBlock>(t, key, keys, lane, col);
      }
      AccumulateTail(t, key, keys, lane, col, t.value_size - col);
    }
  }
}

// A vector of keys' or values' elements as float32: loaded as they are, or
// widened from the 16 bits a session holds (bf16: shifted left 16; fp16:
// vcvtph2ps where the path has F16C).
HWY_INLINE V LoadKv(D d, const float* p) { return hn::LoadU(d, p); }
HWY_INLINE V LoadKv(D d, const hwy::bfloat16_t* p) {
  return hn::PromoteTo(d, hn::LoadU(hn::Rebind<hwy::bfloat16_t, D>(), p));
}
HWY_INLINE V LoadKv(D d, const hwy::float16_t* p) {
  return hn::PromoteTo(d, hn::LoadU(hn::Rebind<hwy::float16_t, D>(), p));
}
HWY_INLINE float KvAt(const float* p) { return *p; }
HWY_INLINE float KvAt(const hwy::bfloat16_t* p) { return hwy::F32FromBF16(*p); }
HWY_INLINE float KvAt(const hwy::float16_t* p) {
  return HalfToFloat(*reinterpret_cast<const uint16_t*>(p));
}

// Scores of keys [key, key + R) for the tile's one query row (FlashRowImpl):
// scores[r] = k_r . (scale q) + key_bias[r], the head dimensions in lanes.
// `keys` are the tile's keys as held (T: float, or a 16-bit type).
template <int R, typename T>
HWY_INLINE void RowScoreKeys(const FlashTile& t, const T* keys, int64_t key, float* scores) {
  const D d;
  const int64_t n = static_cast<int64_t>(hn::Lanes(d));
  const float* q = t.queries_t;
  const T* k = keys + (key - t.key_base) * t.key_stride;
  V acc[R];
  for (int r = 0; r < R; ++r) acc[r] = hn::Zero(d);
  int64_t c = 0;
  for (; c + n <= t.head_size; c += n) {
    const V qc = hn::LoadU(d, q + c);
    for (int r = 0; r < R; ++r) {
      acc[r] = hn::MulAdd(LoadKv(d, k + r * t.key_stride + c), qc, acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    float score = hn::GetLane(hn::SumOfLanes(d, acc[r]));
    for (int64_t tail = c; tail < t.head_size; ++tail) {
      score += q[tail] * KvAt(k + r * t.key_stride + tail);
    }
    scores[r] = t.key_bias != nullptr ? score + t.key_bias[key + r] : score;
  }
}

// Lane i of the result = the sum of v[i]'s lanes, for as many vectors as a
// vector has lanes (v is overwritten): a transposing tree of adds, 47
// instructions for AVX-512's 16 sums where 16 SumOfLanes take some 150.
// Pairs of vectors are interleaved by floats, then by pairs of floats, so
// each 128-bit block holds four sources' partial sums; then halves and
// adjacent blocks are added.
HWY_INLINE V SumsOfLanes(V* v) {
#if HWY_TARGET == HWY_SCALAR
  return v[0];
#else
  const D d;
  constexpr size_t n = HWY_LANES(float);
  for (size_t i = 0; i < n / 2; ++i) {
    v[i] = hn::Add(hn::InterleaveLower(d, v[2 * i], v[2 * i + 1]),
                   hn::InterleaveUpper(d, v[2 * i], v[2 * i + 1]));
  }
  const hn::Repartition<double, D> dd;
  for (size_t i = 0; i < n / 4; ++i) {
    const auto a = hn::BitCast(dd, v[2 * i]);
    const auto b = hn::BitCast(dd, v[2 * i + 1]);
    v[i] = hn::Add(hn::BitCast(d, hn::InterleaveLower(dd, a, b)),
                   hn::BitCast(d, hn::InterleaveUpper(dd, a, b)));
  }
  if constexpr (n >= 8) {
    // Vector i's blocks hold sources 4i..4i+3. Adding halves pairs vector
    // i with i + n/8: for 8 lanes that is the result; for 16, vector 0
    // then holds sources 0-3 in its lower half and 8-11 in its upper,
    // vector 1 sources 4-7 and 12-15, and the last step adds adjacent
    // blocks into that order.
    for (size_t i = 0; i < n / 8; ++i) {
      v[i] = hn::Add(hn::ConcatLowerLower(d, v[i + n / 8], v[i]),
                     hn::ConcatUpperUpper(d, v[i + n / 8], v[i]));
    }
  }
  if constexpr (n == 16) {
    v[0] = hn::Add(hn::OddEvenBlocks(hn::SwapAdjacentBlocks(v[1]), v[0]),
                   hn::OddEvenBlocks(v[1], hn::SwapAdjacentBlocks(v[0])));
  }
  return v[0];
#endif
}

// Query rows a score block holds (three as four) and its keys: as many
// products as a vector has lanes, one accumulator each.
template <int R>
constexpr int64_t BlockKeys() {
  return static_cast<int64_t>(HWY_LANES(float)) / (R == 3 ? 4 : R);
}

// Scores of keys [key, key + BlockKeys<R>()) (key = tile_key + j0) for R
// query rows laid out as rows, into row r's scores of the key tile at
// tile_key (scores + r * kFlashKeyTile + j0); head_size a multiple of the
// vector's lanes. Every (row, key) product has its own accumulator, so the
// FMAs run at the ports' rate rather than their latency, each key vector
// is loaded (and widened) once for all rows, and the sums take one
// SumsOfLanes for the block.
template <int R, typename T>
HWY_INLINE void RowsScoreBlock(const FlashTile& t, const T* keys, int64_t tile_key, int64_t j0) {
  constexpr size_t n = HWY_LANES(float);
  constexpr int64_t K = BlockKeys<R>();
  const D d;
  const int64_t key = tile_key + j0;
  const T* k = keys + (key - t.key_base) * t.key_stride;
  V acc[n];
  HWY_UNROLL(16) for (size_t i = 0; i < n; ++i) acc[i] = hn::Zero(d);
  for (int64_t c = 0; c < t.head_size; c += static_cast<int64_t>(n)) {
    V kc[K];
    HWY_UNROLL(16) for (int64_t i = 0; i < K; ++i) kc[i] = LoadKv(d, k + i * t.key_stride + c);
    HWY_UNROLL(4) for (int r = 0; r < R; ++r) {
      const V q = hn::LoadU(d, t.queries_t + r * t.head_size + c);
      HWY_UNROLL(16) for (int64_t i = 0; i < K; ++i) {
        acc[r * K + i] = hn::MulAdd(kc[i], q, acc[r * K + i]);
      }
    }
  }
  alignas(64) float sums[n];
  hn::Store(SumsOfLanes(acc), d, sums);
  for (int r = 0; r < R; ++r) {
    float* scores = t.scores + r * kFlashKeyTile + j0;
    for (int64_t i = 0; i < K; ++i) {
      scores[i] = t.key_bias != nullptr ? sums[r * K + i] + t.key_bias[key + i] : sums[r * K + i];
    }
  }
}

// Keys ahead of the one being read whose rows the row kernels prefetch.
constexpr int64_t kPrefetchKeys = 16;

// The cache lines of `rows` rows of `width` elements, `stride` apart: one
// run when the rows are contiguous, as a session block's rows of one kv
// head are, so the loop costs little more than its prefetches.
template <typename T>
HWY_INLINE void PrefetchLines(const T* p, int64_t rows, int64_t width, int64_t stride) {
  constexpr int64_t kLine = 64 / sizeof(T);
  if (stride == width) {
    HWY_UNROLL(4) for (int64_t c = 0; c < rows * width; c += kLine) hwy::Prefetch(p + c);
    return;
  }
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < width; c += kLine) hwy::Prefetch(p + r * stride + c);
  }
}

// The rows of keys and values [key, key + count) kPrefetchKeys keys ahead,
// for the row kernels: the hardware prefetchers stay within a page and
// restart at each block, so without it a block's first rows, and at 16 bits
// most rows, wait on memory. Rows past the tile's keys are prefetched from
// the next block when the caller gave it. Only each row's own elements: a
// row stride may span every head's row (a request's [T, heads x d] keys).
// HWY_INLINE, not plain inline: GCC 12 takes a function whose only effect is
// prefetching for one with no effect, and drops the calls it does not
// inline.
template <typename T>
HWY_INLINE void PrefetchRows(const FlashTile& t, const T* keys, const T* values, int64_t key,
                             int64_t count) {
  const int64_t ahead = key + kPrefetchKeys;
  const T* k = nullptr;
  const T* v = nullptr;
  if (ahead + count <= t.key_end) {
    k = keys + (ahead - t.key_base) * t.key_stride;
    v = values + (ahead - t.key_base) * t.value_stride;
  } else if (ahead >= t.key_end && t.next_keys != nullptr) {
    k = static_cast<const T*>(t.next_keys) + (ahead - t.key_end) * t.key_stride;
    v = static_cast<const T*>(t.next_values) + (ahead - t.key_end) * t.value_stride;
  } else {
    return;
  }
  PrefetchLines(k, count, t.head_size, t.key_stride);
  // A session whose rows are its keys and values holds them once.
  if (v != k || t.value_stride != t.key_stride || t.value_size > t.head_size) {
    PrefetchLines(v, count, t.value_size, t.value_stride);
  }
}

// Scores keys [0, keys) of the key tile at `key` for R query rows a block
// at a time (RowsScoreBlock), prefetching ahead, as far as whole blocks go;
// none where the head dimensions are not whole vectors, or where a vector
// of one lane (the portable path) holds no block of R rows. Returns the
// keys scored.
template <int R, typename T>
HWY_INLINE int64_t RowsScoreBlocks(const FlashTile& t, const T* keys_held, const T* values_held,
                                   int64_t key, int64_t keys) {
  int64_t j = 0;
  if constexpr (BlockKeys<R>() > 0) {
    if (t.head_size % static_cast<int64_t>(HWY_LANES(float)) == 0) {
      for (; j + BlockKeys<R>() <= keys; j += BlockKeys<R>()) {
        PrefetchRows(t, keys_held, values_held, key + j, BlockKeys<R>());
        RowsScoreBlock<R>(t, keys_held, key, j);
      }
    }
  }
  return j;
}

// Row r's output columns [col, col + C n) of one key tile for R query rows
// (its P at scores + r * kFlashKeyTile), each value vector widened once
// for every row.
template <int R, int C, typename T>
HWY_INLINE void RowsAccumulateColumns(const FlashTile& t, const T* v, int64_t key, int64_t keys,
                                      const float* rescale, int64_t col) {
  const D d;
  const int64_t n = static_cast<int64_t>(hn::Lanes(d));
  V a[R][C];
  for (int r = 0; r < R; ++r) {
    float* acc = t.accumulator_t + r * t.value_size + col;
    for (int c = 0; c < C; ++c) {
      a[r][c] = key == 0 ? hn::Zero(d) : hn::Mul(hn::LoadU(d, acc + c * n), hn::Set(d, rescale[r]));
    }
  }
  for (int64_t j = 0; j < keys; ++j) {
    V p[R];
    HWY_UNROLL(4) for (int r = 0; r < R; ++r) p[r] = hn::Set(d, t.scores[r * kFlashKeyTile + j]);
    HWY_UNROLL(8) for (int c = 0; c < C; ++c) {
      const V vc = LoadKv(d, v + j * t.value_stride + col + c * n);
      HWY_UNROLL(4) for (int r = 0; r < R; ++r) a[r][c] = hn::MulAdd(p[r], vc, a[r][c]);
    }
  }
  for (int r = 0; r < R; ++r) {
    float* acc = t.accumulator_t + r * t.value_size + col;
    for (int c = 0; c < C; ++c) hn::StoreU(a[r][c], d, acc + c * n);
  }
}

// The output columns of one key tile for R query rows: as many vectors of
// columns at a time as leave one accumulator per (row, vector) within
// AVX-512's 16 or AVX2's 8 (so a key's FMAs run at the ports' rate; one row
// takes eight), then four for one row, then one vector, then single
// columns.
template <int R, typename T>
HWY_INLINE void RowsAccumulate(const FlashTile& t, const T* values, int64_t key, int64_t keys,
                               const float* rescale) {
  constexpr int kAccumulators = HWY_LANES(float) >= 16 ? 16 : 8;
  constexpr int C = R == 1 ? 8 : kAccumulators / R >= 4 ? 4 : kAccumulators / R >= 2 ? 2 : 1;
  const int64_t n = static_cast<int64_t>(hn::Lanes(D()));
  const T* v = values + (key - t.key_base) * t.value_stride;
  int64_t col = 0;
  for (; col + C * n <= t.value_size; col += C * n) {
    RowsAccumulateColumns<R, C>(t, v, key, keys, rescale, col);
  }
  if constexpr (C > 4) {
    for (; col + 4 * n <= t.value_size; col += 4 * n) {
      RowsAccumulateColumns<R, 4>(t, v, key, keys, rescale, col);
    }
  }
  for (; col + n <= t.value_size; col += n) RowsAccumulateColumns<R, 1>(t, v, key, keys, rescale, col);
  for (; col < t.value_size; ++col) {
    for (int r = 0; r < R; ++r) {
      float* acc = t.accumulator_t + r * t.value_size + col;
      float sum = key == 0 ? 0.0f : *acc * rescale[r];
      for (int64_t j = 0; j < keys; ++j) {
        sum += t.scores[r * kFlashKeyTile + j] * KvAt(v + j * t.value_stride + col);
      }
      *acc = sum;
    }
  }
}

// FlashRowImpl over keys and values held as T.
template <typename T>
void FlashRowOf(const FlashTile& t, const T* keys_held, const T* values_held) {
  const D d;
  const int64_t n = static_cast<int64_t>(hn::Lanes(d));
  constexpr float kLowest = std::numeric_limits<float>::lowest();
  float* scores = t.scores;
  for (int64_t key = t.key_begin; key < t.key_end; key += kFlashKeyTile) {
    const int64_t keys = t.key_end - key < kFlashKeyTile ? t.key_end - key : kFlashKeyTile;
    int64_t j = RowsScoreBlocks<1>(t, keys_held, values_held, key, keys);
    // The keys past the blocks (all of them where there are none) eight at
    // a time: eight independent chains of FMAs cover their latency on two
    // ports.
    for (; j + 8 <= keys; j += 8) {
      PrefetchRows(t, keys_held, values_held, key + j, 8);
      RowScoreKeys<8>(t, keys_held, key + j, scores + j);
    }
    for (; j + 4 <= keys; j += 4) RowScoreKeys<4>(t, keys_held, key + j, scores + j);
    for (; j < keys; ++j) RowScoreKeys<1>(t, keys_held, key + j, scores + j);
    const int64_t padded = (keys + n - 1) / n * n;
    for (; j < padded; ++j) scores[j] = kLowest;  // weigh exp(lowest - max) = 0
    const float old_max = key == 0 ? kLowest : t.row_max[0];
    V max = hn::Set(d, old_max);
    for (j = 0; j < padded; j += n) max = hn::Max(max, hn::LoadU(d, scores + j));
    max = hn::MaxOfLanes(d, max);
    V sum = hn::Zero(d);
    for (j = 0; j < padded; j += n) {
      const V p = ExpOfNonPositive(d, hn::Sub(hn::LoadU(d, scores + j), max));
      hn::StoreU(p, d, scores + j);
      sum = hn::Add(sum, p);
    }
    const float new_max = hn::GetLane(max);
    const float rescale = hn::GetLane(ExpOfNonPositive(d, hn::Set(d, old_max - new_max)));
    const float tile_sum = hn::GetLane(hn::SumOfLanes(d, sum));
    t.row_sum[0] = key == 0 ? tile_sum : t.row_sum[0] * rescale + tile_sum;
    t.row_max[0] = new_max;
    RowsAccumulate<1>(t, values_held, key, keys, &rescale);
  }
}

// Scores of keys [key, key + count) (count 1 or 2; key = tile_key + j0)
// for R query rows over keys held in 16 bits, into row r's scores of the key
// tile at tile_key (scores + r * kFlashKeyTile + j0): each key vector is
// widened once for every row.
template <int R, typename T>
HWY_INLINE void RowsScorePair(const FlashTile& t, const T* keys, int64_t tile_key, int64_t j0,
                              int64_t count) {
  const int64_t key = tile_key + j0;
  const D d;
  const int64_t n = static_cast<int64_t>(hn::Lanes(d));
  const T* k = keys + (key - t.key_base) * t.key_stride;
  V acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = hn::Zero(d);
  int64_t c = 0;
  for (; c + n <= t.head_size; c += n) {
    const V k0 = LoadKv(d, k + c);
    const V k1 = count > 1 ? LoadKv(d, k + t.key_stride + c) : hn::Zero(d);
    for (int r = 0; r < R; ++r) {
      const V q = hn::LoadU(d, t.queries_t + r * t.head_size + c);
      acc[r][0] = hn::MulAdd(k0, q, acc[r][0]);
      acc[r][1] = hn::MulAdd(k1, q, acc[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) {
    const float* q = t.queries_t + r * t.head_size;
    for (int64_t j = 0; j < count; ++j) {
      float score = hn::GetLane(hn::SumOfLanes(d, acc[r][j]));
      for (int64_t tail = c; tail < t.head_size; ++tail) {
        score += q[tail] * KvAt(k + j * t.key_stride + tail);
      }
      t.scores[r * kFlashKeyTile + j0 + j] =
          t.key_bias != nullptr ? score + t.key_bias[key + j] : score;
    }
  }
}

// FlashRowOf for R rows that all visit the tile's keys: a grouped-query
// group of a decoding step. Row by row, only the first row's pass would
// stream the block from memory and the others would reread it from L2, with
// nothing overlapping the two; a 16-bit block would be widened once a row.
template <int R, typename T>
void FlashRowsOf(const FlashTile& t, const T* keys_held, const T* values_held) {
  const D d;
  const int64_t n = static_cast<int64_t>(hn::Lanes(d));
  constexpr float kLowest = std::numeric_limits<float>::lowest();
  for (int64_t key = t.key_begin; key < t.key_end; key += kFlashKeyTile) {
    const int64_t keys = t.key_end - key < kFlashKeyTile ? t.key_end - key : kFlashKeyTile;
    int64_t j = RowsScoreBlocks<R>(t, keys_held, values_held, key, keys);
    for (; j < keys; j += 2) {
      PrefetchRows(t, keys_held, values_held, key + j, 2);
      RowsScorePair<R>(t, keys_held, key, j, keys - j < 2 ? keys - j : 2);
    }
    const int64_t padded = (keys + n - 1) / n * n;
    float rescale[R];
    for (int r = 0; r < R; ++r) {
      float* scores = t.scores + r * kFlashKeyTile;
      for (int64_t j = keys; j < padded; ++j) scores[j] = kLowest;
      const float old_max = key == 0 ? kLowest : t.row_max[r];
      V max = hn::Set(d, old_max);
      for (int64_t j = 0; j < padded; j += n) max = hn::Max(max, hn::LoadU(d, scores + j));
      max = hn::MaxOfLanes(d, max);
      V sum = hn::Zero(d);
      for (int64_t j = 0; j < padded; j += n) {
        const V p = ExpOfNonPositive(d, hn::Sub(hn::LoadU(d, scores + j), max));
        hn::StoreU(p, d, scores + j);
        sum = hn::Add(sum, p);
      }
      const float new_max = hn::GetLane(max);
      rescale[r] = hn::GetLane(ExpOfNonPositive(d, hn::Set(d, old_max - new_max)));
      const float tile_sum = hn::GetLane(hn::SumOfLanes(d, sum));
      t.row_sum[r] = key == 0 ? tile_sum : t.row_sum[r] * rescale[r] + tile_sum;
      t.row_max[r] = new_max;
    }
    RowsAccumulate<R>(t, values_held, key, keys, rescale);
  }
}

// FlashRowsOf over the tile's rows, four at a time (one row: FlashRowOf).
template <typename T>
void FlashRowGroupOf(const FlashTile& t, const T* keys_held, const T* values_held) {
  if (t.rows == 1) return FlashRowOf(t, keys_held, values_held);
  for (int64_t first = 0; first < t.rows; first += 4) {
    FlashTile part = t;
    part.queries_t = t.queries_t + first * t.head_size;
    part.accumulator_t = t.accumulator_t + first * t.value_size;
    part.row_max = t.row_max + first;
    part.row_sum = t.row_sum + first;
    switch (t.rows - first < 4 ? t.rows - first : 4) {
      case 1:
        FlashRowsOf<1>(part, keys_held, values_held);
        break;
      case 2:
        FlashRowsOf<2>(part, keys_held, values_held);
        break;
      case 3:
        FlashRowsOf<3>(part, keys_held, values_held);
        break;
      default:
        FlashRowsOf<4>(part, keys_held, values_held);
        break;
    }
  }
}

// FlashTileImpl for a tile of one query row, as a decoding step's single
// token is: the lane-per-query kernel would compute a whole group of lanes
// for one live lane, so here the head dimensions (scores) and the value
// columns (P V) are in lanes, and the online softmax runs over keys in
// lanes. queries_t holds scale * q as a row and accumulator_t the
// unnormalised output as a row; every key visited is allowed (a tile of one
// row ends its keys at that row's bound). Keys and values are read as the
// tile holds them (FlashTile::kv_dtype).
void FlashRowImpl(const FlashTile& t) {
  switch (t.kv_dtype) {
    case KvDtype::kBfloat16:
      return FlashRowGroupOf(t, reinterpret_cast<const hwy::bfloat16_t*>(t.keys16),
                             reinterpret_cast<const hwy::bfloat16_t*>(t.values16));
    case KvDtype::kFloat16:
      return FlashRowGroupOf(t, reinterpret_cast<const hwy::float16_t*>(t.keys16),
                             reinterpret_cast<const hwy::float16_t*>(t.values16));
    case KvDtype::kFloat32:
      break;
  }
  FlashRowGroupOf(t, t.keys, t.values);
}

// WidenKvRows on this path's vectors.
void WidenKvImpl(KvDtype dtype, const uint16_t* in, int64_t count, float* out) {
  const D d;
  const int64_t n = static_cast<int64_t>(hn::Lanes(d));
  const auto widen = [&](const auto* held) {
    int64_t i = 0;
    for (; i + n <= count; i += n) hn::StoreU(LoadKv(d, held + i), d, out + i);
    for (; i < count; ++i) out[i] = KvAt(held + i);
  };
  if (dtype == KvDtype::kBfloat16) {
    widen(reinterpret_cast<const hwy::bfloat16_t*>(in));
  } else {
    widen(reinterpret_cast<const hwy::float16_t*>(in));
  }
}

// v[k] = row k of an N x N block, N = the vector's lanes, becomes v[k] =
// column k: 4 x 4 transposes inside each 128-bit block, then the blocks
// themselves are transposed (two 256-bit halves on AVX2, four blocks on
// AVX-512). The portable path's single lane is its own transpose.
template <class DF>
HWY_INLINE void TransposeBlock(DF d, hn::Vec<DF>* v) {
  constexpr size_t N = HWY_LANES(float);
  static_assert(N == 1 || N == 4 || N == 8 || N == 16,
                "a path of another vector width needs its block transpose");
#if HWY_TARGET == HWY_SCALAR
  (void)d;
  (void)v;
#else
  {
    const hn::Repartition<uint64_t, DF> d64;
    for (size_t g = 0; g < N; g += 4) {
      // Rows a, b, c, e of the group: t0 = a0 b0 a1 b1, t1 = c0 e0 c1 e1, ...
      const auto t0 = hn::BitCast(d64, hn::InterleaveLower(d, v[g], v[g + 1]));
      const auto t1 = hn::BitCast(d64, hn::InterleaveLower(d, v[g + 2], v[g + 3]));
      const auto t2 = hn::BitCast(d64, hn::InterleaveUpper(d, v[g], v[g + 1]));
      const auto t3 = hn::BitCast(d64, hn::InterleaveUpper(d, v[g + 2], v[g + 3]));
      v[g] = hn::BitCast(d, hn::InterleaveLower(d64, t0, t1));
      v[g + 1] = hn::BitCast(d, hn::InterleaveUpper(d64, t0, t1));
      v[g + 2] = hn::BitCast(d, hn::InterleaveLower(d64, t2, t3));
      v[g + 3] = hn::BitCast(d, hn::InterleaveUpper(d64, t2, t3));
    }
  }
  // Now block b of v[g + i] holds column 4b + i of rows g..g+3.
  if constexpr (N == 8) {
    for (size_t i = 0; i < 4; ++i) {
      const auto lo = v[i], hi = v[4 + i];
      v[i] = hn::ConcatLowerLower(d, hi, lo);
      v[4 + i] = hn::ConcatUpperUpper(d, hi, lo);
    }
  } else if constexpr (N == 16) {
    for (size_t i = 0; i < 4; ++i) {
      const auto a = v[i], b = v[4 + i], c = v[8 + i], e = v[12 + i];
      // Blocks 0 and 2 of a and b, interleaved; then blocks 1 and 3.
      const auto ab_even = hn::OddEvenBlocks(hn::SwapAdjacentBlocks(b), a);
      const auto ab_odd = hn::OddEvenBlocks(b, hn::SwapAdjacentBlocks(a));
      const auto ce_even = hn::OddEvenBlocks(hn::SwapAdjacentBlocks(e), c);
      const auto ce_odd = hn::OddEvenBlocks(e, hn::SwapAdjacentBlocks(c));
      v[i] = hn::ConcatLowerLower(d, ce_even, ab_even);
      v[4 + i] = hn::ConcatLowerLower(d, ce_odd, ab_odd);
      v[8 + i] = hn::ConcatUpperUpper(d, ce_even, ab_even);
      v[12 + i] = hn::ConcatUpperUpper(d, ce_odd, ab_odd);
    }
  }
#endif
}

void LoadQueriesImpl(const float* queries, int64_t query_stride, int64_t rows, int64_t head_size,
                     float scale, float* queries_t) {
  const D d;
  constexpr int64_t N = HWY_LANES(float);
  const int64_t lanes = (rows + kFlashPaddedLanes - 1) / kFlashPaddedLanes * kFlashPaddedLanes;
  const V factor = hn::Set(d, scale);
  const int64_t full_columns = head_size / N * N;
  // Rows at or past `rows` load as zeros: the padding lanes come out zero.
  for (int64_t lane = 0; lane < lanes; lane += N) {
    for (int64_t c = 0; c < full_columns; c += N) {
      V v[N];
      if (lane + N <= rows) {
        for (int64_t k = 0; k < N; ++k) {
          v[k] = hn::Mul(hn::LoadU(d, queries + (lane + k) * query_stride + c), factor);
        }
      } else {
        for (int64_t k = 0; k < N; ++k) {
          const float* query = queries + (lane + k) * query_stride + c;
          v[k] = lane + k < rows ? hn::Mul(hn::LoadU(d, query), factor) : hn::Zero(d);
        }
      }
      TransposeBlock(d, v);
      for (int64_t k = 0; k < N; ++k) {
        hn::StoreU(v[k], d, queries_t + (c + k) * kFlashQueryTile + lane);
      }
    }
  }
  for (int64_t c = full_columns; c < head_size; ++c) {
    float* column = queries_t + c * kFlashQueryTile;
    for (int64_t r = 0; r < rows; ++r) column[r] = queries[r * query_stride + c] * scale;
    for (int64_t r = rows; r < lanes; ++r) column[r] = 0.0f;
  }
}

void StoreOutputImpl(const FlashTile& t, float* output, int64_t output_stride) {
  const D d;
  constexpr int64_t N = HWY_LANES(float);
  const int64_t full_rows = t.rows / N * N;
  const int64_t full_columns = t.value_size / N * N;
  const float* acc = t.accumulator_t;
  const V one = hn::Set(d, 1.0f);
  const V zero = hn::Zero(d);
  // The finiteness probe adds x * 0 for every output x and for the row's
  // max, sum and 1 / sum: 0, or NaN exactly when one of them is not finite.
  // Four sums, so the adds do not form one chain.
  for (int64_t lane = 0; lane < full_rows; lane += N) {
    const V sum = hn::LoadU(d, t.row_sum + lane);
    const V inverse_sum = hn::Div(one, sum);
    V probe[4] = {hn::Mul(hn::LoadU(d, t.row_max + lane), zero), hn::Mul(sum, zero),
                  hn::Mul(inverse_sum, zero), zero};
    for (int64_t c = 0; c < full_columns; c += N) {
      V v[N];
      for (int64_t k = 0; k < N; ++k) {
        v[k] = hn::Mul(hn::LoadU(d, acc + (c + k) * kFlashQueryTile + lane), inverse_sum);
        probe[k % 4] = hn::MulAdd(v[k], zero, probe[k % 4]);
      }
      TransposeBlock(d, v);
      for (int64_t k = 0; k < N; ++k) hn::StoreU(v[k], d, output + (lane + k) * output_stride + c);
    }
    hn::StoreU(hn::Add(hn::Add(probe[0], probe[1]), hn::Add(probe[2], probe[3])), d,
               t.rescale + lane);
  }
  // Columns past the last full block, and rows past the last full block.
  for (int64_t r = 0; r < t.rows; ++r) {
    const float inverse_sum = 1.0f / t.row_sum[r];
    float* out = output + r * output_stride;
    float probe = r < full_rows ? t.rescale[r]
                                : t.row_max[r] * 0.0f + t.row_sum[r] * 0.0f + inverse_sum * 0.0f;
    for (int64_t c = r < full_rows ? full_columns : 0; c < t.value_size; ++c) {
      out[c] = acc[c * kFlashQueryTile + r] * inverse_sum;
      probe += out[c] * 0.0f;
    }
    t.rescale[r] = probe;
  }
}

#if HWY_TARGET == HWY_AVX3
// The avx512_bf16 path's query tile: LoadQueriesImpl's scale * Q^T, then in
// pairs of head dimensions (internal::PairQueryLanes, flash_tile_bf16.cc).
void LoadQueriesBf16Impl(const float* queries, int64_t query_stride, int64_t rows,
                         int64_t head_size, float scale, float* queries_t) {
  thread_local std::vector<float> transposed;
  transposed.resize(static_cast<size_t>((head_size + 1) * kFlashQueryTile));
  LoadQueriesImpl(queries, query_stride, rows, head_size, scale, transposed.data());
  const int64_t lanes = (rows + kFlashPaddedLanes - 1) / kFlashPaddedLanes * kFlashPaddedLanes;
  internal::PairQueryLanes(transposed.data(), head_size, lanes,
                           reinterpret_cast<uint32_t*>(queries_t));
}
#endif  // HWY_TARGET == HWY_AVX3

}  // namespace HWY_NAMESPACE
}  // namespace attention
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace attention {

FlashTilePath FlashTilePathFor(Isa isa, Precision precision) {
  static constexpr auto kLoadQueries = ISA_TABLE(LoadQueriesImpl);
  static constexpr auto kKernel = ISA_TABLE(FlashTileImpl);
  static constexpr auto kStoreOutput = ISA_TABLE(StoreOutputImpl);
  static constexpr auto kRowKernel = ISA_TABLE(FlashRowImpl);
  // The avx512_bf16 entries: the AVX-512 build's BF16 functions.
  static constexpr auto kLoadQueriesBf16 =
      ISA_TABLE_WITH_BF16(LoadQueriesImpl, HWY_CHOOSE_AVX3(LoadQueriesBf16Impl));
  static constexpr auto kKernelBf16 =
      ISA_TABLE_WITH_BF16(FlashTileImpl, &internal::FlashTileBf16);
  if (precision == Precision::kBf16 && isa == Isa::kAvx512Bf16) {
    // One-row tiles too take the BF16 products.
    return {kLoadQueriesBf16.For(isa), kKernelBf16.For(isa), kStoreOutput.For(isa), nullptr,
            internal::RoundToBf16Pairs, internal::PairValuesBf16};
  }
  return {kLoadQueries.For(isa), kKernel.For(isa), kStoreOutput.For(isa), kRowKernel.For(isa)};
}

void WidenKvRows(Isa isa, KvDtype dtype, const uint16_t* in, int64_t count, float* out) {
  static constexpr auto kWiden = ISA_TABLE(WidenKvImpl);
  kWiden.For(isa)(dtype, in, count, out);
}

}  // namespace attention
#endif  // HWY_ONCE
