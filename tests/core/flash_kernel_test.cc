// flash_kernel_test.cc: the fused kernel against a naive reference of
// docs/api.md (scores, disallowed -> -1e6, softmax with max subtraction, weighted
// sum), over shapes, every mask form, biases, strides and split row ranges.
#include "core/kernels/flash_kernel.h"

#include "core/kernels/cpu_features.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <span>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace attention {
namespace {

constexpr double kAbsTolerance = 1e-5;
constexpr double kRelTolerance = 1e-4;
// Written into output and weight cells the kernel must not touch.
constexpr float kUntouched = 12345.0f;

enum class Mask { kNone, kPerExample, kPerQuery };

struct Case {
  int64_t num_queries = 1, num_keys = 1, head_size = 1, value_size = 1;
  Mask mask = Mask::kNone;
  int32_t valid_len = 0;  // kPerExample
  bool causal = false;
  bool query_bias = false, key_bias = false;
  int64_t pad = 0;  // extra floats at the end of every row (strides > width)
  float scale = 1.0f;

  std::string Describe() const {
    std::ostringstream out;
    out << "n_q=" << num_queries << " n_k=" << num_keys << " d=" << head_size
        << " d_v=" << value_size << " mask=" << static_cast<int>(mask) << " valid_len=" << valid_len
        << " causal=" << causal << " query_bias=" << query_bias << " key_bias=" << key_bias
        << " pad=" << pad;
    return out.str();
  }
};

// Owns the inputs of one problem, row-major with row stride width + pad.
struct Inputs {
  Case c;
  std::vector<float> queries, keys, values, query_bias, key_bias;
  std::vector<int32_t> valid_lens;

  int64_t QueryStride() const { return c.head_size + c.pad; }
  int64_t KeyStride() const { return c.head_size + c.pad; }
  int64_t ValueStride() const { return c.value_size + c.pad; }
  int64_t OutputStride() const { return c.value_size + c.pad; }
  int64_t WeightsStride() const { return c.num_keys + c.pad; }

