// packed_gemm_test.cc: the packed projection GEMM (core/kernels/packed_gemm.h)
// against a double-precision reference, over fp32 and bf16 weights, on the
// path ATTENTION_ISA selects (ctest runs it once per path:
// core_packed_gemm_test/<isa>; on a host with AVX512_BF16, the avx512 run is
// the bf16 fallback that widens the weights to FP32).
#include "core/kernels/packed_gemm.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "core/model/model.h"

namespace attention {
namespace {

struct Shape {
  int64_t rows, out_cols, in_cols;
};

std::vector<float> Random(int64_t count, std::mt19937& rng) {
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<float> data(count);
  for (float& x : data) x = dist(rng);
  return data;
}

// Rows `rows` of in W^T + b in double, in_stride floats between input rows.
std::vector<double> Reference(const std::vector<float>& in, int64_t in_stride,
                              const std::vector<float>& weight, const float* bias,
                              const Shape& s) {
  std::vector<double> out(s.rows * s.out_cols);
  for (int64_t r = 0; r < s.rows; ++r) {
    for (int64_t n = 0; n < s.out_cols; ++n) {
      double sum = bias != nullptr ? bias[n] : 0.0;
      for (int64_t k = 0; k < s.in_cols; ++k) {
        sum += static_cast<double>(in[r * in_stride + k]) * weight[n * s.in_cols + k];
      }
      out[r * s.out_cols + n] = sum;
    }
  }
  return out;
}

// Runs the whole product on the active path in blocks of `row_block` rows
// and `panel_block` panels, as the engine's tasks do.
void RunBlocks(const PackedProduct& product, int64_t rows, int64_t row_block,
               int64_t panel_block) {
  const PackedKernel kernel = PackedKernelFor(ActiveIsa(), product.weights->precision());
  const int64_t panels = product.weights->panels();
  for (int64_t row = 0; row < rows; row += row_block) {
    for (int64_t panel = 0; panel < panels; panel += panel_block) {
      kernel(product, row, std::min(rows, row + row_block), panel,
             std::min(panels, panel + panel_block));
    }
  }
}

// float accumulation over in_cols terms of size <= 1: error grows ~sqrt(K).
double Tolerance(int64_t in_cols) { return 1e-5 * (1.0 + std::sqrt(static_cast<double>(in_cols))) * 4; }

// Odd shapes: none of M, N, K a multiple of a path's tile (8 or 3 rows,
// 32 columns), and the edges M = 1, K = 1, N = 1.
const Shape kShapes[] = {{1, 1, 1},    {1, 33, 1},   {1, 3072 - 5, 17}, {7, 45, 13},
                         {9, 97, 65},  {17, 64, 1},  {25, 31, 129},     {64, 96, 256},
                         {3, 200, 300}, {11, 1, 513}};

// `values` as the BF16 product reads them: rounded to the nearest BF16.
std::vector<float> RoundedToBf16(std::vector<float> values) {
  for (float& x : values) x = Bf16ToFloat(RoundToBf16(x));
  return values;
}

TEST(PackedGemmTest, RoundsToNearestEvenBf16) {
  EXPECT_EQ(RoundToBf16(1.0f), 0x3f80);
  EXPECT_EQ(Bf16ToFloat(RoundToBf16(1.0f + 1.0f / 256)), 1.0f);  // a tie, to even
  EXPECT_EQ(Bf16ToFloat(RoundToBf16(1.0f + 3.0f / 256)), 1.0f + 4.0f / 256);  // a tie, to even
  EXPECT_EQ(Bf16ToFloat(RoundToBf16(-3.0f)), -3.0f);
  EXPECT_EQ(Bf16ToFloat(RoundToBf16(1.0f + 1.5f / 256)), 1.0f + 2.0f / 256);
}

// Each pair word is the two floats rounded one by one (RoundToBf16), the
// first in the low half, an odd row's last high half zero, and nothing past
// a row's words written: at widths below, at and past whole vectors of 32.
TEST(PackedGemmTest, RoundsInputPairsAsEachFloatAlone) {
  if (DetectedIsa() < Isa::kAvx512Bf16) GTEST_SKIP() << "rounds with AVX512_BF16 only";
  std::mt19937 rng(32);
  for (const int64_t width : {1, 7, 16, 31, 32, 33, 64, 67, 96, 255}) {
    SCOPED_TRACE("width " + std::to_string(width));
    constexpr int64_t kRows = 3;
    constexpr uint32_t kUnwritten = 0x5a5a5a5a;
    const int64_t stride = width + 5, words = (width + 1) / 2;
    const std::vector<float> in = Random(kRows * stride, rng);
    std::vector<uint32_t> pairs(kRows * words + 1, kUnwritten);
    internal::RoundToBf16Pairs(in.data(), stride, kRows, width, pairs.data());
    for (int64_t r = 0; r < kRows; ++r) {
      for (int64_t i = 0; i < words; ++i) {
        const float* x = in.data() + r * stride + 2 * i;
        const uint32_t high = 2 * i + 1 < width ? RoundToBf16(x[1]) : 0;
        ASSERT_EQ(pairs[r * words + i], high << 16 | RoundToBf16(x[0]))
            << "row " << r << " word " << i;
      }
    }
    EXPECT_EQ(pairs.back(), kUnwritten);
  }
}

TEST(PackedGemmTest, UnpackGivesBackTheWeightsAsHeld) {
  std::mt19937 rng(3);
  const Shape s{1, 45, 13};
  const std::vector<float> weight = Random(s.out_cols * s.in_cols, rng);
  const std::vector<float> bias = Random(s.out_cols, rng);
  for (Precision precision : {Precision::kFp32, Precision::kBf16}) {
    const PackedWeights packed =
        PackedWeights::Pack(weight.data(), s.out_cols, s.in_cols, bias.data(), precision);
    std::vector<float> unpacked(weight.size()), unpacked_bias(bias.size());
    packed.Unpack(unpacked.data(), unpacked_bias.data());
    EXPECT_EQ(unpacked, precision == Precision::kFp32 ? weight : RoundedToBf16(weight));
    EXPECT_EQ(unpacked_bias, bias);
  }
  const std::vector<float> wide = Random(64 * 13, rng);
  EXPECT_LT(PackedWeights::Pack(wide.data(), 64, 13, nullptr, Precision::kBf16).bytes(),
            PackedWeights::Pack(wide.data(), 64, 13, nullptr).bytes() * 6 / 10);
}

class PackedGemmPrecisionTest : public ::testing::TestWithParam<Precision> {};

// bf16 weights are held rounded; the inputs are rounded too on the
// avx512_bf16 path, where they enter vdpbf16ps, and read as they are on the
// others. Products accumulate in FP32 either way, so the tolerance is fp32's
// against a reference over the same rounded operands.
TEST_P(PackedGemmPrecisionTest, MatchesDoubleReferenceWithAndWithoutBias) {
  const Precision precision = GetParam();
  const bool rounds_inputs = precision == Precision::kBf16 && ActiveIsa() == Isa::kAvx512Bf16;
  std::mt19937 rng(7);
  for (const Shape& s : kShapes) {
    for (bool with_bias : {false, true}) {
      SCOPED_TRACE("M=" + std::to_string(s.rows) + " N=" + std::to_string(s.out_cols) +
                   " K=" + std::to_string(s.in_cols) + " bias=" + std::to_string(with_bias));
      // Strides wider than the rows, as the engine's Q|K|V output has: the
      // columns between must be left alone.
      const int64_t in_stride = s.in_cols + 3, out_stride = s.out_cols + 5;
      const std::vector<float> in = Random(s.rows * in_stride, rng);
      const std::vector<float> weight = Random(s.out_cols * s.in_cols, rng);
      const std::vector<float> bias = Random(s.out_cols, rng);
      const float* b = with_bias ? bias.data() : nullptr;
      const PackedWeights packed =
          PackedWeights::Pack(weight.data(), s.out_cols, s.in_cols, b, precision);
      ASSERT_EQ(packed.out_cols(), s.out_cols);
      ASSERT_EQ(packed.in_cols(), s.in_cols);
      constexpr float kUntouched = 12345.0f;
      std::vector<float> out(s.rows * out_stride, kUntouched);
      RunBlocks({in.data(), in_stride, out.data(), out_stride, &packed}, s.rows, 5, 2);
      const std::vector<double> expected =
          Reference(rounds_inputs ? RoundedToBf16(in) : in, in_stride,
                    precision == Precision::kBf16 ? RoundedToBf16(weight) : weight, b, s);
      for (int64_t r = 0; r < s.rows; ++r) {
        for (int64_t n = 0; n < s.out_cols; ++n) {
          ASSERT_NEAR(out[r * out_stride + n], expected[r * s.out_cols + n], Tolerance(s.in_cols))
              << "row " << r << " column " << n;
        }
        for (int64_t n = s.out_cols; n < out_stride; ++n) {
          ASSERT_EQ(out[r * out_stride + n], kUntouched) << "row " << r << " column " << n;
        }
      }
    }
  }
}

// A block's rows choose its kernel (a bf16 block of few rows widens the
// panel in registers, in tiles of 1 to 8 rows and one or two passes over
// the panel's vectors; a larger one widens it into a buffer first), but
// every output is summed over k in order: the same bits for any block,
// which batching relies on (a request's answer is the same alone and in a
// batch).
TEST_P(PackedGemmPrecisionTest, BlockRowsDoNotChangeTheBits) {
  const Precision precision = GetParam();
  std::mt19937 rng(11);
  // 100 columns: the last panel holds 4, so a pass over its second half
  // stores nothing.
  const Shape s{100, 100, 67};
  const std::vector<float> in = Random(s.rows * s.in_cols, rng);
  const std::vector<float> weight = Random(s.out_cols * s.in_cols, rng);
  const std::vector<float> bias = Random(s.out_cols, rng);
  const PackedWeights packed =
      PackedWeights::Pack(weight.data(), s.out_cols, s.in_cols, bias.data(), precision);
  const auto run = [&](int64_t row_block) {
    std::vector<float> out(s.rows * s.out_cols);
    RunBlocks({in.data(), s.in_cols, out.data(), s.out_cols, &packed}, s.rows, row_block, 1);
    return out;
  };
  const std::vector<float> whole = run(s.rows);
  for (int64_t row_block : {1, 2, 3, 4, 5, 7, 8, 9, 16, 31, 32, 33, 64}) {
    const std::vector<float> blocks = run(row_block);
    for (size_t i = 0; i < whole.size(); ++i) {
      ASSERT_EQ(blocks[i], whole[i]) << "blocks of " << row_block << " rows, row "
                                     << i / s.out_cols << " column " << i % s.out_cols;
    }
  }
}

// A product given its input's pairs (PackedProduct::in_pairs) reads them on
// the path whose kernel multiplies pairs, so pairs rounded from other rows
// give those rows' product, bit for bit; on the other paths it reads `in`
// and is given words it must not read.
TEST_P(PackedGemmPrecisionTest, ReadsGivenInputPairsOnlyWhereItMultipliesPairs) {
  const Precision precision = GetParam();
  const bool reads_pairs = PackedKernelReadsPairs(ActiveIsa(), precision);
  EXPECT_EQ(reads_pairs, precision == Precision::kBf16 && ActiveIsa() == Isa::kAvx512Bf16);
  std::mt19937 rng(11);
  const Shape s{200, 97, 65};
  const std::vector<float> in = Random(s.rows * s.in_cols, rng);
  const std::vector<float> other = Random(s.rows * s.in_cols, rng);
  const std::vector<float> weight = Random(s.out_cols * s.in_cols, rng);
  const PackedWeights packed =
      PackedWeights::Pack(weight.data(), s.out_cols, s.in_cols, nullptr, precision);
  std::vector<uint32_t> pairs(s.rows * packed.k_pairs(), 0xffffffffu);
  if (reads_pairs) {
    internal::RoundToBf16Pairs(other.data(), s.in_cols, s.rows, s.in_cols, pairs.data());
  }
  std::vector<float> given(s.rows * s.out_cols), expected(s.rows * s.out_cols);
  RunBlocks({in.data(), s.in_cols, given.data(), s.out_cols, &packed, pairs.data()}, s.rows, 96,
            2);
  RunBlocks({reads_pairs ? other.data() : in.data(), s.in_cols, expected.data(), s.out_cols,
             &packed},
            s.rows, 96, 2);
  EXPECT_EQ(given, expected);
}

INSTANTIATE_TEST_SUITE_P(Precisions, PackedGemmPrecisionTest,
                         ::testing::Values(Precision::kFp32, Precision::kBf16),
                         [](const auto& info) {
                           return std::string(PrecisionName(info.param));
                         });

}  // namespace
}  // namespace attention
