// flash_tile_bf16.cc: the avx512_bf16 path's tile kernel for bf16 models
// (flash_tile.h, docs/api.md 5.5), beside the per-path fp32 kernels of
// flash_tile.cc.
//
// The avx512_bf16 path's tile kernel for bf16 models (docs/api.md 5.5): QK^T
// and P V with vdpbf16ps, which multiplies a pair of BF16 values by a pair
// and adds both products to an FP32 lane. Highway 1.0.3 has no target with
// AVX512_BF16, so this file holds the kernel written with intrinsics under a
// target attribute (as packed_gemm_bf16.cc), and it is only chosen where CPUID
// reports it (core/kernels/isa_dispatch.h). Everything but the two products stays
// FP32 as in the fp32 kernel: the softmax (with an exp of its own, ExpBf16),
// its masking, the accumulator. Keys and values come paired once per problem
// (internal::RoundToBf16Pairs, as the packed GEMM rounds its inputs, and
// PairValuesImpl; flash_kernel.cc), not once per query tile.
//
// Pairs run along each product's sum: for QK^T, pairs of head dimensions
// (the queries' lanes hold (q[2i], q[2i + 1]) words, a key's pair is
// broadcast); for P V, pairs of keys ((P[2j], P[2j + 1]) per lane, a value
// pair (v[2j][c], v[2j + 1][c]) broadcast). The second of an odd count's
// last pair is zero.
//
// The target attribute is on each function, not a -m flag on the file: an
// inline function of a header built here with AVX-512 could otherwise be the
// copy the linker keeps for every caller.
// GCC 12 warns that _mm512_undefined_ps's deliberately undefined value,
// the pass-through operand of _mm512_roundscale_ps, "may be used
// uninitialized" (GCC bug 105593, fixed in GCC 13); clang has no such warning.
#if !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <limits>

#include "core/kernels/flash_tile.h"

#define ATTENTION_BF16 \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))

namespace attention::internal {
namespace {

// Key rows per score micro-kernel and value columns per P V micro-kernel,
// as the fp32 kernel's on AVX-512 (flash_tile.cc): two query vectors of
// accumulators each, 19 of the 32 registers.
constexpr int kBlock = 8;

// Words of (even, odd) rounded to BF16 (nearest even), even in the low half:
// both halves converted by one instruction, then interleaved by one shuffle.
ATTENTION_BF16 inline __m512i PairWords(__m512 even, __m512 odd) {
  // Word 2l of the result is BF16 l (even[l]), word 2l + 1 is BF16 16 + l (odd[l]).
  const __m512i interleave = _mm512_set_epi16(
      31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6, 21, 5, 20, 4,
      19, 3, 18, 2, 17, 1, 16, 0);
  return _mm512_permutexvar_epi16(interleave,
                                  reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(odd, even)));
}

ATTENTION_BF16 inline __mmask16 FirstLanes(int64_t n) {
  return static_cast<__mmask16>((1u << (n < 0 ? 0 : n > 16 ? 16 : n)) - 1u);
}


// Scores of keys [key, key + R) for the 32 lanes at `lane`, as ScoreKeys
// does in FP32.
template <int R>
ATTENTION_BF16 inline void ScoreKeysBf16(const FlashTile& t, int64_t key, int64_t lane,
                                            float* scores) {
  const int64_t words = (t.head_size + 1) / 2;
  __m512 acc0[R], acc1[R];
  for (int r = 0; r < R; ++r) acc0[r] = acc1[r] = _mm512_setzero_ps();
  const uint32_t* q = reinterpret_cast<const uint32_t*>(t.queries_t) + lane;
  const uint32_t* k = t.key_pairs + key * words;
  for (int64_t i = 0; i < words; ++i) {
    const __m512bh q0 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(q + i * kFlashQueryTile));
    const __m512bh q1 =
        reinterpret_cast<__m512bh>(_mm512_loadu_si512(q + i * kFlashQueryTile + 16));
    for (int r = 0; r < R; ++r) {
      const __m512bh kr =
          reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(k[r * words + i])));
      acc0[r] = _mm512_dpbf16_ps(acc0[r], kr, q0);
      acc1[r] = _mm512_dpbf16_ps(acc1[r], kr, q1);
    }
  }
  for (int r = 0; r < R; ++r) {
    const __m512 bias =
        t.key_bias != nullptr ? _mm512_set1_ps(t.key_bias[key + r]) : _mm512_setzero_ps();
    float* row = scores + r * kFlashQueryTile + lane;
    _mm512_storeu_ps(row, _mm512_add_ps(acc0[r], bias));
    _mm512_storeu_ps(row + 16, _mm512_add_ps(acc1[r], bias));
  }
}

