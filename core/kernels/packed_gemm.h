// packed_gemm.h: the projection product out = in W^T + b with W packed once.
//
// A BLAS packs both operands for every call; for a projection the weights
// are the same on every call, and when the rows are few (a batch of decoding
// tokens: 1-64 rows against 3E x E weights) repacking them costs as much as
// the arithmetic. Here the weights are packed once, when the model is
// loaded, into the panels the micro-kernel reads: kPanelWidth output columns
// at a time, each panel in_cols x kPanelWidth, row k holding W[n][k] for the
// panel's n, so every step of the kernel's k loop loads one contiguous,
// aligned panel row and broadcasts one input value per row (the layout:
// core/kernels/packed_weights.h). The bias is packed beside the panels and added as
// the results are stored, and the input rows are read where they are (no
// copy; the BF16 products read them rounded, below).
//
// One Highway source (packed_gemm.cc) builds the kernel per path, like
// flash_tile.cc, for fp32 panels and for bf16 ones widened to FP32; the
// avx512_bf16 path's bf16 kernel multiplies in BF16 with vdpbf16ps
// (packed_gemm_bf16.cc), on its input rows rounded to BF16 pairs: given by
// the caller (PackedProduct::in_pairs: RunProjections, core/engine/projection.cc,
// rounds each input row once for all the products and blocks of a call),
// or else rounded by the kernel once per 96-row chunk of each call.
// PackedKernelFor picks one (core/kernels/isa_dispatch.h). The engine runs every
// packed projection on it, on every path: a model holds its projection
// weights only packed (core/model/model.h). On the avx512 and avx2 paths it
// measured as fast as the BLAS or faster (BENCHMARKS.md, "Projections").
#pragma once

#include <cstdint>

#include "core/kernels/cpu_features.h"
#include "core/kernels/packed_weights.h"

namespace attention {

// out[r][0, out_cols) = in[r] W^T + b for rows r of `rows`.
struct PackedProduct {
  const float* in = nullptr;
  int64_t in_stride = 0;  // floats between input rows, >= in_cols
  float* out = nullptr;
  int64_t out_stride = 0;  // floats between output rows, >= out_cols
  const PackedWeights* weights = nullptr;
  // Null, or rows of `in` already rounded to BF16 pairs (internal::
  // RoundToBf16Pairs, weights->k_pairs() words a row), which a kernel that
  // reads pairs (PackedKernelReadsPairs) reads instead of rounding `in`.
  const uint32_t* in_pairs = nullptr;
  // Null, or bf16 weights' panels already widened to FP32 (WidenBf16Panels:
  // panel p at widened + p * in_cols * kPanelWidth, 64-byte aligned), which
  // a kernel that widens (PackedKernelWidens) reads instead of widening its
  // own.
  const float* widened = nullptr;
};

// Computes rows [row_begin, row_end) of the product, output columns of
// panels [panel_begin, panel_end) only: the unit of work a thread takes.
using PackedKernel = void (*)(const PackedProduct& product, int64_t row_begin, int64_t row_end,
                              int64_t panel_begin, int64_t panel_end);

// The kernel built for `isa` over weights packed in `precision`.
PackedKernel PackedKernelFor(Isa isa, Precision precision = Precision::kFp32);

// Whether that kernel multiplies BF16 pairs of its input, and so reads
// PackedProduct::in_pairs where given: the avx512_bf16 path's bf16 kernel.
bool PackedKernelReadsPairs(Isa isa, Precision precision);

// Whether that kernel widens bf16 weights to FP32 (every path's bf16
// kernel but avx512_bf16's), and so reads PackedProduct::widened where given.
bool PackedKernelWidens(Isa isa, Precision precision);

// Panels [panel_begin, panel_end) of bf16 `weights` widened to FP32 in the
// fp32 panels' layout, panel p at widened + p * in_cols * kPanelWidth
// (`widened` 64-byte aligned), with the loads and stores of path `isa`.
void WidenBf16Panels(Isa isa, const PackedWeights& weights, int64_t panel_begin,
                     int64_t panel_end, float* widened);

namespace internal {

// The avx512_bf16 path's kernel over bf16 panels: each block's input rows
// rounded to BF16 (nearest even) once, or read from in_pairs, products in
// BF16 pairs with FP32 accumulation (vdpbf16ps). Only for a CPU with
// AVX512_BF16.
void Bf16DotProduct(const PackedProduct& product, int64_t row_begin, int64_t row_end,
                    int64_t panel_begin, int64_t panel_end);

// Rows [0, count) of `rows` (row stride `stride`, `width` floats each)
// rounded to BF16 (nearest even) as pairs (x[2i], x[2i + 1]) in 32-bit words,
// the first in the low half, (width + 1) / 2 words per row, the last one's
// second half zero for an odd width: the form vdpbf16ps reads, for the
// inputs of Bf16DotProduct and the BF16 tile kernel's keys
// (FlashTilePath::pair_keys). Only for a CPU with AVX512_BF16.
void RoundToBf16Pairs(const float* rows, int64_t stride, int64_t count, int64_t width,
                      uint32_t* pairs);

}  // namespace internal
}  // namespace attention