  FlashProblem Problem(float* output) const {
    FlashProblem p;
    p.queries = queries.data();
    p.keys = keys.data();
    p.values = values.data();
    p.output = output;
    p.query_stride = QueryStride();
    p.key_stride = KeyStride();
    p.value_stride = ValueStride();
    p.output_stride = OutputStride();
    p.num_queries = c.num_queries;
    p.num_keys = c.num_keys;
    p.head_size = c.head_size;
    p.value_size = c.value_size;
    p.scale = c.scale;
    p.query_bias = c.query_bias ? query_bias.data() : nullptr;
    p.key_bias = c.key_bias ? key_bias.data() : nullptr;
    if (c.mask == Mask::kPerExample) p.bounds.valid_len = c.valid_len;
    if (c.mask == Mask::kPerQuery) p.bounds.valid_lens = valid_lens.data();
    p.bounds.causal = c.causal;
    return p;
  }
};

std::vector<float> Uniform(std::mt19937& rng, int64_t count, float lo, float hi) {
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> out(count);
  for (float& x : out) x = dist(rng);
  return out;
}

Inputs RandomInputs(const Case& c, std::mt19937& rng) {
  Inputs in{c, {}, {}, {}, {}, {}, {}};
  in.queries = Uniform(rng, c.num_queries * in.QueryStride(), -1.0f, 1.0f);
  in.keys = Uniform(rng, c.num_keys * in.KeyStride(), -1.0f, 1.0f);
  in.values = Uniform(rng, c.num_keys * in.ValueStride(), -1.0f, 1.0f);
  in.query_bias = Uniform(rng, c.num_queries, -2.0f, 2.0f);
  in.key_bias = Uniform(rng, c.num_keys, -2.0f, 2.0f);
  std::uniform_int_distribution<int32_t> len(0, static_cast<int32_t>(c.num_keys) + 3);
  in.valid_lens.resize(c.num_queries);
  for (int32_t& l : in.valid_lens) l = len(rng);
  return in;
}

// Replaces queries and keys by integers in [-max_abs, max_abs]: with scale 1
// and integer biases every score is then exact in float.
void IntegerQueriesAndKeys(Inputs& in, int max_abs, std::mt19937& rng) {
  std::uniform_int_distribution<int> digit(-max_abs, max_abs);
  for (float& x : in.queries) x = static_cast<float>(digit(rng));
  for (float& x : in.keys) x = static_cast<float>(digit(rng));
}

// docs/api.md, literally, in double: (n_q x n_k) weights and (n_q x d_v) output.
struct Reference {
  std::vector<double> weights, output;
  std::vector<bool> allowed;  // (n_q x n_k)
};

Reference NaiveAttention(const Inputs& in) {
  const Case& c = in.c;
  Reference ref;
  ref.weights.assign(c.num_queries * c.num_keys, 0.0);
  ref.output.assign(c.num_queries * c.value_size, 0.0);
  ref.allowed.assign(c.num_queries * c.num_keys, false);
  for (int64_t i = 0; i < c.num_queries; ++i) {
    double* w = &ref.weights[i * c.num_keys];
    for (int64_t j = 0; j < c.num_keys; ++j) {
      bool allowed = true;
      if (c.mask == Mask::kPerExample) allowed = j < c.valid_len;
      if (c.mask == Mask::kPerQuery) allowed = j < in.valid_lens[i];
      if (c.causal && j > i) allowed = false;
      ref.allowed[i * c.num_keys + j] = allowed;
      if (!allowed) {
        w[j] = -1e6;
        continue;
      }
      double dot = 0.0;
      for (int64_t t = 0; t < c.head_size; ++t) {
        dot += static_cast<double>(in.queries[i * in.QueryStride() + t]) *
               in.keys[j * in.KeyStride() + t];
      }
      w[j] = c.scale * dot + (c.query_bias ? in.query_bias[i] : 0.0) +
             (c.key_bias ? in.key_bias[j] : 0.0);
    }
    const double max = *std::max_element(w, w + c.num_keys);
    double sum = 0.0;
    for (int64_t j = 0; j < c.num_keys; ++j) sum += (w[j] = std::exp(w[j] - max));
    for (int64_t j = 0; j < c.num_keys; ++j) {
      w[j] /= sum;
      for (int64_t t = 0; t < c.value_size; ++t) {
        ref.output[i * c.value_size + t] += w[j] * in.values[j * in.ValueStride() + t];
      }
    }
  }
  return ref;
}

bool Close(double actual, double expected) {
  return std::abs(actual - expected) <= kAbsTolerance + kRelTolerance * std::abs(expected);
}

// Compares a (rows x cols) float matrix with row stride `stride` to a dense
// reference; cells [cols, stride) of each row and rows outside [begin, end)
// must still hold kUntouched. Reports the first mismatch only.
void ExpectMatrix(const std::vector<float>& actual, int64_t stride, const std::vector<double>& expected,
                  int64_t rows, int64_t cols, int64_t begin, int64_t end, const char* what) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < stride; ++c) {
      const float a = actual[r * stride + c];
      if (c >= cols || r < begin || r >= end) {
        ASSERT_EQ(a, kUntouched) << what << " wrote outside its rows/columns at (" << r << ", " << c
                                 << ")";
        continue;
      }
      const double e = expected[r * cols + c];
      ASSERT_TRUE(Close(a, e)) << what << "(" << r << ", " << c << ") = " << a << ", expected " << e;
    }
  }
}

// Runs both kernel entry points on [0, split) and [split, n_q) and checks
// output and weights against the reference.
void CheckCase(const Inputs& in, int64_t split) {
  SCOPED_TRACE(in.c.Describe() + " split=" + std::to_string(split));
  const Case& c = in.c;
  const Reference ref = NaiveAttention(in);

  std::vector<float> flash_out(c.num_queries * in.OutputStride(), kUntouched);
  const FlashProblem flash = in.Problem(flash_out.data());
  FlashAttention(flash, 0, split);
  ExpectMatrix(flash_out, in.OutputStride(), ref.output, c.num_queries, c.value_size, 0, split,
               "FlashAttention output of the first range");
  FlashAttention(flash, split, c.num_queries);
  ExpectMatrix(flash_out, in.OutputStride(), ref.output, c.num_queries, c.value_size, 0,
               c.num_queries, "FlashAttention output");

  std::vector<float> out(c.num_queries * in.OutputStride(), kUntouched);
  std::vector<float> weights(c.num_queries * in.WeightsStride(), kUntouched);
  const FlashProblem with_weights = in.Problem(out.data());
  AttentionWithWeights(with_weights, 0, split, weights.data(), in.WeightsStride());
  AttentionWithWeights(with_weights, split, c.num_queries, weights.data(), in.WeightsStride());
  ExpectMatrix(out, in.OutputStride(), ref.output, c.num_queries, c.value_size, 0, c.num_queries,
               "AttentionWithWeights output");
  ExpectMatrix(weights, in.WeightsStride(), ref.weights, c.num_queries, c.num_keys, 0,
               c.num_queries, "AttentionWithWeights weights");
  for (int64_t i = 0; i < c.num_queries; ++i) {
    for (int64_t j = 0; j < c.num_keys; ++j) {
      // A disallowed key far below the row max weighs exactly 0.
      if (!ref.allowed[i * c.num_keys + j] && ref.weights[i * c.num_keys + j] == 0.0) {
        ASSERT_EQ(weights[i * in.WeightsStride() + j], 0.0f) << "weight (" << i << ", " << j << ")";
      }
    }
    for (int64_t t = 0; t < c.value_size; ++t) {
      const int64_t at = i * in.OutputStride() + t;
      ASSERT_NEAR(out[at], flash_out[at], kAbsTolerance) << "paths disagree at (" << i << ", " << t << ")";
    }
  }
}

