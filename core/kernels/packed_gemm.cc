// packed_gemm.cc: the packed-panel GEMM (packed_gemm.h), compiled by Highway
// once per vector path (core/kernels/isa_dispatch.h), over fp32 panels and over bf16
// ones widened to FP32 (the avx512_bf16 path's own bf16 kernel:
// packed_gemm_bf16.cc).
#include "core/kernels/packed_gemm.h"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "core/kernels/isa_dispatch.h"
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "core/kernels/packed_gemm.cc"
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

// Accumulators of rows [row, row + R), vectors [v0, v0 + NV) of panel
// `panel`, plus its bias, stored.
template <int R, int NV = kVectors>
HWY_INLINE void StoreTile(const PackedProduct& p, int64_t row, int64_t panel,
                          const V (&acc)[R][NV], int v0 = 0) {
  const D d;
  constexpr size_t kLanes = HWY_LANES(float);
  const float* bias = p.weights->bias(panel) + v0 * kLanes;
  const int64_t column = panel * kPanelWidth + v0 * static_cast<int64_t>(kLanes);
  const int64_t columns =
      std::min<int64_t>(NV * kLanes, p.weights->out_cols() - column);
  for (int r = 0; r < R; ++r) {
    float* out = p.out + (row + r) * p.out_stride + column;
    if (columns == NV * static_cast<int64_t>(kLanes)) {
      for (int v = 0; v < NV; ++v) {
        hn::StoreU(hn::Add(acc[r][v], hn::Load(d, bias + v * kLanes)), d, out + v * kLanes);
      }
    } else if (columns > 0) {
      // The last panel of a width that is not a multiple of kPanelWidth:
      // only its live columns reach the output.
      HWY_ALIGN float tail[kPanelWidth];
      for (int v = 0; v < NV; ++v) {
        hn::Store(hn::Add(acc[r][v], hn::Load(d, bias + v * kLanes)), d, tail + v * kLanes);
      }
      std::copy_n(tail, columns, out);
    }
  }
}

// acc[r] += x[r][k] * wk for the R rows of x, in_stride apart.
template <int R, int NV = kVectors>
HWY_INLINE void AddColumn(const float* x, int64_t in_stride, int64_t k, const V (&wk)[NV],
                          V (&acc)[R][NV]) {
  const D d;
  for (int r = 0; r < R; ++r) {
    const V xr = hn::Set(d, x[r * in_stride + k]);
    for (int v = 0; v < NV; ++v) acc[r][v] = hn::MulAdd(xr, wk[v], acc[r][v]);
  }
}

// Rows [row, row + R) times `weights`, panel `panel`'s in_cols x
// kPanelWidth floats, plus its bias, stored.
template <int R>
HWY_INLINE void PanelTile(const PackedProduct& p, int64_t row, int64_t panel,
                          const float* HWY_RESTRICT weights) {
  const D d;
  constexpr size_t kLanes = HWY_LANES(float);
  V acc[R][kVectors];
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < kVectors; ++v) acc[r][v] = hn::Zero(d);
  }
  const float* x = p.in + row * p.in_stride;
  for (int64_t k = 0; k < p.weights->in_cols(); ++k) {
    V wk[kVectors];
    for (int v = 0; v < kVectors; ++v) wk[v] = hn::Load(d, weights + k * kPanelWidth + v * kLanes);
    AddColumn<R>(x, p.in_stride, k, wk, acc);
  }
  StoreTile<R>(p, row, panel, acc);
}

// The tile of the last `rows` (< kRows) rows of a block.
template <int R>
HWY_INLINE void PanelTileOf(const PackedProduct& p, int64_t row, int64_t rows, int64_t panel,
                            const float* HWY_RESTRICT weights) {
  if constexpr (R > 1) {
    if (rows < R) return PanelTileOf<R - 1>(p, row, rows, panel, weights);
  }
  PanelTile<R>(p, row, panel, weights);
}

// Rows [row_begin, row_end) times one panel's floats.
HWY_INLINE void PanelRows(const PackedProduct& p, int64_t row_begin, int64_t row_end,
                          int64_t panel, const float* HWY_RESTRICT weights) {
  for (int64_t row = row_begin; row < row_end; row += kRows) {
    PanelTileOf<kRows>(p, row, std::min<int64_t>(kRows, row_end - row), panel, weights);
  }
}

