// tile_sizes.h: the query and key tile sizes that the flash kernel, its
// per-path tile loop and the engine's split into tasks agree on.
#pragma once

#include <cstdint>

namespace attention {

// Query rows the kernel processes together (one tile). Callers splitting a
// problem's rows into tasks use multiples of it.
inline constexpr int64_t kFlashQueryTile = 64;

// Keys per key tile: the tile's scores, 64 x 64 floats (16 KiB), and the
// value rows it reads stay in a 32 KiB L1 next to the accumulator.
inline constexpr int64_t kFlashKeyTile = 64;

}  // namespace attention
