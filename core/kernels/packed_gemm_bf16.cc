// packed_gemm_bf16.cc: the packed GEMM over bf16 panels on the avx512_bf16
// path (packed_gemm.h): vdpbf16ps multiplies a pair of BF16 inputs by a pair
// of BF16 weights per FP32 lane and adds both products to it, twice the
// multiply-adds of an FP32 FMA per instruction.
//
// Highway 1.0.3 has no target with AVX512_BF16, so this file holds the one
// kernel written with intrinsics. The target attribute is on each function,
// not a -m flag on the file: an inline function of a header built here with
// AVX-512 could otherwise be the copy the linker keeps for every caller.
// core/kernels/isa_dispatch.h calls it only where CPUID reports AVX512_BF16.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "core/kernels/packed_gemm.h"

#define ATTENTION_BF16_TARGET \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))

namespace attention::internal {
namespace {

// Input rows per micro-kernel: 8 x 2 accumulators, the 2 panel vectors and
// a broadcast, 19 of the 32 registers (as the fp32 kernel on avx512).
constexpr int kRows = 8;
// Input rows rounded to BF16 at a time: the engine's row block.
constexpr int64_t kConvertRows = 96;

// A mask of the first n (<= 16) lanes.
ATTENTION_BF16_TARGET inline __mmask16 FirstLanes(int64_t n) {
  return static_cast<__mmask16>((1u << std::clamp<int64_t>(n, 0, 16)) - 1u);
}

// Rows [0, R) of `words` (input rows from `row`) times panel `panel`, plus
// its bias, stored.
template <int R>
ATTENTION_BF16_TARGET inline void PanelTile(const PackedProduct& p, const uint32_t* words,
                                            int64_t row, int64_t panel) {
  const int64_t pairs = p.weights->k_pairs();
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  const uint32_t* weights = p.weights->bf16_panel(panel);
  for (int64_t i = 0; i < pairs; ++i) {
    const __m512bh w0 = reinterpret_cast<__m512bh>(_mm512_load_si512(weights + i * kPanelWidth));
    const __m512bh w1 =
        reinterpret_cast<__m512bh>(_mm512_load_si512(weights + i * kPanelWidth + 16));
    for (int r = 0; r < R; ++r) {
      const __m512bh x =
          reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(words[r * pairs + i])));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], x, w0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], x, w1);
    }
  }
  const float* bias = p.weights->bias(panel);
  const __m512 bias0 = _mm512_load_ps(bias), bias1 = _mm512_load_ps(bias + 16);
  const int64_t column = panel * kPanelWidth;
  const int64_t columns = std::min(kPanelWidth, p.weights->out_cols() - column);
  const __mmask16 mask0 = FirstLanes(columns), mask1 = FirstLanes(columns - 16);
  for (int r = 0; r < R; ++r) {
    float* out = p.out + (row + r) * p.out_stride + column;
    _mm512_mask_storeu_ps(out, mask0, _mm512_add_ps(acc[r][0], bias0));
    _mm512_mask_storeu_ps(out + 16, mask1, _mm512_add_ps(acc[r][1], bias1));
  }
}

// PanelTile for the last `rows` (< kRows) rows of a block.
template <int R>
ATTENTION_BF16_TARGET inline void PanelTileOf(const PackedProduct& p, const uint32_t* words,
                                              int64_t row, int64_t rows, int64_t panel) {
  if constexpr (R > 1) {
    if (rows < R) return PanelTileOf<R - 1>(p, words, row, rows, panel);
  }
  PanelTile<R>(p, words, row, panel);
}

// The 32 floats `low` then `high` rounded to BF16, in order: 16 pair words.
ATTENTION_BF16_TARGET inline __m512i PairWords(__m512 low, __m512 high) {
  // The second operand gives the lower 16 BF16 values.
  return reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(high, low));
}

// The last `left` (< 32) floats of a row from `x` into pair words at `out`.
ATTENTION_BF16_TARGET inline void RoundRowEnd(const float* x, int64_t left, uint32_t* out) {
  const __m512 low = _mm512_maskz_loadu_ps(FirstLanes(left), x);
  const __m512 high = _mm512_maskz_loadu_ps(FirstLanes(left - 16), x + 16);
  _mm512_mask_storeu_epi32(out, FirstLanes((left + 1) / 2), PairWords(low, high));
}

}  // namespace

// Whole vectors load and store without masks, which on Zen 4 cost a quarter
// of the rounding's time in cache (a third at widths of a few vectors).
ATTENTION_BF16_TARGET void RoundToBf16Pairs(const float* rows, int64_t stride, int64_t count,
                                            int64_t width, uint32_t* pairs) {
  const int64_t words = (width + 1) / 2;
  for (int64_t row = 0; row < count; ++row) {
    const float* x = rows + row * stride;
    uint32_t* out = pairs + row * words;
    int64_t k = 0;
    for (; k + 32 <= width; k += 32) {
      _mm512_storeu_si512(out + k / 2,
                          PairWords(_mm512_loadu_ps(x + k), _mm512_loadu_ps(x + k + 16)));
    }
    if (k < width) RoundRowEnd(x + k, width - k, out + k / 2);
  }
}

// Rows in chunks of kConvertRows, each rounded once (or, given the input's
// pairs, read from them) and then, panel outer and rows inner as in the fp32
// kernel, read by every panel of the block.
ATTENTION_BF16_TARGET void Bf16DotProduct(const PackedProduct& p, int64_t row_begin,
                                          int64_t row_end, int64_t panel_begin,
                                          int64_t panel_end) {
  thread_local std::vector<uint32_t> rounded;
  const int64_t pairs = p.weights->k_pairs();
  for (int64_t chunk = row_begin; chunk < row_end; chunk += kConvertRows) {
    const int64_t chunk_end = std::min(row_end, chunk + kConvertRows);
    const uint32_t* words = p.in_pairs != nullptr ? p.in_pairs + chunk * pairs : nullptr;
    if (words == nullptr) {
      rounded.resize(static_cast<size_t>((chunk_end - chunk) * pairs));
      RoundToBf16Pairs(p.in + chunk * p.in_stride, p.in_stride, chunk_end - chunk,
                       p.weights->in_cols(), rounded.data());
      words = rounded.data();
    }
    for (int64_t panel = panel_begin; panel < panel_end; ++panel) {
      for (int64_t row = chunk; row < chunk_end; row += kRows) {
        PanelTileOf<kRows>(p, words + (row - chunk) * pairs, row,
                           std::min<int64_t>(kRows, chunk_end - row), panel);
      }
    }
  }
}

}  // namespace attention::internal
