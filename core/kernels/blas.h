// blas.h: the BLAS behind Eigen's large products (projections, the weights
// path), kept to kernels that match this CPU.
//
// OpenBLAS picks its kernels once, when the library loads, from a table of
// CPU models; a model it does not know gets older kernels (Debian's 0.3.21
// runs Haswell kernels on Zen 5 and SSE3 ones on Emerald Rapids). Its only
// override, OPENBLAS_CORETYPE, is read at that moment, before main. So a
// binary linking this file checks, before main, whether the running core
// matches the CPU's features (capped by ATTENTION_ISA), and if not re-executes
// itself once with OPENBLAS_CORETYPE set: avx512 -> SKYLAKEX, avx2 ->
// HASWELL. A caller who sets OPENBLAS_CORETYPE is left alone; the portable
// path leaves OpenBLAS its own choice.
#pragma once

#include <string>

#include "core/kernels/cpu_features.h"

namespace attention {

// Every BLAS call runs on the thread that makes it: OpenBLAS's own threads
// would fight the engine's pool.
void RunBlasOnCallingThread();

// Whether OPENBLAS_CORETYPE was set by whoever started this process (then
// it is obeyed as it is) rather than by the re-exec.
bool BlasCoreForcedByCaller();

// The BLAS kernel family running the projections, as the BLAS names it
// (OpenBLAS: "SkylakeX", "Haswell", ...), or "none" if no BLAS is linked.
std::string BlasCoreName();

// Whether OpenBLAS core `core` runs the kernels of path `isa` ("Haswell" and
// "Zen" for avx2; "SkylakeX", "Cooperlake", "SapphireRapids" for avx512).
// Always true for portable, which makes no demand on the BLAS.
bool BlasCoreMatches(Isa isa, std::string_view core);

}  // namespace attention