TEST(KeyBoundsTest, IsMinOfValidLenKeysAndCausalLimit) {
  std::vector<int32_t> lens = {0, 2, 9, 4};
  constexpr int64_t kKeys = 5;
  KeyBounds b;
  EXPECT_EQ(b.Allowed(0, kKeys), 5);  // no mask
  b.valid_len = 3;
  EXPECT_EQ(b.Allowed(2, kKeys), 3);
  b.valid_len = 7;  // beyond n_k masks nothing
  EXPECT_EQ(b.Allowed(2, kKeys), 5);
  b.valid_len = 0;
  EXPECT_EQ(b.Allowed(3, kKeys), 0);
  b.valid_lens = lens.data();  // per query wins over valid_len
  EXPECT_EQ(b.Allowed(1, kKeys), 2);
  EXPECT_EQ(b.Allowed(2, kKeys), 5);
  b.causal = true;
  EXPECT_EQ(b.Allowed(2, kKeys), 3);
  EXPECT_EQ(b.Allowed(3, kKeys), 4);
  EXPECT_EQ(b.Allowed(0, kKeys), 0);
}

// Every (n_q, n_k) pair of sizes, with head and value sizes, mask form, causal
// flag, biases, padding and the row split drawn per pair from a fixed seed.
// A case of n_q queries and n_k keys under `mask`, its sizes drawn from
// `sizes`, its valid length, causal flag, biases and padding from `rng`.
Case DrawCase(std::mt19937& rng, const std::vector<int64_t>& sizes, int64_t n_q, int64_t n_k,
              Mask mask) {
  std::uniform_int_distribution<size_t> pick_size(0, sizes.size() - 1);
  std::uniform_int_distribution<int> coin(0, 1);
  Case c;
  c.num_queries = n_q;
  c.num_keys = n_k;
  c.head_size = sizes[pick_size(rng)];
  c.value_size = sizes[pick_size(rng)];
  c.mask = mask;
  const int32_t lens[] = {0, 1, static_cast<int32_t>(n_k / 2), static_cast<int32_t>(n_k),
                          static_cast<int32_t>(n_k) + 5};
  c.valid_len = lens[std::uniform_int_distribution<int>(0, 4)(rng)];
  c.causal = coin(rng) == 1;
  c.query_bias = coin(rng) == 1;
  c.key_bias = coin(rng) == 1;
  c.pad = coin(rng) == 1 ? 3 : 0;
  c.scale = 1.0f / std::sqrt(static_cast<float>(c.head_size));
  return c;
}

TEST(FlashKernelTest, MatchesReferenceAcrossShapesAndMasks) {
  const std::vector<int64_t> sizes = {1, 2, 3, 7, 17, 64, 65, 129};
  std::mt19937 rng(20240611);
  for (int64_t n_q : sizes) {
    for (int64_t n_k : sizes) {
      for (Mask mask : {Mask::kNone, Mask::kPerExample, Mask::kPerQuery}) {
        const Inputs in = RandomInputs(DrawCase(rng, sizes, n_q, n_k, mask), rng);
        CheckCase(in, std::uniform_int_distribution<int64_t>(0, n_q)(rng));
        if (HasFatalFailure()) return;
      }
    }
  }
}