// Input rows per widening micro-kernel, and panel vectors per pass of its k
// loop: the accumulators, the widened vectors, the broadcast and the mask
// in registers, and enough accumulators to hide the FMA's latency.
// AVX-512: 8 x 2 + 2 + 2 of 32, the whole panel row at once. AVX2: 4 x 2 +
// 2 + 2 of 16, the panel in two passes (its whole row of 4 vectors with 3
// rows spills: twice as slow); one or two rows take the whole panel row
// (2 x 4 + 4 + 2), since 2 or 4 accumulators would wait on each other.
#if HWY_TARGET == HWY_AVX2
constexpr int kWidenRows = 4;
constexpr int kWidenVectors = 2;
#else
constexpr int kWidenRows = kRows;
constexpr int kWidenVectors = kVectors;
#endif
template <int R>
constexpr int kWidenVectorsFor = R <= 2 ? kVectors : kWidenVectors;
static_assert(kVectors % kWidenVectors == 0);

// Rows [row, row + R) times vectors [v0, v0 + kWidenVectorsFor<R>) of bf16 panel
// `panel`, widened to FP32 as it is read (WidenPanel's two steps per pair
// word, in registers), plus its bias, stored. Each output is summed over k
// in order, as by the fp32 kernel on a widened panel: the same bits.
template <int R>
HWY_INLINE void WideningPanelTile(const PackedProduct& p, int64_t row, int64_t panel, int v0) {
  const D d;
  const hn::RebindToUnsigned<D> du;
  constexpr size_t kLanes = HWY_LANES(float);
  constexpr int NV = kWidenVectorsFor<R>;
  V acc[R][NV];
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < NV; ++v) acc[r][v] = hn::Zero(d);
  }
  const float* x = p.in + row * p.in_stride;
  const uint32_t* pairs = p.weights->bf16_panel(panel) + v0 * kLanes;
  const auto high_half = hn::Set(du, 0xffff0000u);
  const int64_t in_cols = p.weights->in_cols();
  for (int64_t i = 0; 2 * i < in_cols; ++i) {
    V wk[NV];
    for (int v = 0; v < NV; ++v) {
      wk[v] = hn::BitCast(d, hn::ShiftLeft<16>(hn::Load(du, pairs + i * kPanelWidth + v * kLanes)));
    }
    AddColumn<R, NV>(x, p.in_stride, 2 * i, wk, acc);
    if (2 * i + 1 == in_cols) break;
    for (int v = 0; v < NV; ++v) {
      const auto pair = hn::Load(du, pairs + i * kPanelWidth + v * kLanes);
      wk[v] = hn::BitCast(d, hn::And(pair, high_half));
    }
    AddColumn<R, NV>(x, p.in_stride, 2 * i + 1, wk, acc);
  }
  StoreTile<R, NV>(p, row, panel, acc, v0);
}

// Rows [row, row + rows), rows <= R, in passes over the panel's vectors.
template <int R>
HWY_INLINE void WideningPanelTileOf(const PackedProduct& p, int64_t row, int64_t rows,
                                    int64_t panel) {
  if constexpr (R > 1) {
    if (rows < R) return WideningPanelTileOf<R - 1>(p, row, rows, panel);
  }
  for (int v0 = 0; v0 < kVectors; v0 += kWidenVectorsFor<R>) {
    WideningPanelTile<R>(p, row, panel, v0);
  }
}

// Panel outer, rows inner: a panel (in_cols x 128 bytes, 128 KiB at
// in_cols = 1024) stays in L2 while every row group of the block reads it.
void PackedProductImpl(const PackedProduct& p, int64_t row_begin, int64_t row_end,
                       int64_t panel_begin, int64_t panel_end) {
  for (int64_t panel = panel_begin; panel < panel_end; ++panel) {
    PanelRows(p, row_begin, row_end, panel, p.weights->panel(panel));
  }
}

// A bf16 panel widened to the fp32 panel's layout: a pair word's low half
// is W[n][2i] (shifted up, it is that float), its high half W[n][2i + 1]
// (masked, it is that float).
HWY_INLINE void WidenPanel(const PackedWeights& w, int64_t panel, float* HWY_RESTRICT out) {
  const D d;
  const hn::RebindToUnsigned<D> du;
  constexpr size_t kLanes = HWY_LANES(float);
  const uint32_t* pairs = w.bf16_panel(panel);
  const auto high_half = hn::Set(du, 0xffff0000u);
  for (int64_t i = 0; 2 * i < w.in_cols(); ++i) {
    for (size_t v = 0; v < static_cast<size_t>(kVectors); ++v) {
      const auto pair = hn::Load(du, pairs + i * kPanelWidth + v * kLanes);
      hn::Store(hn::BitCast(d, hn::ShiftLeft<16>(pair)), d, out + 2 * i * kPanelWidth + v * kLanes);
      if (2 * i + 1 < w.in_cols()) {
        hn::Store(hn::BitCast(d, hn::And(pair, high_half)), d,
                  out + (2 * i + 1) * kPanelWidth + v * kLanes);
      }
    }
  }
}

