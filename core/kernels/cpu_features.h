// cpu_features.h: which vector code path the kernels run, chosen at startup.
//
// One binary runs on any x86-64 host: the fused kernels are built for every
// path (flash_tile.cc) and the best one the CPU supports is used, read from
// CPUID, with nothing to set. A lower path can be forced for tests and
// comparisons (SelectIsa, or ATTENTION_ISA through SelectIsaFromEnvironment);
// asking for a path the CPU lacks is an error.
//
//   avx512_bf16  avx512 plus AVX512_BF16 (vdpbf16ps): bf16 models' products
//                in BF16 (docs/api.md, "Precision"); everything else as avx512
//   avx512    AVX-512 F, BW, VL and DQ (the OS saving ZMM state)
//   avx2      AVX2 and FMA (the OS saving YMM state)
//   portable  any x86-64 (SSE2), one lane at a time
#pragma once

#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace attention {

// Ordered: a path runs on every CPU that runs a later one.
enum class Isa { kPortable, kAvx2, kAvx512, kAvx512Bf16 };

// "portable", "avx2", "avx512", "avx512_bf16".
std::string_view IsaName(Isa isa);

// The inverse of IsaName; INVALID_ARGUMENT naming the accepted values.
absl::StatusOr<Isa> ParseIsa(std::string_view name);

// The best path this CPU supports.
Isa DetectedIsa();

// Makes `isa` the path the kernels run from now on (all threads).
// FAILED_PRECONDITION, naming what the CPU supports, if it lacks `isa`.
absl::Status SelectIsa(Isa isa);

// The path the kernels run: DetectedIsa() unless SelectIsa chose another.
Isa ActiveIsa();

// Applies ATTENTION_ISA (one of IsaName's values) if set and not empty:
// the error of ParseIsa or SelectIsa otherwise, naming the variable.
absl::Status SelectIsaFromEnvironment();

}  // namespace attention