// A bf16 problem: QK^T and P V in BF16 on the avx512_bf16 path, so its
// output is the reference's to BF16's rounding of queries, keys, P and
// values (relative 2^-9 each; 2e-2 covers scores up to about 4 in
// magnitude); on every other path it is the fp32 kernel's output exactly.
TEST(FlashKernelTest, Bf16ProblemsMatchTheReferenceToBf16Rounding) {
  const std::vector<int64_t> sizes = {1, 2, 7, 17, 64, 65, 129};
  std::mt19937 rng(26);
  bool some_output_differs = false;
  for (int64_t n_q : sizes) {
    for (int64_t n_k : sizes) {
      for (Mask mask : {Mask::kNone, Mask::kPerExample, Mask::kPerQuery}) {
        const Case c = DrawCase(rng, sizes, n_q, n_k, mask);
        const Inputs in = RandomInputs(c, rng);
        SCOPED_TRACE(c.Describe());
        const Reference ref = NaiveAttention(in);
        std::vector<float> fp32(c.num_queries * in.OutputStride(), kUntouched);
        std::vector<float> bf16 = fp32;
        ASSERT_TRUE(FlashAttention(in.Problem(fp32.data()), 0, n_q));
        FlashProblem problem = in.Problem(bf16.data());
        problem.precision = Precision::kBf16;
        ASSERT_TRUE(FlashAttention(problem, 0, n_q));
        if (ActiveIsa() != Isa::kAvx512Bf16) {
          ASSERT_EQ(bf16, fp32);
          continue;
        }
        for (int64_t i = 0; i < n_q; ++i) {
          for (int64_t t = 0; t < in.OutputStride(); ++t) {
            const float out = bf16[i * in.OutputStride() + t];
            if (t >= c.value_size) {
              ASSERT_EQ(out, kUntouched) << "(" << i << ", " << t << ")";
              continue;
            }
            const double expected = ref.output[i * c.value_size + t];
            ASSERT_NEAR(out, expected, 2e-2 + 2e-2 * std::abs(expected))
                << "(" << i << ", " << t << ")";
            some_output_differs |= out != fp32[i * in.OutputStride() + t];
          }
        }
      }
    }
  }
  if (ActiveIsa() == Isa::kAvx512Bf16) {
    EXPECT_TRUE(some_output_differs) << "the bf16 problems ran in FP32";
  }
}

// Long rows cross several key tiles, and query tiles end mid-range.
TEST(FlashKernelTest, MatchesReferenceOverManyTiles) {
  std::mt19937 rng(7);
  for (bool causal : {false, true}) {
    for (Mask mask : {Mask::kNone, Mask::kPerExample, Mask::kPerQuery}) {
      const Case c{.num_queries = 300, .num_keys = 777, .head_size = 64, .value_size = 33,
                   .mask = mask, .valid_len = 600, .causal = causal, .key_bias = true, .pad = 5,
                   .scale = 0.125f};
      CheckCase(RandomInputs(c, rng), 131);
      if (HasFatalFailure()) return;
    }
  }
}

// Causal with more queries than keys (rows past n_k see every key) and fewer.
TEST(FlashKernelTest, CausalWithUnequalQueryAndKeyCounts) {
  std::mt19937 rng(11);
  for (auto [n_q, n_k] : {std::pair<int64_t, int64_t>{130, 17}, {17, 130}, {1, 300}, {300, 1}}) {
    const Case c{.num_queries = n_q, .num_keys = n_k, .head_size = 8, .value_size = 5,
                 .causal = true, .scale = 0.5f};
    CheckCase(RandomInputs(c, rng), n_q / 2);
    if (HasFatalFailure()) return;
  }
}

// Integer data with scale 1: scores are exact integers up to about +-150,
// which overflow exp() unless the row max is subtracted.
TEST(FlashKernelTest, LargeScoresDoNotOverflow) {
  std::mt19937 rng(3);
  const Case c{.num_queries = 70, .num_keys = 300, .head_size = 17, .value_size = 9,
               .mask = Mask::kPerQuery};
  Inputs in = RandomInputs(c, rng);
  IntegerQueriesAndKeys(in, 3, rng);
  const Reference ref = NaiveAttention(in);
  EXPECT_GT(*std::max_element(ref.weights.begin(), ref.weights.end()), 0.99)
      << "the case should have dominant scores";
  CheckCase(in, 33);
}

