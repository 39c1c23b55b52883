// attention_adapter_test.cc: the wire <-> engine mapping, without a server.
#include "server/api/attention/attention_adapter.h"

#include <gtest/gtest.h>

#include <vector>

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

TEST(ProtoAdapterTest, PositionsWindowAndSoftcapReachTheRequest) {
  v1::AttendRequest proto = Request();
  const AttentionRequest plain = ToAttentionRequest(proto);
  EXPECT_TRUE(plain.position_ids.empty());
  EXPECT_FALSE(plain.sliding_window.has_value());
  EXPECT_FALSE(plain.softcap.has_value());

  for (int64_t id : {int64_t{7}, int64_t{1} << 40}) proto.add_position_ids(id);
  proto.set_sliding_window(3);
  proto.set_softcap(30.0f);
  const AttentionRequest request = ToAttentionRequest(proto);
  ASSERT_EQ(request.position_ids.size(), 2u);
  EXPECT_EQ(request.position_ids.data(), proto.position_ids().data()) << "viewed, not copied";
  EXPECT_EQ(request.position_ids[1], int64_t{1} << 40);
  ASSERT_TRUE(request.sliding_window.has_value());
  EXPECT_EQ(*request.sliding_window, 3);
  ASSERT_TRUE(request.softcap.has_value());
  EXPECT_EQ(*request.softcap, 30.0f);
}

TEST(ProtoAdapterTest, WindowAndSoftcapKeepTheirPresenceEvenWhenZero) {
  v1::AttendRequest proto = Request();
  proto.set_sliding_window(0);
  proto.set_softcap(0.0f);
  const AttentionRequest request = ToAttentionRequest(proto);
  ASSERT_TRUE(request.sliding_window.has_value());
  EXPECT_EQ(*request.sliding_window, 0);
  ASSERT_TRUE(request.softcap.has_value());
  EXPECT_EQ(*request.softcap, 0.0f);
}

TEST(ProtoAdapterTest, FourDimensionalTensorsPassThroughAsTheyAre) {
  v1::AttendRequest proto;
  proto.set_model("dot_product");
  for (int64_t s : {1, 2, 4, 3}) proto.mutable_queries()->add_shape(s);
  for (int i = 0; i < 24; ++i) proto.mutable_queries()->add_data(static_cast<float>(i));
  for (int64_t s : {1, 5, 2, 3}) proto.mutable_keys()->add_shape(s);
  for (int i = 0; i < 30; ++i) proto.mutable_keys()->add_data(static_cast<float>(i));
  const AttentionRequest request = ToAttentionRequest(proto);
  EXPECT_EQ(request.queries.shape, (std::vector<int64_t>{1, 2, 4, 3}));
  ASSERT_TRUE(request.keys.has_value());
  EXPECT_EQ(request.keys->shape, (std::vector<int64_t>{1, 5, 2, 3}));
  EXPECT_EQ(request.keys->data.size(), 30u);
}

TEST(ProtoAdapterTest, OpeningCarriesItsWindowAndSoftcap) {
  v1::SessionOpen proto;
  proto.set_model("dot_product");
  const SessionOpen plain = ToSessionOpen(proto);
  EXPECT_EQ(plain.sliding_window, 0);
  EXPECT_EQ(plain.softcap, 0.0f);
  proto.set_sliding_window(16);
  proto.set_softcap(30.0f);
  const SessionOpen open = ToSessionOpen(proto);
  EXPECT_EQ(open.sliding_window, 16);
  EXPECT_EQ(open.softcap, 30.0f);
}