// Blocks of fewer rows than this widen in registers: on avx512 and avx2
// below the rows where widening a panel costs less, always on the portable
// path (its one-lane widening of a panel cost more than widening in the k
// loop).
#if HWY_TARGET == HWY_AVX2
constexpr int64_t kWidenInRegistersBelow = 32;
#elif HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
constexpr int64_t kWidenInRegistersBelow = 32;
#else
constexpr int64_t kWidenInRegistersBelow = INT64_MAX;
#endif

// The path of bf16 weights where the CPU lacks AVX512_BF16 (or --isa chose
// a lower path). The inputs stay FP32, so the answer is the fp32 model's on
// the held weights. Given the panels widened once for the whole call
// (PackedProduct::widened), the fp32 kernel reads them. Else each panel is
// widened to FP32 once per block, into a buffer that stays in L2 like an
// fp32 panel, and the fp32 kernel reads it: that costs about 3/rows of the
// block's time (Zen 4), so blocks of few rows widen in registers instead:
// from half the bytes of an fp32 panel, faster than fp32 for a lone row,
// 0-10% slower for more (BENCHMARKS.md, "BF16"). All three sum each output
// in the same order: the same bits.
void WidenedBf16ProductImpl(const PackedProduct& p, int64_t row_begin, int64_t row_end,
                            int64_t panel_begin, int64_t panel_end) {
  if (p.widened != nullptr) {
    const int64_t panel_floats = p.weights->in_cols() * kPanelWidth;
    for (int64_t panel = panel_begin; panel < panel_end; ++panel) {
      PanelRows(p, row_begin, row_end, panel, p.widened + panel * panel_floats);
    }
    return;
  }
  if (row_end - row_begin < kWidenInRegistersBelow) {
    for (int64_t panel = panel_begin; panel < panel_end; ++panel) {
      for (int64_t row = row_begin; row < row_end; row += kWidenRows) {
        WideningPanelTileOf<kWidenRows>(p, row, std::min<int64_t>(kWidenRows, row_end - row),
                                        panel);
      }
    }
    return;
  }
  constexpr size_t kAlignment = 64;  // the panels' own (aligned loads)
  thread_local std::vector<float> buffer;
  buffer.resize(static_cast<size_t>(p.weights->in_cols() * kPanelWidth) +
                kAlignment / sizeof(float));
  float* widened = reinterpret_cast<float*>(
      (reinterpret_cast<uintptr_t>(buffer.data()) + kAlignment - 1) & ~(kAlignment - 1));
  for (int64_t panel = panel_begin; panel < panel_end; ++panel) {
    WidenPanel(*p.weights, panel, widened);
    PanelRows(p, row_begin, row_end, panel, widened);
  }
}

void WidenPanelsImpl(const PackedWeights& weights, int64_t panel_begin, int64_t panel_end,
                     float* widened) {
  for (int64_t panel = panel_begin; panel < panel_end; ++panel) {
    WidenPanel(weights, panel, widened + panel * weights.in_cols() * kPanelWidth);
  }
}

}  // namespace HWY_NAMESPACE
}  // namespace attention
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace attention {

PackedKernel PackedKernelFor(Isa isa, Precision precision) {
  static constexpr auto kPackedProduct = ISA_TABLE(PackedProductImpl);
  static constexpr auto kBf16Product =
      ISA_TABLE_WITH_BF16(WidenedBf16ProductImpl, &internal::Bf16DotProduct);
  return precision == Precision::kBf16 ? kBf16Product.For(isa) : kPackedProduct.For(isa);
}

bool PackedKernelReadsPairs(Isa isa, Precision precision) {
  return PackedKernelFor(isa, precision) == &internal::Bf16DotProduct;
}

bool PackedKernelWidens(Isa isa, Precision precision) {
  return precision == Precision::kBf16 && !PackedKernelReadsPairs(isa, precision);
}

void WidenBf16Panels(Isa isa, const PackedWeights& weights, int64_t panel_begin,
                     int64_t panel_end, float* widened) {
  static constexpr auto kWidenPanels = ISA_TABLE(WidenPanelsImpl);
  kWidenPanels.For(isa)(weights, panel_begin, panel_end, widened);
}

}  // namespace attention
#endif  // HWY_ONCE