// Allowed scores near or below -1e6, so disallowed keys (score -1e6) carry
// weight in docs/api.md. Scores are exact in float: -1e6 plus a query or
// key bias plus small integers.
TEST(FlashKernelTest, AllowedScoresNearMaskedScoreKeepMaskedWeight) {
  std::mt19937 rng(5);
  for (float offset : {-1e6f, -1e6f - 4.0f, -1e6f + 40.0f, -1e6f + 200.0f, -3e6f}) {
    for (bool on_query : {true, false}) {
      const Case c{.num_queries = 67, .num_keys = 290, .head_size = 3, .value_size = 4,
                   .mask = Mask::kPerQuery, .causal = true, .query_bias = on_query,
                   .key_bias = !on_query};
      Inputs in = RandomInputs(c, rng);
      IntegerQueriesAndKeys(in, 2, rng);
      std::fill(in.query_bias.begin(), in.query_bias.end(), offset);
      std::fill(in.key_bias.begin(), in.key_bias.end(), offset);
      SCOPED_TRACE("offset=" + std::to_string(offset));
      CheckCase(in, 64);
      if (HasFatalFailure()) return;
    }
  }
}

// The same hazard from the dot product itself: q = (1000, a), k = (-1000, b)
// gives s = -1e6 + a b exactly.
TEST(FlashKernelTest, DotProductNearMaskedScore) {
  std::mt19937 rng(9);
  std::uniform_int_distribution<int> digit(-3, 3);
  const Case c{.num_queries = 5, .num_keys = 40, .head_size = 2, .value_size = 3,
               .mask = Mask::kPerExample, .valid_len = 20};
  Inputs in = RandomInputs(c, rng);
  for (int64_t i = 0; i < c.num_queries; ++i) {
    in.queries[i * 2] = 1000.0f;
    in.queries[i * 2 + 1] = static_cast<float>(digit(rng));
  }
  for (int64_t j = 0; j < c.num_keys; ++j) {
    in.keys[j * 2] = -1000.0f;
    in.keys[j * 2 + 1] = static_cast<float>(digit(rng));
  }
  const Reference ref = NaiveAttention(in);
  EXPECT_GT(ref.weights[c.num_keys - 1], 1e-3) << "masked keys should carry weight in this case";
  CheckCase(in, 2);
}

// A row with no allowed key is the mean of all values, for every cause.
TEST(FlashKernelTest, RowWithoutAllowedKeysIsValueMean) {
  std::mt19937 rng(13);
  const Case c{.num_queries = 4, .num_keys = 300, .head_size = 6, .value_size = 7,
               .mask = Mask::kPerExample, .valid_len = 0};
  const Inputs in = RandomInputs(c, rng);
  std::vector<float> out(c.num_queries * c.value_size, kUntouched);
  FlashAttention(in.Problem(out.data()), 0, c.num_queries);
  for (int64_t t = 0; t < c.value_size; ++t) {
    double mean = 0.0;
    for (int64_t j = 0; j < c.num_keys; ++j) mean += in.values[j * c.value_size + t];
    mean /= static_cast<double>(c.num_keys);
    for (int64_t i = 0; i < c.num_queries; ++i) {
      EXPECT_NEAR(out[i * c.value_size + t], mean, kAbsTolerance) << "row " << i;
    }
  }
  CheckCase(in, 1);
}

// The kernel's exp, through its output: with one-hot values (V = I) a row's
// output is its weights, so they can be held to the softmax in double within
// a few float roundings. Scores run from 0 to -99.5 in steps of 0.5, falling
// (the max comes first) and rising (every key tile raises it, so the running
// sum and output are rescaled), over four key tiles; the weights below the
// smallest normal float are the only ones allowed to be flushed to 0.
TEST(FlashKernelTest, WeightsAreTheSoftmaxToAFewRoundings) {
  constexpr int64_t kKeys = 200;
  Inputs in;
  in.c = Case{.num_queries = 2, .num_keys = kKeys, .head_size = 1, .value_size = kKeys};
  in.queries = {-1.0f, 1.0f};  // falling, rising
  for (int64_t j = 0; j < kKeys; ++j) in.keys.push_back(0.5f * static_cast<float>(j));
  in.values.assign(kKeys * kKeys, 0.0f);
  for (int64_t j = 0; j < kKeys; ++j) in.values[j * kKeys + j] = 1.0f;
  std::vector<float> out(2 * kKeys, kUntouched);
  FlashAttention(in.Problem(out.data()), 0, 2);
  for (int64_t i = 0; i < 2; ++i) {
    const double sign = in.queries[i];
    const double top = sign * 0.5 * (sign > 0 ? kKeys - 1 : 0);
    double sum = 0.0;
    for (int64_t j = 0; j < kKeys; ++j) sum += std::exp(sign * 0.5 * j - top);
    for (int64_t j = 0; j < kKeys; ++j) {
      const double expected = std::exp(sign * 0.5 * j - top) / sum;
      const float actual = out[i * kKeys + j];
      if (expected < 1.2e-38) {
        EXPECT_LE(actual, 1.2e-38f) << "row " << i << " key " << j;
      } else {
        EXPECT_NEAR(actual, expected, 2e-6 * expected) << "row " << i << " key " << j;
      }
    }
  }
}

