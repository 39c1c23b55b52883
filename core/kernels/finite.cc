// finite.cc: FirstNonFinite, its scan compiled by Highway once per vector
// path (core/kernels/isa_dispatch.h).
#include "core/kernels/finite.h"

#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>

#include "core/kernels/isa_dispatch.h"
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "core/kernels/finite.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
// Highway's headers come after foreach_target, which re-includes this file per target.
#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace attention {
namespace HWY_NAMESPACE {

// A float is inf or NaN exactly when its exponent bits are all ones: an
// integer test with no branch per element, which the compiler vectorises
// for each path's target (plain C++ rather than Highway's operations, so
// the portable path gets the baseline's SSE2 vectors, not one lane).
bool AnyNonFiniteImpl(const float* data, size_t size) {
  constexpr uint32_t kExponent = 0x7f800000u;
  uint32_t all_ones = 0;
  for (size_t i = 0; i < size; ++i) {
    all_ones |= static_cast<uint32_t>((std::bit_cast<uint32_t>(data[i]) & kExponent) == kExponent);
  }
  return all_ones != 0;
}

}  // namespace HWY_NAMESPACE
}  // namespace attention
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace attention {

int64_t FirstNonFinite(std::span<const float> data) {
  static constexpr auto kAnyNonFinite = ISA_TABLE(AnyNonFiniteImpl);
  if (!kAnyNonFinite.For(ActiveIsa())(data.data(), data.size())) return -1;
  for (size_t i = 0; i < data.size(); ++i) {
    if (!std::isfinite(data[i])) return static_cast<int64_t>(i);
  }
  return -1;
}

}  // namespace attention
#endif  // HWY_ONCE
