// kv_dtype_test.cc: sessions holding keys and values in 16 bits
// (SessionOpen::kv_dtype, core/kernels/float16.h).
//
// The roundings are IEEE's (nearest even, ties, subnormals, overflow); a
// 16-bit session's blocks take half the pool's bytes, so the pool holds
// twice its rows; and every kernel that reads a session's blocks reads
// them as held: a prompt (the lane kernel over several blocks), then
// one-token steps over more than 2 kMinSplitKeys keys (the one-row kernel,
// split into key ranges and not), with a window and soft-cap (the terms
// kernel), over grouped heads and one head, and a bf16 model (the BF16
// products on avx512_bf16), each against a float64 reference over the same
// rounded keys and values. The error against float64 over the keys and
// values as sent stays within 2x of the rounding's own (the reference over
// the rounded rows, in double). Run once per kernel path (tests/CMakeLists.txt).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "core/engine/engine.h"
#include "core/kernels/float16.h"
#include "core/sessions/session.h"

namespace attention {
namespace {

TEST(KvRounding, BFloat16RoundsToNearestEven) {
  EXPECT_EQ(FloatToBFloat16(1.0f), 0x3f80);
  // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: to the even one, 1.
  EXPECT_EQ(FloatToBFloat16(1.0f + 0x1p-8f), 0x3f80);
  // 1 + 3 * 2^-8 is halfway between 1 + 2^-7 and 1 + 2^-6: to 1 + 2^-6.
  EXPECT_EQ(FloatToBFloat16(1.0f + 3 * 0x1p-8f), 0x3f82);
  EXPECT_EQ(FloatToBFloat16(1.0f + 0x1p-8f + 0x1p-20f), 0x3f81);
  EXPECT_EQ(FloatToBFloat16(-2.0f), 0xc000);
  EXPECT_EQ(FloatToBFloat16(std::numeric_limits<float>::max()), 0x7f80);  // rounds past: inf
  EXPECT_TRUE(std::isnan(BFloat16ToFloat(FloatToBFloat16(std::nanf("")))));
}

TEST(KvRounding, HalfRoundsToNearestEvenWithSubnormalsAndOverflow) {
  EXPECT_EQ(FloatToHalf(1.0f), 0x3c00);
  EXPECT_EQ(FloatToHalf(1.0f + 0x1p-11f), 0x3c00);          // tie to even
  EXPECT_EQ(FloatToHalf(1.0f + 3 * 0x1p-11f), 0x3c02);      // tie to even
  EXPECT_EQ(FloatToHalf(65504.0f), 0x7bff);                 // the largest half
  EXPECT_EQ(FloatToHalf(65519.0f), 0x7bff);                 // below the midpoint
  EXPECT_EQ(FloatToHalf(65520.0f), 0x7c00);                 // rounds past: inf
  EXPECT_EQ(FloatToHalf(-0x1p-24f), 0x8001);                // smallest subnormal
  EXPECT_EQ(FloatToHalf(0x1p-25f), 0x0000);                 // tie to even: 0
  EXPECT_EQ(FloatToHalf(3 * 0x1p-25f), 0x0002);             // tie to even
  EXPECT_EQ(FloatToHalf(0x1p-14f), 0x0400);                 // smallest normal
  // Nearest halves of values between them (ulp 2^-14 at 0.1, 1 at 1234.5,
  // 2^-24 below 2^-14).
  EXPECT_EQ(HalfToFloat(FloatToHalf(0.1f)), 0.0999755859375f);
  EXPECT_EQ(HalfToFloat(FloatToHalf(1234.5f)), 1234.0f);   // tie to even
  EXPECT_EQ(HalfToFloat(FloatToHalf(1235.5f)), 1236.0f);   // tie to even
  EXPECT_EQ(HalfToFloat(FloatToHalf(-3.75f)), -3.75f);
  EXPECT_EQ(HalfToFloat(FloatToHalf(1e-6f)), 17 * 0x1p-24f);
}

TEST(KvRounding, NamesParse) {
  for (KvDtype dtype : {KvDtype::kFloat32, KvDtype::kBfloat16, KvDtype::kFloat16}) {
    EXPECT_EQ(ParseKvDtype(KvDtypeName(dtype)), dtype);
  }
  EXPECT_FALSE(ParseKvDtype("fp16").has_value());
  EXPECT_FALSE(ParseKvDtype("").has_value());
}

std::vector<float> RandomData(std::mt19937& rng, int64_t size) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> data(size);
  for (float& x : data) x = normal(rng);
  return data;
}

// A dot_product self session of rows of kWidth in a pool of exactly four
// float32 blocks of that width holds twice the rows in 16 bits: each
// block takes half the bytes, and a row past them is refused.
TEST(KvPool, SixteenBitSessionsHoldTwiceTheRows) {
  constexpr int64_t kWidth = 32;
  const int64_t block_bytes = kKvBlockRows * kWidth * 4;
  auto model = std::make_shared<const Model>(DotProductModel());
  Engine engine(EngineOptions{.num_threads = 1});
  std::mt19937 rng(3);
  const std::vector<float> row = RandomData(rng, kWidth);
  const SessionStep step{.queries = TensorView{{1, 1, kWidth}, row}};
  for (KvDtype dtype : {KvDtype::kFloat32, KvDtype::kBfloat16, KvDtype::kFloat16}) {
    SCOPED_TRACE(std::string(KvDtypeName(dtype)));
    KvBlockPool pool(4 * block_bytes);
    auto session = Session::Open(model, pool, {.kv_dtype = dtype});
    ASSERT_TRUE(session.ok()) << session.status();
    const auto run = [&] {
      AttentionResult result;
      absl::StatusOr<ValidatedStep> validated = ValidateStep(**session, step);
      if (!validated.ok()) return validated.status();
      engine.RunSteps({&*validated, 1}, {&result, 1});
      return result.status;
    };
    ASSERT_TRUE(run().ok());
    EXPECT_EQ((*session)->held_bytes(), block_bytes * KvDtypeBytes(dtype) / 4);
    const int64_t fits = 4 * kKvBlockRows * 4 / KvDtypeBytes(dtype);
    ASSERT_TRUE(internal::AppendUncomputed(**session, fits - 2, 5).ok());
    ASSERT_TRUE(run().ok());  // the pool's last row
    EXPECT_EQ((*session)->length(), fits);
    EXPECT_EQ(pool.used_bytes(), 4 * block_bytes);
    EXPECT_EQ(run().code(), absl::StatusCode::kResourceExhausted);
  }
}

float Rounded(KvDtype dtype, float x) {
  return dtype == KvDtype::kFloat32 ? x : WidenKv(dtype, RoundKv(dtype, x));
}

// One head's output in double for query q (size d) over keys and values
// [first, bound) of `keys` and `values` (rows of `stride`, from `column`),
// with the soft-cap.
std::vector<double> Reference(const float* q, const std::vector<float>& keys,
                              const std::vector<float>& values, int64_t stride, int64_t column,
                              int64_t d, int64_t first, int64_t bound, double scale,
                              double softcap) {
  std::vector<double> scores(bound - first);
  double max = -std::numeric_limits<double>::infinity();
  for (int64_t j = first; j < bound; ++j) {
    double s = 0;
    for (int64_t c = 0; c < d; ++c) s += double{q[c]} * keys[j * stride + column + c];
    s *= scale;
    if (softcap > 0) s = softcap * std::tanh(s / softcap);
    scores[j - first] = s;
    max = std::max(max, s);
  }
  double sum = 0;
  for (double& s : scores) sum += (s = std::exp(s - max));
  std::vector<double> out(d, 0.0);
  for (int64_t j = first; j < bound; ++j) {
    for (int64_t c = 0; c < d; ++c) {
      out[c] += scores[j - first] / sum * values[j * stride + column + c];
    }
  }
  return out;
}

struct Config {
  int64_t heads, kv_heads;  // 0: 3-D rows
  int64_t window;
  float softcap;
  bool split;
  Precision precision;
};

// A prompt of kPrompt rows, then one-token steps, of a dot_product self
// session holding `dtype`; every output row against the references.
void CheckSession(const Config& config, KvDtype dtype) {
  constexpr int64_t kSize = 40, kPrompt = 2100, kSteps = 3;
  Engine engine(
      EngineOptions{.num_threads = 2, .serial_work = -1, .split_keys = config.split});
  auto dot = std::make_shared<Model>(DotProductModel());
  dot->precision = config.precision;
  std::shared_ptr<const Model> model = dot;
  std::mt19937 rng(17);
  const bool grouped = config.heads > 0;
  const int64_t heads = grouped ? config.heads : 1, kv_heads = grouped ? config.kv_heads : 1;
  const int64_t total = kPrompt + kSteps;
  // Every token's query, key and value rows; 3-D rows are their own keys
  // and values.
  const std::vector<float> queries = RandomData(rng, total * heads * kSize);
  const std::vector<float> keys = grouped ? RandomData(rng, total * kv_heads * kSize) : queries;
  const std::vector<float> values = grouped ? RandomData(rng, total * kv_heads * kSize) : queries;
  std::vector<float> held_keys(keys.size()), held_values(values.size());
  for (size_t i = 0; i < keys.size(); ++i) held_keys[i] = Rounded(dtype, keys[i]);
  for (size_t i = 0; i < values.size(); ++i) held_values[i] = Rounded(dtype, values[i]);
  KvBlockPool pool(int64_t{1} << 30);
  auto session = Session::Open(model, pool,
                               {.memory = SessionMemory::kSelf,
                                .sliding_window = config.window,
                                .softcap = config.softcap,
                                .kv_dtype = dtype});
  ASSERT_TRUE(session.ok()) << session.status();
  const double scale = 1.0 / std::sqrt(static_cast<double>(kSize));
  const double atol = config.precision == Precision::kBf16 ? 2e-2 : 2e-5;
  const double rtol = config.precision == Precision::kBf16 ? 2e-2 : 2e-4;
  double error = 0, rounding = 0;  // largest: output vs sent, held vs sent
  for (int64_t begin = 0; begin < total;) {
    const int64_t n = begin == 0 ? kPrompt : 1;
    const auto rows = [&](const std::vector<float>& all, int64_t h) {
      return std::vector<float>(all.begin() + begin * h * kSize,
                                all.begin() + (begin + n) * h * kSize);
    };
    const std::vector<float> q = rows(queries, heads), k = rows(keys, kv_heads),
                             v = rows(values, kv_heads);
    SessionStep step;
    step.queries = grouped ? TensorView{{1, n, heads, kSize}, q} : TensorView{{1, n, kSize}, q};
    if (grouped) {
      step.keys = TensorView{{1, n, kv_heads, kSize}, k};
      step.values = TensorView{{1, n, kv_heads, kSize}, v};
    }
    auto validated = ValidateStep(**session, step);
    ASSERT_TRUE(validated.ok()) << validated.status();
    AttentionResult result;
    engine.RunSteps({&*validated, 1}, {&result, 1});
    ASSERT_TRUE(result.status.ok()) << result.status;
    for (int64_t i = 0; i < n; ++i) {
      const int64_t t = begin + i;
      const int64_t first = config.window > 0 ? std::max<int64_t>(0, t - config.window + 1) : 0;
      for (int64_t h = 0; h < heads; ++h) {
        const float* query = queries.data() + (t * heads + h) * kSize;
        const int64_t column = (h / (heads / kv_heads)) * kSize, stride = kv_heads * kSize;
        const std::vector<double> want = Reference(query, held_keys, held_values, stride, column,
                                                   kSize, first, t + 1, scale, config.softcap);
        const std::vector<double> sent = Reference(query, keys, values, stride, column, kSize,
                                                   first, t + 1, scale, config.softcap);
        const float* got = result.output.data.data() + (i * heads + h) * kSize;
        for (int64_t c = 0; c < kSize; ++c) {
          ASSERT_NEAR(got[c], want[c], atol + rtol * std::abs(want[c]))
              << "token " << t << " head " << h << " column " << c;
          error = std::max(error, std::abs(got[c] - sent[c]));
          rounding = std::max(rounding, std::abs(want[c] - sent[c]));
        }
      }
    }
    begin += n;
  }
  // The accuracy contract (docs/api.md section 11): within 2x of the
  // rounding's own error, plus float32's for float32 rows.
  if (config.precision == Precision::kFp32) {
    EXPECT_LE(error, 2 * rounding + 1e-5);
  }
}

class KvDtypeSession : public testing::TestWithParam<KvDtype> {};

TEST_P(KvDtypeSession, EveryKernelReadsTheRowsAsHeld) {
  for (const Config& config :
       {Config{0, 0, 0, 0, true, Precision::kFp32}, Config{4, 2, 0, 0, true, Precision::kFp32},
        Config{4, 2, 0, 0, false, Precision::kFp32},
        Config{4, 1, 1500, 5.0f, true, Precision::kFp32},
        Config{4, 2, 0, 0, true, Precision::kBf16}}) {
    SCOPED_TRACE("heads " + std::to_string(config.heads) + " kv " +
                 std::to_string(config.kv_heads) + " window " + std::to_string(config.window) +
                 " split " + std::to_string(config.split) + " bf16 model " +
                 std::to_string(config.precision == Precision::kBf16));
    CheckSession(config, GetParam());
    if (HasFatalFailure()) return;
  }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, KvDtypeSession,
                         testing::Values(KvDtype::kFloat32, KvDtype::kBfloat16, KvDtype::kFloat16),
                         [](const testing::TestParamInfo<KvDtype>& info) {
                           return std::string(KvDtypeName(info.param));
                         });

}  // namespace
}  // namespace attention
