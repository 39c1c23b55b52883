// request_test.cc: Validate() refuses each fault with a message that names the
// field, the expected and the actual value, and resolves sizes otherwise.
#include "core/engine/request.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "absl/status/status.h"

namespace attention {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

Tensor Filled(std::vector<int64_t> shape) {
  int64_t size = 1;
  for (int64_t d : shape) size *= d;
  return {std::move(shape), std::vector<float>(size, 0.5f)};
}

// A valid (B=2, n_q=3, n_k=4, d=5, d_v=6) request that tests then break.
struct Fixture {
  Tensor queries = Filled({2, 3, 5});
  Tensor keys = Filled({2, 4, 5});
  Tensor values = Filled({2, 4, 6});
  std::vector<int32_t> lens;
  AttentionRequest request() const {
    AttentionRequest r;
    r.queries = queries.view();
    r.keys = keys.view();
    r.values = values.view();
    r.valid_lens = lens;
    return r;
  }
};

std::string Refusal(const Model& model, const AttentionRequest& request, const Limits& limits = {}) {
  absl::StatusOr<AttentionDims> dims = Validate(model, request, limits);
  EXPECT_EQ(dims.status().code(), absl::StatusCode::kInvalidArgument) << dims.status();
  return std::string(dims.status().message());
}

TEST(Validate, ResolvesSizesAndDefaultScale) {
  Fixture f;
  f.lens = {1, 4};
  absl::StatusOr<AttentionDims> dims = Validate(DotProductModel(), f.request());
  ASSERT_TRUE(dims.ok()) << dims.status();
  EXPECT_EQ(dims->batch, 2);
  EXPECT_EQ(dims->num_queries, 3);
  EXPECT_EQ(dims->num_keys, 4);
  EXPECT_EQ(dims->value_size, 6);
  EXPECT_EQ(dims->output_size, 6);
  EXPECT_EQ(dims->length_mask, AttentionDims::LengthMask::kPerExample);
  EXPECT_FLOAT_EQ(dims->scale, 1.0f / std::sqrt(5.0f));
}

TEST(Validate, SelfAttentionShorthandUsesQueries) {
  Fixture f;
  AttentionRequest r = f.request();
  r.keys.reset();
  r.values.reset();
  absl::StatusOr<AttentionDims> dims = Validate(DistanceModel(), r);
  ASSERT_TRUE(dims.ok()) << dims.status();
  EXPECT_EQ(dims->num_keys, 3);
  EXPECT_EQ(dims->value_size, 5);
  EXPECT_FLOAT_EQ(dims->scale, 1.0f);
}

TEST(Validate, MissingQueries) {
  Fixture f;
  AttentionRequest r = f.request();
  r.queries = {};
  EXPECT_THAT(Refusal(DotProductModel(), r), HasSubstr("queries: required"));
}

TEST(Validate, RankNamesFieldAndShape) {
  Fixture f;
  f.keys = Filled({4, 5});
  EXPECT_THAT(Refusal(DotProductModel(), f.request()),
              AllOf(HasSubstr("keys.shape"), HasSubstr("rank 3"), HasSubstr("got rank 2 [4, 5]")));
}

TEST(Validate, NonPositiveDimension) {
  Fixture f;
  f.values = Tensor{{2, 0, 6}, {}};
  EXPECT_THAT(Refusal(DotProductModel(), f.request()),
              AllOf(HasSubstr("values.shape[1]"), HasSubstr("got 0")));
}

TEST(Validate, DataLengthNamesExpectedAndActual) {
  Fixture f;
  f.queries.data.pop_back();
  EXPECT_THAT(Refusal(DotProductModel(), f.request()),
              AllOf(HasSubstr("queries.data"), HasSubstr("expected 30"), HasSubstr("got 29")));
}

TEST(Validate, HugeShapeOverflowsWithoutUndefinedBehaviour) {
  Fixture f;
  const int64_t big = std::numeric_limits<int64_t>::max() / 2;
  f.queries = Tensor{{big, big, 3}, {1.0f}};
  EXPECT_THAT(Refusal(DotProductModel(), f.request()), HasSubstr("overflows"));
}

TEST(Validate, BatchAndKeyCountMismatch) {
  Fixture f;
  f.keys = Filled({3, 4, 5});
  EXPECT_THAT(Refusal(DotProductModel(), f.request()),
              AllOf(HasSubstr("keys.shape[0]"), HasSubstr("expected 2"), HasSubstr("got 3")));
  Fixture g;
  g.values = Filled({2, 7, 6});
  EXPECT_THAT(Refusal(DotProductModel(), g.request()),
              AllOf(HasSubstr("values.shape[1] (n_k)"), HasSubstr("expected 4"), HasSubstr("got 7")));
}

TEST(Validate, ModelInputSizes) {
  Fixture f;
  f.keys = Filled({2, 4, 7});
  EXPECT_THAT(Refusal(DotProductModel(), f.request()),
              AllOf(HasSubstr("d_k"), HasSubstr("expected 5"), HasSubstr("got 7")));
  Model bilinear;
  bilinear.name = "bl";
  bilinear.kind = Kind::kBilinear;
  bilinear.query_size = 5;
  bilinear.key_size = 9;
  bilinear.w_k = RowMatrix::Zero(5, 9);
  EXPECT_THAT(Refusal(bilinear, f.request()),
              AllOf(HasSubstr("model 'bl'"), HasSubstr("expected 9"), HasSubstr("got 7")));
}

TEST(Validate, ValidLensLengthAndSign) {
  Fixture f;
  f.lens = {1, 2, 3};
  EXPECT_THAT(Refusal(DotProductModel(), f.request()),
              AllOf(HasSubstr("valid_lens"), HasSubstr("expected 0, 2"), HasSubstr("or 6"),
                    HasSubstr("got 3")));
  f.lens = {1, 2, 3, -1, 0, 0};
  EXPECT_THAT(Refusal(DotProductModel(), f.request()),
              AllOf(HasSubstr("valid_lens[3]"), HasSubstr("got -1")));
}

TEST(Validate, NonFiniteValuesAndScale) {
  Fixture f;
  f.values.data[13] = std::numeric_limits<float>::infinity();
  EXPECT_THAT(Refusal(DotProductModel(), f.request()),
              AllOf(HasSubstr("values.data[13]"), HasSubstr("finite"), HasSubstr("inf")));
  Fixture g;
  g.keys.data[0] = std::nanf("");
  EXPECT_THAT(Refusal(DotProductModel(), g.request()), HasSubstr("keys.data[0]"));
  Fixture h;
  AttentionRequest r = h.request();
  r.scale = std::numeric_limits<float>::infinity();
  EXPECT_THAT(Refusal(DotProductModel(), r), HasSubstr("scale"));
}

TEST(Validate, ElementLimitCountsWeights) {
  Fixture f;
  AttentionRequest r = f.request();
  // queries 30 + keys 40 + values 48 + output 36 = 154; weights add 24.
  EXPECT_TRUE(Validate(DotProductModel(), r, Limits{154}).ok());
  r.return_attention_weights = true;
  EXPECT_THAT(Refusal(DotProductModel(), r, Limits{154}),
              AllOf(HasSubstr("at most 154"), HasSubstr("got 178")));
}

// additive's projections, B (n_q + n_k) h floats at once, count against the
// scratch cap: a 4 MB request over 500,000 keys at h = 256 took 525 MiB.
TEST(Validate, AdditiveProjectionsCountAgainstTheScratchCap) {
  Fixture f;  // B=2, n_q=3, n_k=4, d=5
  Model additive;
  additive.name = "wide";
  additive.kind = Kind::kAdditive;
  additive.query_size = additive.key_size = 5;
  additive.w_q = RowMatrix::Zero(200, 5);
  additive.w_k = RowMatrix::Zero(200, 5);
  additive.w_v = RowMatrix::Zero(1, 200);
  Limits limits;
  // Exactly the projections, above the 64 x 22 floats per thread.
  limits.max_request_scratch_elements = 2 * (3 + 4) * 200;
  EXPECT_TRUE(Validate(additive, f.request(), limits).ok());
  limits.max_request_scratch_elements -= 1;
  EXPECT_THAT(Refusal(additive, f.request(), limits),
              AllOf(HasSubstr("at most 2799 floats of additive projections"),
                    HasSubstr("got 2800"), HasSubstr("n_k=4) x h=200")));
}

}  // namespace
}  // namespace attention
