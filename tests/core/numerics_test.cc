// numerics_test.cc: a finite request never gets NaN or Inf with OK.
//
// Scores beyond float32 (a huge scale, huge inputs) follow the rule of
// docs/api.md section 2.1 as if computed exactly: the weight goes to the
// largest score, and scores far below -1e6 lose to the masked keys. What
// cannot be represented (a projection of huge weights and inputs) is refused
// with INVALID_ARGUMENT. Runs on every kernel path
// (ctest core_numerics_test/<path>).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cfloat>
#include <cmath>
#include <random>
#include <vector>

#include "core/engine/engine.h"

namespace attention {
namespace {

using ::testing::HasSubstr;

// The answer by both paths: `output` holds the fused path's output (no
// weights asked), then the exact path's (weights asked).
struct Answer {
  absl::Status status;
  std::vector<float> output, weights;
};

Answer Compute(const Model& model, const Tensor& queries, const Tensor* keys, const Tensor* values,
               std::optional<float> scale, std::vector<int32_t> valid_lens = {}) {
  Engine engine(EngineOptions{.num_threads = 2});
  AttentionRequest request;
  request.queries = queries.view();
  if (keys != nullptr) request.keys = keys->view();
  if (values != nullptr) request.values = values->view();
  request.valid_lens = valid_lens;
  request.scale = scale;
  Answer answer;
  for (bool weights : {false, true}) {
    request.return_attention_weights = weights;
    absl::StatusOr<AttentionResult> result = engine.Attend(model, request);
    answer.status = result.status();
    if (!result.ok()) return answer;
    // Both paths (fused without weights, exact with them) must hold: the
    // output of each, and the weights.
    if (weights) {
      answer.weights = result->attention_weights.data;
      answer.output.insert(answer.output.end(), result->output.data.begin(),
                           result->output.data.end());
    } else {
      answer.output = result->output.data;
    }
  }
  return answer;
}

TEST(Numerics, OverflowingScoreOfOneKeyIsFinite) {
  // scale 1e38, q = k = v = 10: the float score overflows.
  const Tensor queries{{1, 1, 1}, {10.0f}};
  const Answer a = Compute(DotProductModel(), queries, nullptr, nullptr, 1e38f);
  ASSERT_TRUE(a.status.ok()) << a.status;
  EXPECT_EQ(a.output, (std::vector<float>{10.0f, 10.0f}));
  EXPECT_EQ(a.weights, std::vector<float>{1.0f});
}

TEST(Numerics, ScoresBeyondFloatWeighTheLargest) {
  const Tensor query{{1, 1, 1}, {1.0f}};
  const Tensor keys{{1, 3, 1}, {1.0f, 2.0f, 3.0f}};
  const Tensor values{{1, 3, 1}, {10.0f, 20.0f, 30.0f}};
  // Scores 3e38, 6e38, 9e38 (the last two beyond FLT_MAX): the largest wins.
  Answer a = Compute(DotProductModel(), query, &keys, &values, 3e38f);
  ASSERT_TRUE(a.status.ok()) << a.status;
  EXPECT_EQ(a.output, (std::vector<float>{30.0f, 30.0f}));
  EXPECT_EQ(a.weights, (std::vector<float>{0.0f, 0.0f, 1.0f}));
  // Negated: the least negative wins.
  a = Compute(DotProductModel(), query, &keys, &values, -3e38f);
  ASSERT_TRUE(a.status.ok()) << a.status;
  EXPECT_EQ(a.output, (std::vector<float>{10.0f, 10.0f}));
  // Allowed scores -3e38 and -6e38 are far below the masked keys' -1e6: the
  // masked key takes the weight, as the rule says.
  a = Compute(DotProductModel(), query, &keys, &values, -3e38f, {2});
  ASSERT_TRUE(a.status.ok()) << a.status;
  EXPECT_EQ(a.output, (std::vector<float>{30.0f, 30.0f}));
  EXPECT_EQ(a.weights, (std::vector<float>{0.0f, 0.0f, 1.0f}));
}

TEST(Numerics, DistanceBeyondFloatWeighsTheNearest) {
  // |q|^2 = 4e38 overflows the float norms the kernel uses; the distances
  // are 0 and 4e19.
  const Tensor query{{1, 1, 1}, {2e19f}};
  const Tensor keys{{1, 2, 1}, {-2e19f, 2e19f}};
  const Tensor values{{1, 2, 1}, {5.0f, 7.0f}};
  const Answer a = Compute(DistanceModel(), query, &keys, &values, std::nullopt);
  ASSERT_TRUE(a.status.ok()) << a.status;
  EXPECT_EQ(a.output, (std::vector<float>{7.0f, 7.0f}));
}

TEST(Numerics, HugeValuesAverageWithoutOverflow) {
  // Equal scores: the output is the mean of values near FLT_MAX, whose
  // float sum overflows.
  const Tensor query{{1, 1, 1}, {0.0f}};
  const Tensor keys{{1, 4, 1}, {1.0f, 1.0f, 1.0f, 1.0f}};
  const Tensor values{{1, 4, 1}, {3e38f, 3e38f, 3e38f, 3e38f}};
  const Answer a = Compute(DotProductModel(), query, &keys, &values, std::nullopt);
  ASSERT_TRUE(a.status.ok()) << a.status;
  ASSERT_EQ(a.output.size(), 2u);
  EXPECT_NEAR(a.output[0], 3e38f, 1e32f);
  EXPECT_NEAR(a.output[1], 3e38f, 1e32f);
}

TEST(Numerics, AnAnswerBeyondFloatIsRefusedNamingTheCause) {
  // bilinear with a huge weight: q (W_k k) = 1e20 * 1e30 * 1e20 has no
  // float32 form, nor have the scores the kernel works from.
  Model bilinear;
  bilinear.kind = Kind::kBilinear;
  bilinear.name = "huge_bilinear";
  bilinear.query_size = bilinear.key_size = 1;
  bilinear.w_k = RowMatrix::Constant(1, 1, 1e30f);
  const Tensor query{{1, 1, 1}, {1e20f}};
  const Tensor keys{{1, 2, 1}, {1e20f, -1e20f}};
  const Answer a = Compute(bilinear, query, &keys, nullptr, std::nullopt);
  if (a.status.ok()) {
    for (float x : a.output) EXPECT_TRUE(std::isfinite(x));
  } else {
    EXPECT_EQ(a.status.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(a.status.message()),
                ::testing::AllOf(HasSubstr("expected a finite value"), HasSubstr("scale"),
                      HasSubstr("huge_bilinear")));
  }
}

// Property: random finite requests of every kind with extreme scales,
// inputs and weights are OK with every output and weight finite, or refused
// with INVALID_ARGUMENT. dot_product and distance are never refused: their
// answers always have a float32 form.
TEST(Numerics, ExtremeRequestsAreFiniteOrRefused) {
  std::mt19937 rng(14);
  const float scales[] = {1e38f, -1e38f, 3e38f, -3e38f, FLT_MAX, -FLT_MAX, 1e20f, -1e-30f, 0.0f};
  const float magnitudes[] = {1.0f, 1e15f, 1e19f, 1e30f, 1e37f, 8e37f};
  auto fill = [&](std::vector<int64_t> shape, float magnitude) {
    std::normal_distribution<float> normal(0.0f, 1.0f);
    int64_t size = 1;
    for (int64_t d : shape) size *= d;
    Tensor t{std::move(shape), std::vector<float>(size)};
    for (float& x : t.data) x = std::clamp(normal(rng) * magnitude, -FLT_MAX, FLT_MAX);
    return t;
  };
  auto matrix = [&](int64_t rows, int64_t cols, float magnitude) {
    const Tensor t = fill({rows, cols}, magnitude);
    return RowMatrix(Eigen::Map<const RowMatrix>(t.data.data(), rows, cols));
  };
  int ok = 0, refused = 0;
  for (int trial = 0; trial < 300; ++trial) {
    const Kind kind = static_cast<Kind>(trial % 5);
    const float magnitude = magnitudes[rng() % std::size(magnitudes)];
    const float weight_magnitude = magnitudes[rng() % std::size(magnitudes)];
    const int64_t batch = 1 + rng() % 2, n_q = 1 + rng() % 70, n_k = 1 + rng() % 70;
    const int64_t d = 1 + rng() % 9, d_v = 1 + rng() % 5;
    Model model;
    switch (kind) {
      case Kind::kDotProduct:
        model = DotProductModel();
        break;
      case Kind::kDistance:
        model = DistanceModel();
        break;
      case Kind::kAdditive:
        model.kind = kind;
        model.query_size = model.key_size = d;
        model.w_q = matrix(4, d, weight_magnitude);
        model.w_k = matrix(4, d, weight_magnitude);
        model.w_v = matrix(1, 4, weight_magnitude);
        break;
      case Kind::kBilinear:
        model.kind = kind;
        model.query_size = model.key_size = d;
        model.w_k = matrix(d, d, weight_magnitude);
        break;
      case Kind::kMultiHead:
        model.kind = kind;
        model.num_heads = 2;
        model.query_size = model.key_size = d;
        model.value_size = d_v;
        model.output_size = 4;
        model.w_q = matrix(4, d, weight_magnitude);
        model.w_k = matrix(4, d, weight_magnitude);
        model.w_v = matrix(4, d_v, weight_magnitude);
        model.w_o = matrix(4, 4, weight_magnitude);
        model.b_q = model.b_k = model.b_v = model.b_o = Vector::Zero(4);
        break;
    }
    model.name = std::string(KindName(kind));
    const Tensor queries = fill({batch, n_q, d}, magnitude);
    const Tensor keys = fill({batch, n_k, d}, magnitude);
    const Tensor values = fill({batch, n_k, d_v}, magnitude);
    std::vector<int32_t> valid_lens;
    if (rng() % 2 == 0) {
      for (int64_t b = 0; b < batch; ++b) valid_lens.push_back(rng() % (n_k + 1));
    }
    const std::optional<float> scale =
        rng() % 4 == 0 ? std::nullopt : std::optional<float>(scales[rng() % std::size(scales)]);
    const Answer a = Compute(model, queries, &keys, &values, scale, valid_lens);
    const std::string what = model.name + " trial " + std::to_string(trial);
    if (!a.status.ok()) {
      ++refused;
      EXPECT_EQ(a.status.code(), absl::StatusCode::kInvalidArgument) << what << ": " << a.status;
      EXPECT_TRUE(kind != Kind::kDotProduct && kind != Kind::kDistance) << what << ": " << a.status;
      continue;
    }
    ++ok;
    for (const std::vector<float>* v : {&a.output, &a.weights}) {
      for (size_t i = 0; i < v->size(); ++i) {
        ASSERT_TRUE(std::isfinite((*v)[i])) << what << ": element " << i << " is " << (*v)[i];
      }
    }
  }
  EXPECT_GT(ok, 100);
  std::cout << ok << " answered finite, " << refused << " refused\n";
}

}  // namespace
}  // namespace attention
