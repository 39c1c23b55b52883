// finite.h: the scan for inf and NaN that every request and every answer
// goes through (inputs are refused with their first bad index, answers that
// overflow float32 likewise), so it has to cost a small fraction of the
// smallest attention call.
#pragma once

#include <cstdint>
#include <span>

namespace attention {

// Index of the first element of `data` that is inf or NaN, or -1.
int64_t FirstNonFinite(std::span<const float> data);

}  // namespace attention