template <int R = kBlock - 1>
ATTENTION_BF16 inline void ScoreTailBf16(const FlashTile& t, int64_t key, int64_t count,
                                            int64_t lane, float* scores) {
  if constexpr (R > 0) {
    if (count == R) return ScoreKeysBf16<R>(t, key, lane, scores);
    ScoreTailBf16<R - 1>(t, key, count, lane, scores);
  }
}

// exp(x) where `keep`, 0 elsewhere, for x <= 0 as ExpOfNonPositive takes
// it (a result below the smallest normal float, x < -87, is 0, and so are
// NaN and -inf), in about half its instructions: AVX-512's scalef puts q
// into the exponent, and a degree-5 polynomial with exp(0) = 1 exactly
// covers exp(r) for r = x - q ln 2, |r| <= ln 2 / 2, to 1.7e-7 relative
// (ExpOfNonPositive's: 0.9e-7), far below the BF16 rounding (3.9e-3) that
// P takes into P V.
ATTENTION_BF16 inline __m512 ExpBf16(__m512 x, __mmask16 keep) {
  const __mmask16 kept = _mm512_mask_cmp_ps_mask(keep, x, _mm512_set1_ps(-87.0f), _CMP_GE_OQ);
  const __m512 q = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  // ln 2 in two parts, so q ln 2 is exact to float precision.
  __m512 r = _mm512_fmadd_ps(q, _mm512_set1_ps(-0.693145751953125f), x);
  r = _mm512_fmadd_ps(q, _mm512_set1_ps(-1.428606765330187045e-6f), r);
  __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(8.290314116e-3f), r, _mm512_set1_ps(4.189793020e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.666763574e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.999915063e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(9.999997020e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_maskz_scalef_ps(kept, p, q);
}

// The lanes whose bound allows `key`; every lane when the tile is not masked.
ATTENTION_BF16 inline __mmask16 AllowedLanes(bool masked, int64_t key, __m512 bound) {
  if (!masked) return 0xFFFF;
  return _mm512_cmp_ps_mask(_mm512_set1_ps(static_cast<float>(key)), bound, _CMP_LT_OQ);
}

// SoftmaxVector for the 16 lanes at `lane`, writing P in pairs of keys for
// P V (in `pairs`, kFlashQueryTile words per pair of keys) instead of in
// place, and with ExpBf16.
ATTENTION_BF16 inline void SoftmaxPairs(const FlashTile& t, int64_t key, int64_t keys,
                                           int64_t lane, bool masked, uint32_t* pairs) {
  const __m512 old_max = _mm512_loadu_ps(t.row_max + lane);
  const __m512 bound = _mm512_loadu_ps(t.bounds + lane);
  const float* scores = t.scores + lane;
  __m512 max = old_max;
  for (int64_t j = 0; j < keys; ++j) {
    max = _mm512_mask_max_ps(max, AllowedLanes(masked, key + j, bound), max,
                             _mm512_loadu_ps(scores + j * kFlashQueryTile));
  }
  // Two sums, so the adds do not form one chain.
  __m512 sum_even = _mm512_setzero_ps(), sum_odd = _mm512_setzero_ps();
  for (int64_t j = 0; j < keys; j += 2) {
    const float* row = scores + j * kFlashQueryTile;
    const __m512 even = ExpBf16(_mm512_sub_ps(_mm512_loadu_ps(row), max),
                                 AllowedLanes(masked, key + j, bound));
    // An odd tile's last key pairs with zero.
    const __m512 odd = j + 1 < keys
                           ? ExpBf16(_mm512_sub_ps(_mm512_loadu_ps(row + kFlashQueryTile), max),
                                     AllowedLanes(masked, key + j + 1, bound))
                           : _mm512_setzero_ps();
    _mm512_storeu_si512(pairs + j / 2 * kFlashQueryTile + lane, PairWords(even, odd));
    sum_even = _mm512_add_ps(sum_even, even);
    sum_odd = _mm512_add_ps(sum_odd, odd);
  }
  const __m512 sum = _mm512_add_ps(sum_even, sum_odd);
  // The first key tile starts from a zero sum and output: no factor.
  if (key == 0) {
    _mm512_storeu_ps(t.row_sum + lane, sum);
    _mm512_storeu_ps(t.row_max + lane, max);
    return;
  }
  // As in SoftmaxVector: lanes with no allowed key yet keep the lowest float.
  const __m512 rescale = ExpBf16(_mm512_sub_ps(old_max, max), 0xFFFF);
  _mm512_storeu_ps(t.rescale + lane, rescale);
  _mm512_storeu_ps(t.row_sum + lane,
                   _mm512_fmadd_ps(_mm512_loadu_ps(t.row_sum + lane), rescale, sum));
  _mm512_storeu_ps(t.row_max + lane, max);
}

// One pair of keys' P V: acc += P pair (per lane) . value pair of each of
// the C columns, with `live` the pair's words that count (the second key of
// an odd tile's last pair is another tile's, or not computed: masked out).
template <int C>
ATTENTION_BF16 inline void AddValuePair(const uint32_t* v, const uint32_t* p, uint32_t live,
                                           __m512* acc0, __m512* acc1) {
  const __m512bh p0 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(p));
  const __m512bh p1 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(p + 16));
  for (int c = 0; c < C; ++c) {
    const __m512bh vc =
        reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(v[c] & live)));
    acc0[c] = _mm512_dpbf16_ps(acc0[c], vc, p0);
    acc1[c] = _mm512_dpbf16_ps(acc1[c], vc, p1);
  }
}