TEST(ProtoAdapterTest, StepKeysAndValuesArePresentOnlyWhenSent) {
  v1::SessionStep proto;
  for (int64_t s : {1, 1, 4, 2}) proto.mutable_queries()->add_shape(s);
  for (int i = 0; i < 8; ++i) proto.mutable_queries()->add_data(static_cast<float>(i));
  proto.set_return_attention_weights(true);
  const SessionStep plain = ToSessionStep(proto);
  EXPECT_EQ(plain.queries.shape, (std::vector<int64_t>{1, 1, 4, 2}));
  EXPECT_TRUE(plain.return_attention_weights);
  EXPECT_FALSE(plain.keys.has_value()) << "absent keys: the queries serve";
  EXPECT_FALSE(plain.values.has_value());

  for (int64_t s : {1, 1, 2, 2}) proto.mutable_keys()->add_shape(s);
  for (int i = 0; i < 4; ++i) proto.mutable_keys()->add_data(static_cast<float>(i));
  proto.mutable_values();  // sent, empty: a malformed tensor for ValidateStep to name
  const SessionStep step = ToSessionStep(proto);
  ASSERT_TRUE(step.keys.has_value());
  EXPECT_EQ(step.keys->shape, (std::vector<int64_t>{1, 1, 2, 2}));
  EXPECT_EQ(step.keys->data.data(), proto.keys().data().data());
  ASSERT_TRUE(step.values.has_value());
  EXPECT_TRUE(step.values->shape.empty());
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
  EXPECT_EQ(info.kv_cache_dtype(), "float32");
  model.kv_cache_dtype = KvDtype::kBfloat16;
  EXPECT_EQ(ToModelInfo(model).kv_cache_dtype(), "bfloat16");
  model.kv_cache_dtype.reset();
  model.precision = Precision::kBf16;
  EXPECT_EQ(ToModelInfo(model).precision(), "bf16");
  // The older layouts: as many kv heads as heads, E / H columns each, no
  // rotary, window or soft-cap.
  EXPECT_EQ(info.num_kv_heads(), 4);
  EXPECT_EQ(info.head_dim(), 4);
  EXPECT_EQ(info.rope_type(), "");
  EXPECT_EQ(info.rotary_dim(), 0);
  EXPECT_EQ(info.sliding_window(), 0);
  EXPECT_FALSE(info.alibi());
  EXPECT_EQ(ToModelInfo(DotProductModel()).num_kv_heads(), 0) << "built-ins have no heads";
}

TEST(ProtoAdapterTest, ModelInfoReportsTheLayersHeadsRotaryAndWindow) {
  Model model;
  model.name = "llama";
  model.kind = Kind::kMultiHead;
  model.num_heads = 8;
  model.num_kv_heads = 2;
  model.head_size = 16;
  model.query_size = 64;
  model.output_size = 64;
  model.terms.rotary.dims = 8;
  model.terms.rotary.interleaved = true;
  model.terms.rotary.type = "llama3";
  model.terms.rotary.theta = 500000;
  model.terms.sliding_window = 4096;
  model.terms.softcap = 50;
  model.terms.sinks = std::vector<float>(8, 0.5f);
  const v1::ModelInfo info = ToModelInfo(model);
  EXPECT_EQ(info.num_heads(), 8);
  EXPECT_EQ(info.num_kv_heads(), 2);
  EXPECT_EQ(info.head_dim(), 16);
  EXPECT_EQ(info.rope_type(), "llama3");
  EXPECT_EQ(info.rope_theta(), 500000);
  EXPECT_TRUE(info.rope_interleaved());
  EXPECT_EQ(info.rotary_dim(), 8);
  EXPECT_EQ(info.sliding_window(), 4096);
  EXPECT_EQ(info.softcap(), 50);
  EXPECT_TRUE(info.sinks());
  EXPECT_FALSE(info.alibi());

  model.terms.rotary = RotaryEmbedding();
  model.terms.alibi_slopes = std::vector<float>(8, 0.25f);
  const v1::ModelInfo alibi = ToModelInfo(model);
  EXPECT_TRUE(alibi.alibi());
  EXPECT_EQ(alibi.rope_type(), "") << "no rotary";
  EXPECT_EQ(alibi.rope_theta(), 0);
}

}  // namespace
}  // namespace attention::server
