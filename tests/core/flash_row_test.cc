// flash_row_test.cc: the active path's one-row kernel
// (FlashTilePath::row_kernel, core/kernels/flash_tile.h) over keys and
// values held in float32, bfloat16 and float16, against a float64
// reference over the rows as held: groups of 1 to 8 rows (a grouped-query
// group goes through the kernel together), head and value sizes on both
// sides of every path's vectors, key counts on both sides of a key tile and
// of the kernels' batches of keys, key biases,
// and keys visited in two calls as a paged problem's blocks are (the second
// continuing the first's max, sum and output, the first told where the
// next block begins). Run once per path by ctest (ATTENTION_ISA).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "core/kernels/flash_tile.h"

namespace attention {
namespace {

// One row kernel problem: rows queries over `keys` keys, keys and values
// held as `dtype` (row strides wider than the rows).
struct RowProblem {
  KvDtype dtype;
  int64_t rows, head_size, value_size, keys;
  bool bias;
};

// Elements of the held rows, as stored and as float.
struct HeldRows {
  std::vector<float> floats;
  std::vector<uint16_t> bits;
};

HeldRows Hold(KvDtype dtype, const std::vector<float>& sent) {
  HeldRows held{sent, std::vector<uint16_t>(sent.size())};
  for (size_t i = 0; i < sent.size(); ++i) {
    if (dtype == KvDtype::kBfloat16) {
      held.bits[i] = FloatToBFloat16(sent[i]);
      held.floats[i] = BFloat16ToFloat(held.bits[i]);
    } else if (dtype == KvDtype::kFloat16) {
      held.bits[i] = FloatToHalf(sent[i]);
      held.floats[i] = HalfToFloat(held.bits[i]);
    }
  }
  return held;
}

std::vector<float> Uniform(std::mt19937& rng, int64_t count) {
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  std::vector<float> data(count);
  for (float& x : data) x = uniform(rng);
  return data;
}

// A problem's data: scale * q per row, keys and values as held (row strides
// wider than the rows), key biases.
struct RowData {
  int64_t key_stride, value_stride;
  std::vector<float> queries;
  HeldRows keys, values;
  std::vector<float> bias;
};

RowData MakeData(const RowProblem& p, std::mt19937& rng) {
  RowData data;
  data.key_stride = p.head_size + 5;
  data.value_stride = p.value_size + 3;
  const double scale = 1.0 / std::sqrt(static_cast<double>(p.head_size));
  data.queries = Uniform(rng, p.rows * p.head_size);
  for (float& q : data.queries) q = static_cast<float>(q * scale);
  data.keys = Hold(p.dtype, Uniform(rng, p.keys * data.key_stride));
  data.values = Hold(p.dtype, Uniform(rng, p.keys * data.value_stride));
  data.bias = Uniform(rng, p.keys);
  return data;
}

// The row kernel's normalised outputs (rows x value_size), its keys visited
// in calls [0, split) and [split, keys), each pointed at its own first key
// as a paged problem's blocks are.
std::vector<float> RunRowKernel(const RowProblem& p, const RowData& data, int64_t split) {
  std::vector<float> accumulator(p.rows * p.value_size), row_max(p.rows), row_sum(p.rows);
  std::vector<float> scores(kFlashKeyTile * kFlashQueryTile), rescale(kFlashQueryTile);
  std::vector<float> bounds(kFlashQueryTile, static_cast<float>(p.keys));
  FlashTile tile;
  tile.queries_t = data.queries.data();
  tile.key_bias = p.bias ? data.bias.data() : nullptr;
  tile.bounds = bounds.data();
  tile.key_stride = data.key_stride;
  tile.value_stride = data.value_stride;
  tile.head_size = p.head_size;
  tile.value_size = p.value_size;
  tile.rows = p.rows;
  tile.accumulator_t = accumulator.data();
  tile.row_max = row_max.data();
  tile.row_sum = row_sum.data();
  tile.scores = scores.data();
  tile.rescale = rescale.data();
  tile.kv_dtype = p.dtype;
  const bool wide = p.dtype == KvDtype::kFloat32;
  const auto point_at = [&](int64_t first, const void** k, const void** v) {
    *k = wide ? static_cast<const void*>(data.keys.floats.data() + first * data.key_stride)
              : data.keys.bits.data() + first * data.key_stride;
    *v = wide ? static_cast<const void*>(data.values.floats.data() + first * data.value_stride)
              : data.values.bits.data() + first * data.value_stride;
  };
  const FlashTilePath path = FlashTilePathFor(ActiveIsa());
  for (const auto& [begin, end] : {std::pair{int64_t{0}, split}, std::pair{split, p.keys}}) {
    if (begin == end) continue;
    const void *k, *v;
    point_at(begin, &k, &v);
    tile.keys = static_cast<const float*>(k);
    tile.values = static_cast<const float*>(v);
    tile.keys16 = static_cast<const uint16_t*>(k);
    tile.values16 = static_cast<const uint16_t*>(v);
    tile.key_base = tile.key_begin = begin;
    tile.key_end = end;
    tile.next_keys = tile.next_values = nullptr;
    if (end < p.keys) point_at(end, &tile.next_keys, &tile.next_values);
    path.row_kernel(tile);
  }
  for (int64_t r = 0; r < p.rows; ++r) {
    for (int64_t c = 0; c < p.value_size; ++c) accumulator[r * p.value_size + c] /= row_sum[r];
  }
  return accumulator;
}

// softmax(q k^T + bias) v in float64 over the rows as held, rows x value_size.
std::vector<double> Reference(const RowProblem& p, const RowData& data) {
  std::vector<double> out(p.rows * p.value_size);
  for (int64_t r = 0; r < p.rows; ++r) {
    std::vector<double> weights(p.keys);
    for (int64_t j = 0; j < p.keys; ++j) {
      double dot = p.bias ? data.bias[j] : 0.0;
      for (int64_t c = 0; c < p.head_size; ++c) {
        dot += double{data.queries[r * p.head_size + c]} *
               data.keys.floats[j * data.key_stride + c];
      }
      weights[j] = dot;
    }
    const double max = *std::max_element(weights.begin(), weights.end());
    double sum = 0;
    for (double& w : weights) sum += (w = std::exp(w - max));
    for (int64_t c = 0; c < p.value_size; ++c) {
      double total = 0;
      for (int64_t j = 0; j < p.keys; ++j) {
        total += weights[j] * data.values.floats[j * data.value_stride + c];
      }
      out[r * p.value_size + c] = total / sum;
    }
  }
  return out;
}

// The largest error of the kernel's outputs against float64.
double RowKernelError(const RowProblem& p, int64_t split, std::mt19937& rng) {
  const RowData data = MakeData(p, rng);
  const std::vector<float> got = RunRowKernel(p, data, split);
  const std::vector<double> want = Reference(p, data);
  double error = 0;
  for (size_t i = 0; i < got.size(); ++i) error = std::max(error, std::abs(got[i] - want[i]));
  return error;
}

// Outputs are averages of values in [-1, 1]: float32's rounding stays far
// below 1e-5, while a key or column out of place, or a query or weight
// rounded to 16 bits, costs more than 1e-4.
constexpr double kTolerance = 1e-5;

class FlashRowKernel : public testing::TestWithParam<KvDtype> {};

TEST_P(FlashRowKernel, MatchesFloat64OverTheRowsAsHeld) {
  std::mt19937 rng(29);
  for (int64_t rows : {1, 2, 3, 4, 5, 8}) {
    for (int64_t head_size : {1, 7, 16, 33, 40, 64, 80, 128, 257}) {
      for (int64_t keys : {1, 5, 17, 64, 100, 301}) {
        const RowProblem p{GetParam(), rows, head_size, head_size == 40 ? 24 : head_size, keys,
                           keys % 2 == 1};
        for (int64_t split : {keys, keys / 2, keys / 64 * 64}) {
          SCOPED_TRACE("rows " + std::to_string(rows) + " head_size " +
                       std::to_string(head_size) + " keys " + std::to_string(keys) +
                       " split " + std::to_string(split) + " bias " + std::to_string(p.bias));
          ASSERT_LE(RowKernelError(p, split, rng), kTolerance);
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, FlashRowKernel,
                         testing::Values(KvDtype::kFloat32, KvDtype::kBfloat16, KvDtype::kFloat16),
                         [](const testing::TestParamInfo<KvDtype>& info) {
                           return std::string(KvDtypeName(info.param));
                         });

}  // namespace
}  // namespace attention