// An empty range writes nothing.
TEST(FlashKernelTest, EmptyRangeWritesNothing) {
  std::mt19937 rng(17);
  const Case c{.num_queries = 3, .num_keys = 3};
  const Inputs in = RandomInputs(c, rng);
  std::vector<float> out(3, kUntouched), weights(9, kUntouched);
  FlashAttention(in.Problem(out.data()), 2, 2);
  AttentionWithWeights(in.Problem(out.data()), 1, 1, weights.data(), 3);
  EXPECT_EQ(out, std::vector<float>(3, kUntouched));
  EXPECT_EQ(weights, std::vector<float>(9, kUntouched));
}

// Keys and values in blocks (FlashProblem::key_blocks, a decoding session's
// memory) give what the same rows give contiguous, bit for bit: the tile
// kernel visits the same key tiles either way, and a bf16 problem pairs
// them block by block into the same rows. Rows of every kind are covered:
// allowed keys, none allowed (value mean), allowed scores near -1e6 (the
// exact path, here from key biases) and the weights path.
TEST(FlashKernelTest, KeysInBlocksMatchContiguousKeys) {
  constexpr int64_t kBlockRows = 2 * kFlashKeyTile;
  std::mt19937 rng(23);
  for (const auto& [near_masked, precision] :
       {std::pair{false, Precision::kFp32}, std::pair{true, Precision::kFp32},
        std::pair{false, Precision::kBf16}, std::pair{true, Precision::kBf16}}) {
    Case c{.num_queries = 70,
           .num_keys = 2 * kBlockRows + 37,
           .head_size = 13,
           .value_size = 9,
           .mask = Mask::kPerQuery,
           .key_bias = near_masked,
           .pad = 3};
    Inputs in = RandomInputs(c, rng);
    if (near_masked) {
      for (float& b : in.key_bias) b += -1e6f;
    }
    // Blocks of the padded rows, head columns from column 2 of each row.
    const int64_t column = 2, width = c.head_size + c.pad;
    std::vector<std::vector<float>> key_blocks, value_blocks;
    std::vector<const float*> key_pointers, value_pointers;
    for (int64_t first = 0; first < c.num_keys; first += kBlockRows) {
      std::vector<float>& keys = key_blocks.emplace_back(kBlockRows * width, kUntouched);
      std::vector<float>& values = value_blocks.emplace_back(kBlockRows * width, kUntouched);
      for (int64_t j = first; j < std::min(c.num_keys, first + kBlockRows); ++j) {
        std::copy_n(in.keys.begin() + j * in.KeyStride(), c.head_size,
                    keys.begin() + (j - first) * width + column);
        std::copy_n(in.values.begin() + j * in.ValueStride(), c.value_size,
                    values.begin() + (j - first) * width + column);
      }
      key_pointers.push_back(keys.data());
      value_pointers.push_back(values.data());
    }
    FlashProblem contiguous = in.Problem(nullptr);
    contiguous.precision = precision;
    FlashProblem paged = contiguous;
    paged.keys = paged.values = nullptr;
    paged.key_blocks = key_pointers.data();
    paged.value_blocks = value_pointers.data();
    paged.block_rows = kBlockRows;
    paged.block_column = paged.value_block_column = column;
    paged.key_stride = paged.value_stride = width;
    // Outputs of FlashAttention and AttentionWithWeights, contiguous and paged.
    const std::vector<float> untouched(c.num_queries * in.OutputStride(), kUntouched);
    std::vector<float> want_flash = untouched, got_flash = untouched, want = untouched,
                       got = untouched;
    std::vector<float> want_weights(c.num_queries * in.WeightsStride(), kUntouched);
    std::vector<float> got_weights = want_weights;
    contiguous.output = want_flash.data();
    FlashAttention(contiguous, 0, c.num_queries);
    contiguous.output = want.data();
    AttentionWithWeights(contiguous, 0, c.num_queries, want_weights.data(), in.WeightsStride());
    paged.output = got_flash.data();
    FlashAttention(paged, 0, c.num_queries);
    paged.output = got.data();
    AttentionWithWeights(paged, 0, c.num_queries, got_weights.data(), in.WeightsStride());
    EXPECT_EQ(got_flash, want_flash) << c.Describe();
    EXPECT_EQ(got, want) << c.Describe();
    EXPECT_EQ(got_weights, want_weights) << c.Describe();
  }
}

