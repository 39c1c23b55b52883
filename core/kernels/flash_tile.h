// flash_tile.h: the fused inner loop of the flash kernel, one build per path.
//
// One query tile (at most kFlashQueryTile rows) meets keys [0, key_end) in
// key tiles of kFlashKeyTile. Queries sit in vector lanes: the tile's queries
// are stored transposed (head_size x kFlashQueryTile), so a key's scores for
// a vector of queries are one FMA per head dimension with the key's
// coordinate broadcast, straight from the row-major keys; the online softmax
// over keys is then element-wise across key rows (no horizontal reductions),
// and P V broadcasts value coordinates from the row-major values the same
// way. Nothing is packed but the query tile, nothing is zero-filled, and the
// tile's scores (kFlashKeyTile x kFlashQueryTile) stay in L1 from the score
// FMAs through exp to the P V FMAs.
//
// The code has no Eigen and one source for every path (Highway, compiled per
// target in flash_tile.cc, chosen through core/kernels/isa_dispatch.h): Eigen built
// with different -m flags in different files would break the one-definition
// rule, and the linker could hand the portable path an AVX-512 copy of an
// inline Eigen function.
#pragma once

#include <cstdint>

#include "core/kernels/cpu_features.h"
#include "core/kernels/float16.h"
#include "core/kernels/packed_weights.h"
#include "core/kernels/tile_sizes.h"

