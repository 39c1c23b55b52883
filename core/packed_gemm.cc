// packed_gemm.cc: the packed-panel GEMM (packed_gemm.h), compiled by Highway
// once per vector path (core/isa_dispatch.h).
#include "core/packed_gemm.h"

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "core/isa_dispatch.h"
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "core/packed_gemm.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
// Highway's headers come after foreach_target, which re-includes this file per target.
#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace attention {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

using D = hn::ScalableTag<float>;
using V = hn::Vec<D>;

// Vectors per panel row, and input rows per micro-kernel: the kernel holds
// kRows x kVectors accumulators, kVectors panel vectors and a broadcast:
// 16 + 2 + 1 of AVX-512's 32 registers, 12 + 4 + 1 of AVX2's 16. Per k step
// that is kVectors + kRows loads for kRows x kVectors FMAs, so both FMA
// ports stay busy with the panel row in L1.
constexpr int kVectors = static_cast<int>(kPanelWidth / HWY_LANES(float));
#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
constexpr int kRows = 8;
#elif HWY_TARGET == HWY_AVX2
constexpr int kRows = 3;
#else
constexpr int kRows = 1;
#endif
static_assert(kVectors * HWY_LANES(float) == kPanelWidth);

// Rows [row, row + R) times panel `panel`, plus its bias, stored.
template <int R>
HWY_INLINE void PanelTile(const PackedProduct& p, int64_t row, int64_t panel) {
  const D d;
  constexpr size_t kLanes = HWY_LANES(float);
  const PackedWeights& w = *p.weights;
  V acc[R][kVectors];
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < kVectors; ++v) acc[r][v] = hn::Zero(d);
  }
  const float* x = p.in + row * p.in_stride;
  const float* weights = w.panel(panel);
  for (int64_t k = 0; k < w.in_cols(); ++k) {
    V wk[kVectors];
    for (int v = 0; v < kVectors; ++v) wk[v] = hn::Load(d, weights + k * kPanelWidth + v * kLanes);
    for (int r = 0; r < R; ++r) {
      const V xr = hn::Set(d, x[r * p.in_stride + k]);
      for (int v = 0; v < kVectors; ++v) acc[r][v] = hn::MulAdd(xr, wk[v], acc[r][v]);
    }
  }
  const float* bias = w.bias(panel);
  const int64_t column = panel * kPanelWidth;
  const int64_t columns = std::min(kPanelWidth, w.out_cols() - column);
  for (int r = 0; r < R; ++r) {
    float* out = p.out + (row + r) * p.out_stride + column;
    if (columns == kPanelWidth) {
      for (int v = 0; v < kVectors; ++v) {
        hn::StoreU(hn::Add(acc[r][v], hn::Load(d, bias + v * kLanes)), d, out + v * kLanes);
      }
    } else {
      // The last panel of a width that is not a multiple of kPanelWidth:
      // only its live columns reach the output.
      HWY_ALIGN float tail[kPanelWidth];
      for (int v = 0; v < kVectors; ++v) {
        hn::Store(hn::Add(acc[r][v], hn::Load(d, bias + v * kLanes)), d, tail + v * kLanes);
      }
      std::copy_n(tail, columns, out);
    }
  }
}

// PanelTile for the last `rows` (< kRows) rows of a block.
template <int R>
HWY_INLINE void PanelTileOf(const PackedProduct& p, int64_t row, int64_t rows, int64_t panel) {
  if constexpr (R > 1) {
    if (rows < R) return PanelTileOf<R - 1>(p, row, rows, panel);
  }
  PanelTile<R>(p, row, panel);
}

// Panel outer, rows inner: a panel (in_cols x 128 bytes, 128 KiB at
// in_cols = 1024) stays in L2 while every row group of the block reads it.
void PackedProductImpl(const PackedProduct& p, int64_t row_begin, int64_t row_end,
                       int64_t panel_begin, int64_t panel_end) {
  for (int64_t panel = panel_begin; panel < panel_end; ++panel) {
    for (int64_t row = row_begin; row < row_end; row += kRows) {
      PanelTileOf<kRows>(p, row, std::min<int64_t>(kRows, row_end - row), panel);
    }
  }
}

}  // namespace HWY_NAMESPACE
}  // namespace attention
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace attention {

PackedKernel PackedKernelFor(Isa isa) {
  static constexpr auto kPackedProduct = ISA_TABLE(PackedProductImpl);
  return kPackedProduct.For(isa);
}

}  // namespace attention
#endif  // HWY_ONCE
