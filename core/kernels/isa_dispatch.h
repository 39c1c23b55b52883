// isa_dispatch.h: the one way a kernel built per vector path is called on
// the path ActiveIsa() names (the tile kernel, the packed GEMM, the inf/NaN
// scan).
//
// A kernel source includes this header first, then has Highway compile it
// once per target (foreach_target.h): AVX-512 (HWY_AVX3), AVX2 (HWY_AVX2) and
// the compiler's baseline, which any x86-64 runs (HWY_SCALAR with GCC 12.2,
// EMU128 with Clang). Its HWY_ONCE part then declares one IsaTable per
// function with ISA_TABLE(Function) and calls table.For(isa).
//
// Why not HWY_EXPORT / HWY_DYNAMIC_DISPATCH: their table index is Highway's
// own choice, made once from its CPU detection, while the path here is ours:
// --isa and ATTENTION_ISA may force a lower path than the CPU's (docs/api.md)
// and the tests switch paths at run time (SelectIsa); following them through
// Highway would mean its test hook SetSupportedTargetsForTest, global to every
// Highway user in the process. HWY_EXPORT's table also calls into libhwy,
// which the core uses header-only and the runtime image does not install. So
// the table below holds the same per-target builds HWY_EXPORT would (Highway's
// HWY_CHOOSE_* entries, null where a target was not compiled), indexed by our
// Isa. Highway 1.0.3 has no target with AVX512_BF16, so the avx512_bf16 entry
// is the AVX-512 build (ISA_TABLE), or, for a kernel with a BF16 form
// (ISA_TABLE_WITH_BF16), a function of its own translation unit built with a
// target attribute (core/kernels/packed_gemm_bf16.cc). Nothing is chosen before main
// either: an ifunc resolver
// (target_clones) runs before ThreadSanitizer's runtime and crashed every
// TSan-built binary (f2c56be).
#pragma once

#include <array>

#include "core/kernels/cpu_features.h"

// SSSE3 and SSE4 would only lengthen the build: every x86-64 CPU sold this
// decade has AVX2, and the portable path covers the rest. Read by
// foreach_target.h, so this header comes before it.
#ifndef HWY_DISABLED_TARGETS
#define HWY_DISABLED_TARGETS (HWY_SSSE3 | HWY_SSE4)
#endif

namespace attention {

static_assert(static_cast<int>(Isa::kPortable) == 0 && static_cast<int>(Isa::kAvx2) == 1 &&
              static_cast<int>(Isa::kAvx512) == 2 && static_cast<int>(Isa::kAvx512Bf16) == 3);

// One function's builds, one per path, indexed by Isa; null where the
// compiler built no such target.
template <typename Function>
struct IsaTable {
  std::array<Function, 4> builds;

  // The build for `isa`, or the best lower one built (the portable one
  // always is).
  Function For(Isa isa) const {
    for (int i = static_cast<int>(isa); i > 0; --i) {
      if (builds[i] != nullptr) return builds[i];
    }
    return builds[0];
  }
};

}  // namespace attention

// The IsaTable of FUNCTION, a function defined in every target's namespace
// of a foreach_target source; used in its HWY_ONCE part.
#define ISA_TABLE(FUNCTION) ISA_TABLE_WITH_BF16(FUNCTION, HWY_CHOOSE_AVX3(FUNCTION))

// The same with BF16_FUNCTION, a function of the same type, on the
// avx512_bf16 path.
#define ISA_TABLE_WITH_BF16(FUNCTION, BF16_FUNCTION)                                         \
  ::attention::IsaTable<decltype(&HWY_STATIC_DISPATCH(FUNCTION))> {                          \
    { &HWY_STATIC_DISPATCH(FUNCTION), HWY_CHOOSE_AVX2(FUNCTION), HWY_CHOOSE_AVX3(FUNCTION),  \
      BF16_FUNCTION }                                                                        \
  }
