// flash_tile_test.cc: the active path's query-tile and output transposes
// (core/kernels/flash_tile.h) against their scalar definitions, bit for bit, over
// tile heights and widths on both sides of every path's block size, with
// padded strides; run once per path by ctest (ATTENTION_ISA).
#include "core/kernels/flash_tile.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

namespace attention {
namespace {

// Written into cells a function must not touch.
constexpr float kUntouched = 12345.0f;
// Extra floats at the end of every row: strides wider than the rows.
constexpr int64_t kPad = 3;

const int64_t kRows[] = {1, 3, 4, 8, 15, 16, 17, 31, 32, 33, 48, 63, 64};
const int64_t kWidths[] = {1, 3, 4, 7, 8, 16, 17, 32, 33, 64, 70};

std::vector<float> RandomFloats(int64_t count, std::mt19937& rng) {
  std::uniform_real_distribution<float> uniform(-4.0f, 4.0f);
  std::vector<float> data(count);
  for (float& x : data) x = uniform(rng);
  return data;
}

int64_t PaddedLanes(int64_t rows) {
  return (rows + kFlashPaddedLanes - 1) / kFlashPaddedLanes * kFlashPaddedLanes;
}

TEST(FlashTilePathTest, LoadQueriesIsScaledTransposeWithZeroPadding) {
  const FlashTilePath path = FlashTilePathFor(ActiveIsa());
  std::mt19937 rng(20261124);
  const float scale = 0.37f;
  for (int64_t rows : kRows) {
    for (int64_t head_size : kWidths) {
      const int64_t stride = head_size + kPad;
      const std::vector<float> queries = RandomFloats(rows * stride, rng);
      std::vector<float> queries_t(head_size * kFlashQueryTile, kUntouched);
      path.load_queries(queries.data(), stride, rows, head_size, scale, queries_t.data());
      for (int64_t c = 0; c < head_size; ++c) {
        for (int64_t lane = 0; lane < kFlashQueryTile; ++lane) {
          const float expected = lane < rows ? queries[lane * stride + c] * scale
                                 : lane < PaddedLanes(rows) ? 0.0f
                                                            : kUntouched;
          ASSERT_EQ(queries_t[c * kFlashQueryTile + lane], expected)
              << "rows=" << rows << " head_size=" << head_size << " column " << c << " lane "
              << lane;
        }
      }
    }
  }
}

// A tile whose accumulator (value_size x lanes) and row sums are set; the
// kernel itself plays no part.
struct StoredTile {
  std::vector<float> accumulator, row_max, row_sum, probe;
  FlashTile tile;

  StoredTile(int64_t rows, int64_t value_size, std::mt19937& rng)
      : accumulator(RandomFloats(value_size * kFlashQueryTile, rng)),
        row_max(RandomFloats(kFlashQueryTile, rng)),
        row_sum(kFlashQueryTile),
        probe(kFlashQueryTile, kUntouched) {
    std::uniform_real_distribution<float> sums(1.0f, 40.0f);
    for (float& s : row_sum) s = sums(rng);
    tile.rows = rows;
    tile.value_size = value_size;
    tile.accumulator_t = accumulator.data();
    tile.row_max = row_max.data();
    tile.row_sum = row_sum.data();
    tile.rescale = probe.data();
  }
  float& At(int64_t column, int64_t lane) { return accumulator[column * kFlashQueryTile + lane]; }
};

TEST(FlashTilePathTest, StoreOutputWritesNormalisedRowsAndNothingElse) {
  const FlashTilePath path = FlashTilePathFor(ActiveIsa());
  std::mt19937 rng(7);
  for (int64_t rows : kRows) {
    for (int64_t value_size : kWidths) {
      StoredTile t(rows, value_size, rng);
      const int64_t stride = value_size + kPad;
      // One row more than the tile's, which must stay untouched too.
      std::vector<float> output((rows + 1) * stride, kUntouched);
      path.store_output(t.tile, output.data(), stride);
      for (int64_t r = 0; r <= rows; ++r) {
        for (int64_t c = 0; c < stride; ++c) {
          const float expected = r < rows && c < value_size ? t.At(c, r) * (1.0f / t.row_sum[r])
                                                            : kUntouched;
          ASSERT_EQ(output[r * stride + c], expected)
              << "rows=" << rows << " value_size=" << value_size << " row " << r << " column "
              << c;
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        ASSERT_EQ(t.probe[r], 0.0f)
            << "rows=" << rows << " value_size=" << value_size << " row " << r;
      }
    }
  }
}

// The probe is NaN exactly on the rows with an entry that is not finite
// (one stored as +-inf or NaN, or a finite one whose normalised value
// overflows; at columns and rows spread over full blocks and remainders), a
// max or sum that is not finite, or a zero sum.
TEST(FlashTilePathTest, StoreOutputProbesEveryNonFiniteRow) {
  const FlashTilePath path = FlashTilePathFor(ActiveIsa());
  const float inf = std::numeric_limits<float>::infinity();
  const float kinds[] = {inf, -inf, std::numeric_limits<float>::quiet_NaN(),
                         std::numeric_limits<float>::max()};
  std::mt19937 rng(11);
  for (int64_t rows : {17, 33, 64}) {
    for (int64_t value_size : {5, 16, 37}) {
      StoredTile t(rows, value_size, rng);
      // Every third row gets one bad entry, at a column that moves with it.
      for (int64_t r = 0; r < rows; r += 3) {
        const float kind = kinds[(r / 3) % 4];
        t.At((r * 7) % value_size, r) = kind;
        if (kind == std::numeric_limits<float>::max()) t.row_sum[r] = 0.5f;  // max / 0.5 overflows
      }
      // Rows 1, 4 and 7 (every third row is bad above): a row's max or sum.
      t.row_max[1] = -inf;
      t.row_sum[4] = 0.0f;
      t.row_sum[7] = inf;
      std::vector<float> output(rows * value_size);
      path.store_output(t.tile, output.data(), value_size);
      for (int64_t r = 0; r < rows; ++r) {
        if (r % 3 == 0 || r == 1 || r == 4 || r == 7) {
          EXPECT_TRUE(std::isnan(t.probe[r]))
              << "rows=" << rows << " value_size=" << value_size << " row " << r;
        } else {
          EXPECT_EQ(t.probe[r], 0.0f)
              << "rows=" << rows << " value_size=" << value_size << " row " << r;
        }
      }
    }
  }
}

}  // namespace
}  // namespace attention