// AccumulateColumns with P V over pairs of keys; `pairs` holds
// SoftmaxPairs' P.
template <int C>
ATTENTION_BF16 inline void AccumulateColumnsBf16(const FlashTile& t, const uint32_t* pairs,
                                                    int64_t key, int64_t keys, int64_t lane,
                                                    int64_t col) {
  __m512 acc0[C], acc1[C];
  float* acc = t.accumulator_t + col * kFlashQueryTile + lane;
  if (key == 0) {
    for (int c = 0; c < C; ++c) acc0[c] = acc1[c] = _mm512_setzero_ps();
  } else {
    const __m512 rescale0 = _mm512_loadu_ps(t.rescale + lane);
    const __m512 rescale1 = _mm512_loadu_ps(t.rescale + lane + 16);
    for (int c = 0; c < C; ++c) {
      acc0[c] = _mm512_mul_ps(_mm512_loadu_ps(acc + c * kFlashQueryTile), rescale0);
      acc1[c] = _mm512_mul_ps(_mm512_loadu_ps(acc + c * kFlashQueryTile + 16), rescale1);
    }
  }
  // key is even (key tiles start at multiples of kFlashKeyTile), so pair
  // rows start at the tile's first key.
  const uint32_t* v = t.value_pairs + key / 2 * t.value_size + col;
  const uint32_t* p = pairs + lane;
  int64_t i = 0;
  for (; 2 * i + 1 < keys; ++i) {
    AddValuePair<C>(v + i * t.value_size, p + i * kFlashQueryTile, 0xFFFFFFFFu, acc0, acc1);
  }
  if (keys % 2 != 0) {
    AddValuePair<C>(v + i * t.value_size, p + i * kFlashQueryTile, 0x0000FFFFu, acc0, acc1);
  }
  for (int c = 0; c < C; ++c) {
    _mm512_storeu_ps(acc + c * kFlashQueryTile, acc0[c]);
    _mm512_storeu_ps(acc + c * kFlashQueryTile + 16, acc1[c]);
  }
}