namespace attention {

// A multiple of every path's micro-kernel width (two vectors: 32 lanes on
// AVX-512, 16 on AVX2, 2 or 8 on the portable baseline): lanes the caller
// pads with zeros up to the next multiple of it, and no further.
inline constexpr int64_t kFlashPaddedLanes = 32;

// Lane-major buffers have kFlashQueryTile floats per row, lane r = query row
// r of the tile. Lanes at or past `rows` (up to a multiple of
// kFlashPaddedLanes) are padding: their bound is 0.
struct FlashTile {
  const float* queries_t = nullptr;  // (head_size x lanes): scale * q, transposed
  // Keys and values from key `key_base` on (so that a caller with keys in
  // blocks points at one block per call), row-major, row strides key_stride
  // and value_stride; key j is row j - key_base.
  const float* keys = nullptr;
  const float* key_bias = nullptr;  // [n_k], indexed by key, or null
  const float* values = nullptr;
  int64_t key_base = 0;
  const float* bounds = nullptr;     // [lanes]: allowed keys of each lane, as float
  int64_t key_stride = 0, value_stride = 0;
  int64_t head_size = 0, value_size = 0;
  int64_t rows = 0;                  // live lanes, 1..kFlashQueryTile
  // Keys [key_begin, key_end) are visited. A call with key_begin > 0
  // continues the running max, sum and output of the call that ended there,
  // so a caller can stop between chunks of keys.
  int64_t key_begin = 0;
  int64_t key_end = 0;
  int64_t min_bound = 0;             // keys below it are allowed for every live lane
  // Outputs, lane-major: the unnormalised output (value_size x lanes), the
  // running max of the allowed scores and the sum of exp(s - max).
  float* accumulator_t = nullptr;
  float* row_max = nullptr;
  float* row_sum = nullptr;
  float* scores = nullptr;  // scratch: kFlashKeyTile x lanes
  float* rescale = nullptr; // scratch: lanes
  // The BF16 kernel's keys and values (FlashTilePath::pair_keys and
  // pair_values), paired once for all the query tiles of a FlashAttention
  // call rather than per tile: key j's pairs at key_pairs + j * ((head_size
  // + 1) / 2), the values of keys 2i and 2i + 1 at value_pairs + i *
  // value_size. Indexed from key 0, not key_base; the fp32 kernels read
  // `keys` and `values` instead.
  const uint32_t* key_pairs = nullptr;
  const uint32_t* value_pairs = nullptr;
  // The one-row kernel's keys and values as a 16-bit session holds them
  // (kv_dtype bfloat16 or float16; `keys` and `values` then unused): the
  // same rows and strides in 16-bit elements, widened to float32 in
  // registers as they are loaded, so a decoding step reads half the bytes.
  KvDtype kv_dtype = KvDtype::kFloat32;
  const uint16_t* keys16 = nullptr;
  const uint16_t* values16 = nullptr;
  // Where the keys and values of the rows from key_end on begin (a paged
  // problem's next block, as `keys` and `values` or keys16 and values16
  // are), for the row kernel to prefetch across the block's end; null when
  // the caller reads no further.
  const void* next_keys = nullptr;
  const void* next_values = nullptr;
};

// One path's functions for a query tile, in the order a caller runs them.
struct FlashTilePath {
  // queries_t (head_size x lanes) = scale * Q^T of rows [0, rows) of
  // `queries` (row-major, row stride query_stride); padding lanes, up to a
  // multiple of kFlashPaddedLanes, are zero so their scores stay finite.
  void (*load_queries)(const float* queries, int64_t query_stride, int64_t rows, int64_t head_size,
                       float scale, float* queries_t);
  // Visits the tile's keys [key_begin, key_end) (FlashTile).
  void (*kernel)(const FlashTile& tile);
  // Output rows [0, rows) (row-major, row stride output_stride) = the
  // tile's accumulator / row_sum; and tile.rescale[r] is NaN exactly when
  // row r's output, row_max or row_sum has a value that is not finite or
  // its row_sum is 0 (0 otherwise), so no row is read again to check it.
  void (*store_output)(const FlashTile& tile, float* output, int64_t output_stride);
  // `kernel` for a tile of one row (a decoding step's single token), which
  // `kernel` would compute as a whole group of lanes: queries_t holds
  // scale * q as a row (head_size floats) and accumulator_t the output as a
  // row (value_size floats), row_max[0] and row_sum[0] as for `kernel`;
  // every key visited must be allowed. The caller normalises the output.
  // Null where one-row tiles take `kernel` (the BF16 products). The only
  // function that reads keys16 and values16. A tile may also have up to
  // kFlashQueryTile rows laid out as rows (row r's scale * q at
  // queries_t + r head_size, its output at accumulator_t + r value_size,
  // row_max[r], row_sum[r]) that all visit [key_begin, key_end): each key
  // and value is then read (and widened) once for all of them.
  void (*row_kernel)(const FlashTile& tile) = nullptr;
  // Set where `kernel` takes its keys and values as BF16 pairs (FlashTile's
  // key_pairs and value_pairs), null elsewhere. pair_keys: rows [0, count)
  // of `keys` (row stride `stride`, `width` floats each) as (k[2i],
  // k[2i + 1]) words, (width + 1) / 2 per row, the last one's second half
  // zero for an odd width. pair_values: row i of `pairs` holds the words
  // (v[2i][c], v[2i + 1][c]) for the width columns, the second half zero
  // past `count`. Both round to BF16 (nearest even), the first in the low
  // half.
  void (*pair_keys)(const float* keys, int64_t stride, int64_t count, int64_t width,
                    uint32_t* pairs) = nullptr;
  void (*pair_values)(const float* values, int64_t stride, int64_t count, int64_t width,
                      uint32_t* pairs) = nullptr;
};

// The functions built for `isa`, for a model computing in `precision`: for
// bf16 on the avx512_bf16 path, QK^T and P V in BF16 (queries, keys, P and
// values rounded to BF16 where they enter the products, FP32 accumulation;
// queries_t then holds pairs of head dimensions as 32-bit words, in no more
// floats than the fp32 layout), the fp32 functions on every other path.
FlashTilePath FlashTilePathFor(Isa isa, Precision precision = Precision::kFp32);

// out[i] = in[i] widened from `dtype` (bfloat16 or float16) to float32,
// for i < count, on `isa`'s vectors (F16C's vcvtph2ps for float16 on the
// AVX2 and AVX-512 paths).
void WidenKvRows(Isa isa, KvDtype dtype, const uint16_t* in, int64_t count, float* out);

namespace internal {

// The avx512_bf16 path's BF16 functions (flash_tile_bf16.cc), for CPUs with
// AVX512_BF16 only: the tile kernel, the values' pairing and the query
// tile's (PairQueryLanes takes LoadQueriesImpl's transposed tile, with room
// for one more row of lanes, which an odd head_size's last pair reads as 0).
void FlashTileBf16(const FlashTile& t);
void PairValuesBf16(const float* values, int64_t stride, int64_t count, int64_t width,
                    uint32_t* pairs);
void PairQueryLanes(float* transposed, int64_t head_size, int64_t lanes, uint32_t* pairs);

}  // namespace internal

}  // namespace attention