// A bf16 problem's keys and values are paired once per FlashAttention call
// (flash_kernel.h), up to the largest bound of the call's rows: one call
// over every query tile gives what one call per tile gives, bit for bit.
// Also where a tile's keys end at an odd count and the next key, which the
// pairing of a longer call puts beside the tile's last one, has values that
// round to inf in BF16: they must weigh nothing in that tile, not 0 * inf.
TEST(FlashKernelTest, OneCallOverQueryTilesMatchesOneCallPerTile) {
  std::mt19937 rng(41);
  const Case c{.num_queries = 3 * kFlashQueryTile + 5, .num_keys = 250, .head_size = 13,
               .value_size = 9, .mask = Mask::kPerQuery, .pad = 3};
  Inputs in = RandomInputs(c, rng);
  constexpr int32_t kFirstTileKeys = 101;
  for (int64_t i = 0; i < kFlashQueryTile; ++i) {
    in.valid_lens[i] = std::min(in.valid_lens[i], kFirstTileKeys);
  }
  in.valid_lens[0] = kFirstTileKeys;
  std::fill_n(in.values.begin() + kFirstTileKeys * in.ValueStride(), c.value_size,
              std::numeric_limits<float>::max());
  for (const Precision precision : {Precision::kFp32, Precision::kBf16}) {
    std::vector<float> one_call(c.num_queries * in.OutputStride(), kUntouched);
    std::vector<float> per_tile = one_call;
    FlashProblem problem = in.Problem(one_call.data());
    problem.precision = precision;
    ASSERT_TRUE(FlashAttention(problem, 0, c.num_queries));
    problem.output = per_tile.data();
    for (int64_t row = 0; row < c.num_queries; row += kFlashQueryTile) {
      ASSERT_TRUE(FlashAttention(problem, row, std::min(c.num_queries, row + kFlashQueryTile)));
    }
    EXPECT_EQ(one_call, per_tile) << "precision " << static_cast<int>(precision);
    for (int64_t t = 0; t < c.value_size; ++t) ASSERT_TRUE(std::isfinite(one_call[t]));
  }
}

// Split-K: keys [0, n_k) in ranges of whole key tiles, each through
// FlashAttentionOverKeys, then MergeKeyRanges; the rows of [begin, end).
std::vector<float> SplitAttention(const FlashProblem& base, const Inputs& in, int64_t begin,
                                  int64_t end, std::span<const int64_t> cuts) {
  std::vector<float> out(in.c.num_queries * in.OutputStride(), kUntouched);
  FlashProblem p = base;
  p.output = out.data();
  const int64_t rows = end - begin, dv = in.c.value_size;
  std::vector<std::vector<float>> shares;
  std::vector<KeyRangePart> parts;
  for (size_t r = 0; r + 1 < cuts.size(); ++r) {
    std::vector<float>& share = shares.emplace_back(rows * (2 + dv));
    parts.push_back({share.data(), share.data() + rows, share.data() + 2 * rows});
  }
  for (size_t r = 0; r + 1 < cuts.size(); ++r) {
    EXPECT_TRUE(FlashAttentionOverKeys(p, begin, end, cuts[r], cuts[r + 1], parts[r]));
  }
  MergeKeyRanges(p, begin, end, parts);
  return out;
}