template <int C = kBlock - 1>
ATTENTION_BF16 inline void AccumulateTailBf16(const FlashTile& t, const uint32_t* pairs,
                                                 int64_t key, int64_t keys, int64_t lane,
                                                 int64_t col, int64_t count) {
  if constexpr (C > 0) {
    if (count == C) return AccumulateColumnsBf16<C>(t, pairs, key, keys, lane, col);
    AccumulateTailBf16<C - 1>(t, pairs, key, keys, lane, col, count);
  }
}

}  // namespace

ATTENTION_BF16 void PairValuesBf16(const float* values, int64_t stride, int64_t count,
                                   int64_t width, uint32_t* pairs) {
  for (int64_t j = 0; j < count; j += 2) {
    const float* even = values + j * stride;
    const float* odd = even + stride;
    uint32_t* out = pairs + j / 2 * width;
    for (int64_t c = 0; c < width; c += 16) {
      const __mmask16 live = FirstLanes(width - c);
      const __m512 e = _mm512_maskz_loadu_ps(live, even + c);
      const __m512 o = _mm512_maskz_loadu_ps(j + 1 < count ? live : 0, odd + c);
      _mm512_mask_storeu_epi32(out + c, live, PairWords(e, o));
    }
  }
}

// FlashTileImpl with the two products in BF16; queries_t holds
// PairQueryLanes's pairs, key_pairs and value_pairs RoundToBf16Pairs's and
// PairValuesBf16's.
ATTENTION_BF16 void FlashTileBf16(const FlashTile& t) {
  static_assert(kFlashKeyTile % 2 == 0);
  constexpr int64_t kGroup = 32;  // lanes per micro-kernel: two vectors
  const int64_t lanes = (t.rows + kGroup - 1) / kGroup * kGroup;
  if (t.key_begin == 0) {
    for (int64_t lane = 0; lane < lanes; ++lane) {
      t.row_max[lane] = std::numeric_limits<float>::lowest();
      t.row_sum[lane] = 0.0f;
    }
  }
  // P of one key tile in pairs of keys.
  alignas(64) uint32_t pairs[kFlashKeyTile / 2 * kFlashQueryTile];
  for (int64_t key = t.key_begin; key < t.key_end; key += kFlashKeyTile) {
    const int64_t keys = t.key_end - key < kFlashKeyTile ? t.key_end - key : kFlashKeyTile;
    const bool masked = key + keys > t.min_bound;
    for (int64_t lane = 0; lane < lanes; lane += kGroup) {
      int64_t j = 0;
      for (; j + kBlock <= keys; j += kBlock) {
        ScoreKeysBf16<kBlock>(t, key + j, lane, t.scores + j * kFlashQueryTile);
      }
      ScoreTailBf16(t, key + j, keys - j, lane, t.scores + j * kFlashQueryTile);
      SoftmaxPairs(t, key, keys, lane, masked, pairs);
      SoftmaxPairs(t, key, keys, lane + 16, masked, pairs);
      int64_t col = 0;
      for (; col + kBlock <= t.value_size; col += kBlock) {
        AccumulateColumnsBf16<kBlock>(t, pairs, key, keys, lane, col);
      }
      AccumulateTailBf16(t, pairs, key, keys, lane, col, t.value_size - col);
    }
  }
}

// LoadQueriesImpl's scale * Q^T (`transposed`, head_size rows of
// kFlashQueryTile lanes, one more row than head_size allocated) in pairs of
// head dimensions: row i of `pairs` holds, per lane, the word
// (q[2i], q[2i + 1]) rounded to BF16.
ATTENTION_BF16 void PairQueryLanes(float* transposed, int64_t head_size, int64_t lanes,
                                   uint32_t* pairs) {
  if (head_size % 2 != 0) std::fill_n(transposed + head_size * kFlashQueryTile, lanes, 0.0f);
  for (int64_t i = 0; 2 * i < head_size; ++i) {
    const float* even = transposed + 2 * i * kFlashQueryTile;
    for (int64_t lane = 0; lane < lanes; lane += 16) {
      _mm512_storeu_si512(pairs + i * kFlashQueryTile + lane,
                          PairWords(_mm512_loadu_ps(even + lane),
                                    _mm512_loadu_ps(even + kFlashQueryTile + lane)));
    }
  }
}

}  // namespace attention::internal
