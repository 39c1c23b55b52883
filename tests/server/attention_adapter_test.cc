// attention_adapter_test.cc: the wire <-> engine mapping, without a server.
#include "server/api/attention/attention_adapter.h"

#include <gtest/gtest.h>

#include "absl/status/status.h"

namespace attention::server {
namespace {

v1::AttendRequest Request() {
  v1::AttendRequest proto;
  proto.set_model("dot_product");
  for (int64_t s : {1, 2, 2}) proto.mutable_queries()->add_shape(s);
  for (float v : {1.0f, 2.0f, 3.0f, 4.0f}) proto.mutable_queries()->add_data(v);
  return proto;
}

TEST(ProtoAdapterTest, RequestViewsTheProtoWithoutCopying) {
  v1::AttendRequest proto = Request();
  for (int64_t s : {1, 3, 2}) proto.mutable_values()->add_shape(s);
  for (int i = 0; i < 6; ++i) proto.mutable_values()->add_data(static_cast<float>(i));
  proto.add_valid_lens(1);
  proto.add_valid_lens(2);
  proto.set_causal(true);
  proto.set_return_attention_weights(true);

  const AttentionRequest request = ToAttentionRequest(proto);
  EXPECT_EQ(request.queries.shape, (std::vector<int64_t>{1, 2, 2}));
  EXPECT_EQ(request.queries.data.data(), proto.queries().data().data());
  EXPECT_EQ(request.queries.data.size(), 4u);
  EXPECT_FALSE(request.keys.has_value()) << "absent keys mean keys = queries";
  ASSERT_TRUE(request.values.has_value());
  EXPECT_EQ(request.values->data.data(), proto.values().data().data());
  EXPECT_EQ(request.values->shape, (std::vector<int64_t>{1, 3, 2}));
  ASSERT_EQ(request.valid_lens.size(), 2u);
  EXPECT_EQ(request.valid_lens.data(), proto.valid_lens().data());
  EXPECT_TRUE(request.causal);
  EXPECT_TRUE(request.return_attention_weights);
  EXPECT_FALSE(request.scale.has_value());
}

TEST(ProtoAdapterTest, ScaleKeepsItsPresenceEvenWhenZero) {
  v1::AttendRequest proto = Request();
  proto.set_scale(0.0f);
  const AttentionRequest request = ToAttentionRequest(proto);
  ASSERT_TRUE(request.scale.has_value());
  EXPECT_EQ(*request.scale, 0.0f);
}

TEST(ProtoAdapterTest, PresentButEmptyKeysStayPresent) {
  v1::AttendRequest proto = Request();
  proto.mutable_keys();  // sent, empty: a malformed tensor for Validate to name
  const AttentionRequest request = ToAttentionRequest(proto);
  ASSERT_TRUE(request.keys.has_value());
  EXPECT_TRUE(request.keys->shape.empty());
}

TEST(ProtoAdapterTest, ResponseCarriesOutputAndOnlyAskedForWeights) {
  AttentionResult result;
  result.output = Tensor{{1, 1, 2}, {0.25f, 0.75f}};
  v1::AttendResponse without_weights;
  ToAttendResponse(result, &without_weights);
  EXPECT_EQ(without_weights.output().shape_size(), 3);
  EXPECT_EQ(without_weights.output().data(1), 0.75f);
  EXPECT_FALSE(without_weights.has_attention_weights());

  result.attention_weights = Tensor{{1, 1, 3}, {0.2f, 0.3f, 0.5f}};
  v1::AttendResponse with_weights;
  ToAttendResponse(result, &with_weights);
  ASSERT_EQ(with_weights.attention_weights().data_size(), 3);
  EXPECT_EQ(with_weights.attention_weights().data(2), 0.5f);
}

TEST(ProtoAdapterTest, StatusKeepsCodeAndMessage) {
  const grpc::Status invalid =
      ToGrpcStatus(absl::InvalidArgumentError("queries: expected rank 3, got 2"));
  EXPECT_EQ(invalid.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(invalid.error_message(), "queries: expected rank 3, got 2");
  EXPECT_EQ(ToGrpcStatus(absl::NotFoundError("m")).error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(ToGrpcStatus(absl::ResourceExhaustedError("q")).error_code(),
            grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_EQ(ToGrpcStatus(absl::DeadlineExceededError("d")).error_code(),
            grpc::StatusCode::DEADLINE_EXCEEDED);
  EXPECT_EQ(ToGrpcStatus(absl::UnauthenticatedError("u")).error_code(),
            grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_TRUE(ToGrpcStatus(absl::OkStatus()).ok());
}

TEST(ProtoAdapterTest, ModelInfoReportsKindAndSizes) {
  Model model;
  model.name = "mha";
  model.kind = Kind::kMultiHead;
  model.num_heads = 4;
  model.query_size = 16;
  model.key_size = 12;
  model.value_size = 8;
  model.output_size = 16;
  const v1::ModelInfo info = ToModelInfo(model);
  EXPECT_EQ(info.name(), "mha");
  EXPECT_EQ(info.kind(), "multi_head");
  EXPECT_EQ(info.num_heads(), 4);
  EXPECT_EQ(info.query_size(), 16);
  EXPECT_EQ(info.key_size(), 12);
  EXPECT_EQ(info.value_size(), 8);
  EXPECT_EQ(info.output_size(), 16);
  EXPECT_EQ(ToModelInfo(DotProductModel()).query_size(), 0) << "built-ins take any size";
  EXPECT_EQ(info.precision(), "fp32");
  model.precision = Precision::kBf16;
  EXPECT_EQ(ToModelInfo(model).precision(), "bf16");
}

}  // namespace
}  // namespace attention::server