// A problem's keys split into ranges computed apart and merged give the
// reference's output, and the unsplit kernel's to float rounding: one row
// (a decoding token), a grouped-query group of rows and a full query tile,
// over every mask form, biases, rows whose allowed scores sit near -1e6
// (computed again unsplit) and rows with no allowed key.
TEST(FlashKernelTest, SplitKeysMatchUnsplitAndReference) {
  std::mt19937 rng(31);
  constexpr int64_t kKeys = 3 * 1024 + 77;
  const int64_t cuts[] = {0, 1024, 2048, kKeys};
  for (int64_t rows : {1, 4, 64}) {
    for (Mask mask : {Mask::kNone, Mask::kPerExample, Mask::kPerQuery}) {
      for (bool causal : {false, true}) {
        for (bool near_masked : {false, true}) {
          Case c{.num_queries = rows,
                 .num_keys = kKeys,
                 .head_size = 16,
                 .value_size = 12,
                 .mask = mask,
                 .valid_len = 1500,
                 .causal = causal,
                 .query_bias = !near_masked,
                 .key_bias = true,
                 .pad = 1};
          Inputs in = RandomInputs(c, rng);
          if (causal) {
            // Causal rows at the end of the keys, as a decoding step's.
            for (int32_t& l : in.valid_lens) l = static_cast<int32_t>(kKeys);
          }
          if (near_masked) {
            for (float& b : in.key_bias) b += -1e6f;
          }
          SCOPED_TRACE(c.Describe());
          FlashProblem p = in.Problem(nullptr);
          if (causal) p.bounds = {.valid_lens = nullptr, .valid_len = INT32_MAX, .causal = false};
          if (causal) p.bounds.valid_len = static_cast<int32_t>(kKeys - rows / 2);
          std::vector<float> want(c.num_queries * in.OutputStride(), kUntouched);
          FlashProblem unsplit = p;
          unsplit.output = want.data();
          FlashAttention(unsplit, 0, rows);
          const std::vector<float> got = SplitAttention(p, in, 0, rows, cuts);
          // Scores near -1e6 are rounded to float's steps there (1/16),
          // which the double reference does not see: those rows are held
          // against the unsplit kernel only.
          if (!causal && !near_masked) {
            const Reference ref = NaiveAttention(in);
            ExpectMatrix(got, in.OutputStride(), ref.output, rows, c.value_size, 0, rows,
                         "split output");
          }
          for (int64_t i = 0; i < rows; ++i) {
            for (int64_t t = 0; t < c.value_size; ++t) {
              const int64_t at = i * in.OutputStride() + t;
              ASSERT_NEAR(got[at], want[at], 1e-6 + 1e-5 * std::abs(want[at]))
                  << "split and unsplit disagree at (" << i << ", " << t << ")";
            }
          }
        }
      }
    }
  }
}

// The same for problems with score terms and windows (flash_terms.cc):
// soft-capping, a sink, a window that leaves the first ranges empty for
// some rows, against the unsplit kernel.
TEST(FlashKernelTest, SplitKeysWithTermsMatchUnsplit) {
  std::mt19937 rng(37);
  constexpr int64_t kKeys = 3 * 1024 + 77;
  const int64_t cuts[] = {0, 1024, 2048, kKeys};
  for (int64_t rows : {1, 4}) {
    for (int variant = 0; variant < 3; ++variant) {
      Case c{.num_queries = rows, .num_keys = kKeys, .head_size = 16, .value_size = 12, .pad = 1};
      c.scale = 4.0f;
      Inputs in = RandomInputs(c, rng);
      FlashProblem p = in.Problem(nullptr);
      if (variant == 0) p.terms.softcap = 5.0f;
      if (variant == 1) p.terms = {.alibi_slope = 0, .softcap = 0, .has_sink = true, .sink = 2.0f};
      if (variant == 2) {
        p.bounds.window = 1500;
        p.bounds.first_query = kKeys - rows;
        p.bounds.valid_len = static_cast<int32_t>(kKeys);
        p.terms.softcap = 30.0f;
      }
      SCOPED_TRACE("variant " + std::to_string(variant) + " rows " + std::to_string(rows));
      std::vector<float> want(c.num_queries * in.OutputStride(), kUntouched);
      FlashProblem unsplit = p;
      unsplit.output = want.data();
      FlashAttention(unsplit, 0, rows);
      const std::vector<float> got = SplitAttention(p, in, 0, rows, cuts);
      for (int64_t i = 0; i < rows; ++i) {
        for (int64_t t = 0; t < c.value_size; ++t) {
          const int64_t at = i * in.OutputStride() + t;
          ASSERT_NEAR(got[at], want[at], 1e-6 + 1e-5 * std::abs(want[at]))
              << "split and unsplit disagree at (" << i << ", " << t << ")";
        }
      }
    }
  }
}

}  // namespace
}  // namespace attention
