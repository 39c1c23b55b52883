// flash_tile.cc: the fused tile kernel (flash_tile.h), compiled by Highway
// once per vector path: AVX-512 (HWY_AVX3), AVX2 (HWY_AVX2) and the portable
// path (the compiler's baseline target, any x86-64). FlashTileKernelFor picks
// among them.
#include "core/flash_tile.h"

#include <cstddef>
#include <cstdint>
#include <limits>

// SSSE3 and SSE4 would only lengthen the build: every x86-64 CPU sold this
// decade has AVX2, and the portable path covers the rest.
#ifndef HWY_DISABLED_TARGETS
#define HWY_DISABLED_TARGETS (HWY_SSSE3 | HWY_SSE4)
#endif
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "core/flash_tile.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
// Highway's headers come after foreach_target, which re-includes this file per target.
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
  const float* k = t.keys + key * t.key_stride;
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
    V p = hn::Exp(d, hn::Sub(hn::LoadU(d, row), max));
    if (masked) p = hn::IfThenElseZero(hn::Lt(hn::Set(d, static_cast<float>(key + j)), bound), p);
    hn::StoreU(p, d, row);
    sum = hn::Add(sum, p);
  }
  // Lanes with no allowed key yet keep the lowest float as max: the factor
  // is exp(0) = 1 on nothing, or exp(lowest - m') = 0 once a key is allowed.
  const V rescale = hn::Exp(d, hn::Sub(old_max, max));
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
  const float* v = t.values + key * t.value_stride + col;
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
      for (; j < keys; ++j) ScoreKeys<1>(t, key + j, lane, t.scores + j * kFlashQueryTile);
      SoftmaxVector(t, key, keys, lane, masked);
      SoftmaxVector(t, key, keys, lane + n, masked);
      int64_t col = 0;
      for (; col + kBlock <= t.value_size; col += kBlock) {
        AccumulateColumns<kBlock>(t, key, keys, lane, col);
      }
      for (; col < t.value_size; ++col) AccumulateColumns<1>(t, key, keys, lane, col);
    }
  }
}

}  // namespace HWY_NAMESPACE
}  // namespace attention
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace attention {

FlashTileKernel FlashTileKernelFor(Isa isa) {
  switch (isa) {
    case Isa::kAvx512:
#if HWY_TARGETS & HWY_AVX3
      return &N_AVX3::FlashTileImpl;
#endif
      [[fallthrough]];
    case Isa::kAvx2:
#if HWY_TARGETS & HWY_AVX2
      return &N_AVX2::FlashTileImpl;
#endif
      [[fallthrough]];
    case Isa::kPortable:
      break;
  }
  // The baseline every x86-64 runs: HWY_SCALAR with GCC 12.2, EMU128 (SSE2)
  // with Clang.
  return &HWY_STATIC_DISPATCH(FlashTileImpl);
}

}  // namespace attention
#endif  // HWY_ONCE
