// server_inference_adapter_test.cc: the Open Inference Protocol <-> engine
// mapping (server/inference_adapter.h), without a server.
#include "server/api/inference/inference_adapter.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"

namespace attention::server {
namespace {

using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using InputTensor = inference::ModelInferRequest::InferInputTensor;

template <typename T>
std::string Bytes(const std::vector<T>& values) {
  return std::string(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(T));
}

InputTensor* AddInput(inference::ModelInferRequest* proto, const std::string& name,
                      const std::string& datatype, std::vector<int64_t> shape) {
  InputTensor* input = proto->add_inputs();
  input->set_name(name);
  input->set_datatype(datatype);
  input->mutable_shape()->Assign(shape.begin(), shape.end());
  return input;
}

// queries (1, 2, 2) = 1, 2, 3, 4 in raw FP32.
inference::ModelInferRequest RawQueries() {
  inference::ModelInferRequest proto;
  proto.set_model_name("dot_product");
  proto.set_id("request-7");
  AddInput(&proto, "queries", "FP32", {1, 2, 2});
  proto.add_raw_input_contents(Bytes(std::vector<float>{1, 2, 3, 4}));
  return proto;
}

absl::Status Decode(const inference::ModelInferRequest& proto) {
  DecodedInferRequest decoded;
  return DecodeInferRequest(proto, &decoded);
}

TEST(InferenceAdapterTest, RawFp32InputsBecomeTheEngineRequest) {
  inference::ModelInferRequest proto = RawQueries();
  AddInput(&proto, "values", "FP32", {1, 2, 1});
  proto.add_raw_input_contents(Bytes(std::vector<float>{5, 6}));
  AddInput(&proto, "valid_lens", "INT32", {1});
  proto.add_raw_input_contents(Bytes(std::vector<int32_t>{1}));

  DecodedInferRequest decoded;
  ASSERT_TRUE(DecodeInferRequest(proto, &decoded).ok());
  const AttentionRequest& request = decoded.request;
  EXPECT_EQ(request.queries.shape, (std::vector<int64_t>{1, 2, 2}));
  EXPECT_THAT(std::vector<float>(request.queries.data.begin(), request.queries.data.end()),
              ElementsAre(1, 2, 3, 4));
  EXPECT_FALSE(request.keys.has_value()) << "absent keys mean keys = queries";
  ASSERT_TRUE(request.values.has_value());
  EXPECT_THAT(std::vector<float>(request.values->data.begin(), request.values->data.end()),
              ElementsAre(5, 6));
  EXPECT_THAT(std::vector<int32_t>(request.valid_lens.begin(), request.valid_lens.end()),
              ElementsAre(1));
  EXPECT_FALSE(request.causal);
  EXPECT_FALSE(request.scale.has_value());
  EXPECT_TRUE(decoded.returns_output);
  EXPECT_FALSE(decoded.returns_weights);
  EXPECT_FALSE(request.return_attention_weights);
}

TEST(InferenceAdapterTest, TypedContentsDecodeLikeRawOnes) {
  inference::ModelInferRequest proto;
  InputTensor* queries = AddInput(&proto, "queries", "FP32", {1, 2, 2});
  for (float v : {1.0f, 2.0f, 3.0f, 4.0f}) queries->mutable_contents()->add_fp32_contents(v);
  InputTensor* lens = AddInput(&proto, "valid_lens", "INT64", {1, 2});
  lens->mutable_contents()->add_int64_contents(2);
  lens->mutable_contents()->add_int64_contents(int64_t{1} << 40);

  DecodedInferRequest decoded;
  ASSERT_TRUE(DecodeInferRequest(proto, &decoded).ok());
  EXPECT_THAT(decoded.queries.data, ElementsAre(1, 2, 3, 4));
  EXPECT_THAT(decoded.valid_lens, ElementsAre(2, std::numeric_limits<int32_t>::max()))
      << "a length beyond int32 masks nothing, as the largest int32 does";
}

TEST(InferenceAdapterTest, RawInt64LengthsKeepTheirSign) {
  inference::ModelInferRequest proto = RawQueries();
  AddInput(&proto, "valid_lens", "INT64", {1});
  proto.add_raw_input_contents(Bytes(std::vector<int64_t>{-(int64_t{1} << 40)}));
  DecodedInferRequest decoded;
  ASSERT_TRUE(DecodeInferRequest(proto, &decoded).ok());
  ASSERT_EQ(decoded.valid_lens.size(), 1u);
  EXPECT_LT(decoded.valid_lens[0], 0) << "validation must still see a negative length";
}

TEST(InferenceAdapterTest, Fp16AndBf16AreWidenedExactly) {
  inference::ModelInferRequest proto;
  // 1.0, -2.5, 65504 (largest half), 2^-24 (smallest subnormal half).
  AddInput(&proto, "queries", "FP16", {1, 1, 4});
  proto.add_raw_input_contents(Bytes(std::vector<uint16_t>{0x3c00, 0xc100, 0x7bff, 0x0001}));
  // 1.0, -2.5, 3.140625 (pi in bf16), 1e38-ish.
  AddInput(&proto, "keys", "BF16", {1, 1, 4});
  proto.add_raw_input_contents(Bytes(std::vector<uint16_t>{0x3f80, 0xc020, 0x4049, 0x7e96}));

  DecodedInferRequest decoded;
  ASSERT_TRUE(DecodeInferRequest(proto, &decoded).ok());
  EXPECT_THAT(decoded.queries.data, ElementsAre(1.0f, -2.5f, 65504.0f, std::ldexp(1.0f, -24)));
  ASSERT_TRUE(decoded.keys.has_value());
  float big;
  const uint32_t big_bits = uint32_t{0x7e96} << 16;
  std::memcpy(&big, &big_bits, sizeof(big));
  EXPECT_THAT(decoded.keys->data, ElementsAre(1.0f, -2.5f, 3.140625f, big));
}

TEST(InferenceAdapterTest, ParametersSetCausalScaleAndWeights) {
  inference::ModelInferRequest proto = RawQueries();
  (*proto.mutable_parameters())["causal"].set_bool_param(true);
  (*proto.mutable_parameters())["scale"].set_double_param(0.25);
  (*proto.mutable_parameters())["return_attention_weights"].set_bool_param(true);
  (*proto.mutable_parameters())["sequence_id"].set_int64_param(3);  // a client's own: ignored

  DecodedInferRequest decoded;
  ASSERT_TRUE(DecodeInferRequest(proto, &decoded).ok());
  EXPECT_TRUE(decoded.request.causal);
  ASSERT_TRUE(decoded.request.scale.has_value());
  EXPECT_EQ(*decoded.request.scale, 0.25f);
  EXPECT_TRUE(decoded.returns_weights);
  EXPECT_TRUE(decoded.request.return_attention_weights);
  EXPECT_TRUE(decoded.returns_output);
}

TEST(InferenceAdapterTest, PositionIdsOfEitherIntegerTypeBecomeInt64HeldByTheRequest) {
  // [B, n_q] in raw INT32, [n_q] in typed INT64.
  inference::ModelInferRequest raw = RawQueries();
  AddInput(&raw, "position_ids", "INT32", {1, 2});
  raw.add_raw_input_contents(Bytes(std::vector<int32_t>{1000, -1}));
  DecodedInferRequest decoded;
  ASSERT_TRUE(DecodeInferRequest(raw, &decoded).ok());
  EXPECT_THAT(decoded.position_ids, ElementsAre(1000, -1)) << "validation sees the sign";
  ASSERT_EQ(decoded.request.position_ids.size(), 2u);
  EXPECT_EQ(decoded.request.position_ids.data(), decoded.position_ids.data())
      << "the request views the decoded copy";

  inference::ModelInferRequest typed;
  InputTensor* queries = AddInput(&typed, "queries", "FP32", {1, 2, 2});
  for (float v : {1.0f, 2.0f, 3.0f, 4.0f}) queries->mutable_contents()->add_fp32_contents(v);
  InputTensor* ids = AddInput(&typed, "position_ids", "INT64", {2});
  for (int64_t id : {int64_t{1} << 33, int64_t{5}}) ids->mutable_contents()->add_int64_contents(id);
  DecodedInferRequest typed_decoded;
  ASSERT_TRUE(DecodeInferRequest(typed, &typed_decoded).ok());
  EXPECT_THAT(typed_decoded.request.position_ids, ElementsAre(int64_t{1} << 33, 5));

  // Grouped heads' queries (B, n_q, H, d): [B, n_q] reads their first two axes.
  inference::ModelInferRequest grouped;
  AddInput(&grouped, "queries", "FP32", {2, 3, 4, 1});
  grouped.add_raw_input_contents(Bytes(std::vector<float>(24, 1.0f)));
  AddInput(&grouped, "position_ids", "INT64", {2, 3});
  grouped.add_raw_input_contents(Bytes(std::vector<int64_t>{0, 1, 2, 3, 4, 5}));
  DecodedInferRequest grouped_decoded;
  ASSERT_TRUE(DecodeInferRequest(grouped, &grouped_decoded).ok());
  EXPECT_EQ(grouped_decoded.request.queries.shape, (std::vector<int64_t>{2, 3, 4, 1}));
  EXPECT_EQ(grouped_decoded.request.position_ids.size(), 6u);
}

TEST(InferenceAdapterTest, ParametersSetSlidingWindowAndSoftcap) {
  inference::ModelInferRequest proto = RawQueries();
  DecodedInferRequest plain;
  ASSERT_TRUE(DecodeInferRequest(proto, &plain).ok());
  EXPECT_FALSE(plain.request.sliding_window.has_value());
  EXPECT_FALSE(plain.request.softcap.has_value());

  (*proto.mutable_parameters())["sliding_window"].set_int64_param(4);
  (*proto.mutable_parameters())["softcap"].set_double_param(30);
  DecodedInferRequest decoded;
  ASSERT_TRUE(DecodeInferRequest(proto, &decoded).ok());
  ASSERT_TRUE(decoded.request.sliding_window.has_value());
  EXPECT_EQ(*decoded.request.sliding_window, 4);
  ASSERT_TRUE(decoded.request.softcap.has_value());
  EXPECT_EQ(*decoded.request.softcap, 30.0f);
  EXPECT_TRUE(IsFloatParameter("softcap"));
  EXPECT_TRUE(IsFloatParameter("scale"));
  EXPECT_FALSE(IsFloatParameter("sliding_window"));
}

TEST(InferenceAdapterTest, RequestedOutputsAreExactlyTheNamedOnes) {
  inference::ModelInferRequest proto = RawQueries();
  proto.add_outputs()->set_name("attention_weights");
  DecodedInferRequest decoded;
  ASSERT_TRUE(DecodeInferRequest(proto, &decoded).ok());
  EXPECT_FALSE(decoded.returns_output);
  EXPECT_TRUE(decoded.returns_weights);
  EXPECT_TRUE(decoded.request.return_attention_weights);
}

TEST(InferenceAdapterTest, ErrorsNameTheTensorOrParameter) {
  struct Fault {
    std::string what;
    std::function<void(inference::ModelInferRequest*)> change;
    std::vector<std::string> message_parts;
  };
  const std::vector<Fault> faults = {
      {"unknown input", [](auto* p) { AddInput(p, "bias", "FP32", {1}); p->add_raw_input_contents(Bytes(std::vector<float>{1})); },
       {"inputs[1] 'bias'", "expected one of 'queries'"}},
      {"repeated input", [](auto* p) { AddInput(p, "queries", "FP32", {1, 2, 2}); p->add_raw_input_contents(Bytes(std::vector<float>{1, 2, 3, 4})); },
       {"inputs[1] 'queries'", "given twice"}},
      {"float datatype", [](auto* p) { p->mutable_inputs(0)->set_datatype("FP64"); },
       {"inputs 'queries'", "expected FP32, FP16 or BF16", "'FP64'"}},
      {"length datatype", [](auto* p) { AddInput(p, "valid_lens", "FP32", {1}); p->add_raw_input_contents(Bytes(std::vector<float>{1})); },
       {"inputs 'valid_lens'", "expected INT32 or INT64", "'FP32'"}},
      {"byte size", [](auto* p) { p->set_raw_input_contents(0, Bytes(std::vector<float>{1, 2, 3})); },
       {"inputs 'queries'", "are 12 bytes", "expected 16"}},
      {"negative size", [](auto* p) { p->mutable_inputs(0)->set_shape(1, -2); },
       {"inputs 'queries'", "expected sizes >= 0", "got -2"}},
      {"overflowing shape", [](auto* p) { for (int axis = 0; axis < 3; ++axis) p->mutable_inputs(0)->set_shape(axis, int64_t{1} << 30); },
       {"inputs 'queries'", "2^40"}},
      {"raw count", [](auto* p) { p->add_raw_input_contents("x"); },
       {"raw_input_contents", "one entry per input (1)", "got 2"}},
      {"raw and typed", [](auto* p) { p->mutable_inputs(0)->mutable_contents()->add_fp32_contents(1); },
       {"inputs 'queries'", "contents", "raw_input_contents"}},
      {"no queries", [](auto* p) { p->mutable_inputs(0)->set_name("keys"); },
       {"inputs", "'queries'", "got none"}},
      {"lengths shape", [](auto* p) { AddInput(p, "valid_lens", "INT32", {2, 1}); p->add_raw_input_contents(Bytes(std::vector<int32_t>{1, 1})); },
       {"inputs 'valid_lens'", "expected [1] or [1, 2]", "got [2, 1]"}},
      {"positions datatype", [](auto* p) { AddInput(p, "position_ids", "FP32", {2}); p->add_raw_input_contents(Bytes(std::vector<float>{0, 1})); },
       {"inputs 'position_ids'", "expected INT32 or INT64", "got 'FP32'"}},
      {"positions shape", [](auto* p) { AddInput(p, "position_ids", "INT64", {2, 1}); p->add_raw_input_contents(Bytes(std::vector<int64_t>{0, 1})); },
       {"inputs 'position_ids'", "expected [2] or [1, 2]", "got [2, 1]"}},
      {"positions rank", [](auto* p) { AddInput(p, "position_ids", "INT32", {1, 2, 1}); p->add_raw_input_contents(Bytes(std::vector<int32_t>{0, 1})); },
       {"inputs 'position_ids'", "shape: expected", "got [1, 2, 1]"}},
      {"positions bytes", [](auto* p) { AddInput(p, "position_ids", "INT64", {2}); p->add_raw_input_contents(Bytes(std::vector<int32_t>{0, 1})); },
       {"inputs 'position_ids'", "are 8 bytes", "expected 16"}},
      {"window type", [](auto* p) { (*p->mutable_parameters())["sliding_window"].set_double_param(4); },
       {"parameters 'sliding_window'", "expected int64_param", "got double_param"}},
      {"softcap type", [](auto* p) { (*p->mutable_parameters())["softcap"].set_int64_param(30); },
       {"parameters 'softcap'", "expected double_param", "got int64_param"}},
      {"causal type", [](auto* p) { (*p->mutable_parameters())["causal"].set_int64_param(1); },
       {"parameters 'causal'", "expected bool_param", "got int64_param"}},
      {"scale type", [](auto* p) { (*p->mutable_parameters())["scale"].set_string_param("0.5"); },
       {"parameters 'scale'", "expected double_param", "got string_param"}},
      {"weights type", [](auto* p) { (*p->mutable_parameters())["return_attention_weights"].set_double_param(1); },
       {"parameters 'return_attention_weights'", "expected bool_param"}},
      {"unknown output", [](auto* p) { p->add_outputs()->set_name("logits"); },
       {"outputs[0] 'logits'", "expected 'output' or 'attention_weights'"}},
      {"repeated output", [](auto* p) { p->add_outputs()->set_name("output"); p->add_outputs()->set_name("output"); },
       {"outputs[1] 'output'", "requested twice"}},
  };
  for (const Fault& fault : faults) {
    inference::ModelInferRequest proto = RawQueries();
    fault.change(&proto);
    const absl::Status status = Decode(proto);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << fault.what << ": " << status;
    for (const std::string& part : fault.message_parts) {
      EXPECT_THAT(std::string(status.message()), HasSubstr(part)) << fault.what;
    }
  }
}

TEST(InferenceAdapterTest, TypedContentsMustMatchTheShapeAndDatatype) {
  inference::ModelInferRequest proto;
  InputTensor* queries = AddInput(&proto, "queries", "FP32", {1, 2, 2});
  for (float v : {1.0f, 2.0f, 3.0f}) queries->mutable_contents()->add_fp32_contents(v);
  absl::Status status = Decode(proto);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(status.message()),
              AllOf(HasSubstr("inputs 'queries'"), HasSubstr("fp32_contents holds 3 values"),
                    HasSubstr("expected 4")));

  queries->set_datatype("FP16");
  status = Decode(proto);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(status.message()),
              AllOf(HasSubstr("inputs 'queries'"), HasSubstr("raw_input_contents")));
}

TEST(InferenceAdapterTest, ResponseEchoesTheIdAndCarriesRawFp32Outputs) {
  inference::ModelInferRequest proto = RawQueries();
  (*proto.mutable_parameters())["return_attention_weights"].set_bool_param(true);
  DecodedInferRequest decoded;
  ASSERT_TRUE(DecodeInferRequest(proto, &decoded).ok());
  AttentionResult result;
  result.output = Tensor{{1, 2, 2}, {0.5f, 1.5f, 2.5f, 3.5f}};
  result.attention_weights = Tensor{{1, 2, 2}, {0.25f, 0.75f, 1.0f, 0.0f}};

  inference::ModelInferResponse response;
  EncodeInferResponse(proto, decoded, result, &response);
  EXPECT_EQ(response.id(), "request-7");
  EXPECT_EQ(response.model_name(), "dot_product");
  EXPECT_EQ(response.model_version(), "1");
  ASSERT_EQ(response.outputs_size(), 2);
  ASSERT_EQ(response.raw_output_contents_size(), 2);
  EXPECT_EQ(response.outputs(0).name(), "output");
  EXPECT_EQ(response.outputs(0).datatype(), "FP32");
  EXPECT_THAT(response.outputs(0).shape(), ElementsAre(1, 2, 2));
  EXPECT_EQ(response.raw_output_contents(0), Bytes(result.output.data));
  EXPECT_EQ(response.outputs(1).name(), "attention_weights");
  EXPECT_EQ(response.raw_output_contents(1), Bytes(result.attention_weights.data));
}

TEST(InferenceAdapterTest, MetadataMarksSizesTheRequestChooses) {
  Model mha;
  mha.name = "mha";
  mha.kind = Kind::kMultiHead;
  mha.num_heads = 4;
  mha.query_size = 8;
  mha.key_size = 6;
  mha.value_size = 5;
  mha.output_size = 16;
  const inference::ModelMetadataResponse metadata = ToModelMetadata(mha);
  EXPECT_EQ(metadata.name(), "mha");
  EXPECT_THAT(metadata.versions(), ElementsAre("1"));
  ASSERT_EQ(metadata.inputs_size(), 4);
  EXPECT_EQ(metadata.inputs(0).name(), "queries");
  EXPECT_THAT(metadata.inputs(0).shape(), ElementsAre(-1, -1, 8));
  EXPECT_THAT(metadata.inputs(1).shape(), ElementsAre(-1, -1, 6));
  EXPECT_THAT(metadata.inputs(2).shape(), ElementsAre(-1, -1, 5));
  EXPECT_EQ(metadata.inputs(3).datatype(), "INT32");
  ASSERT_EQ(metadata.outputs_size(), 2);
  EXPECT_THAT(metadata.outputs(0).shape(), ElementsAre(-1, -1, 16));
  EXPECT_THAT(metadata.outputs(1).shape(), ElementsAre(-1, 4, -1, -1));
  EXPECT_EQ(metadata.properties().at("precision"), "fp32");
  mha.precision = Precision::kBf16;
  EXPECT_EQ(ToModelMetadata(mha).properties().at("precision"), "bf16");
  EXPECT_EQ(ToModelConfig(mha).parameters().at("precision").string_value(), "bf16");
  EXPECT_EQ(metadata.properties().at("kv_cache_dtype"), "float32");
  mha.kv_cache_dtype = KvDtype::kFloat16;
  EXPECT_EQ(ToModelMetadata(mha).properties().at("kv_cache_dtype"), "float16");
  EXPECT_EQ(ToModelConfig(mha).parameters().at("kv_cache_dtype").string_value(), "float16");

  const inference::ModelConfig config = ToModelConfig(DotProductModel());
  EXPECT_EQ(config.name(), "dot_product");
  EXPECT_EQ(config.max_batch_size(), 0);
  ASSERT_EQ(config.input_size(), 4);
  EXPECT_FALSE(config.input(0).optional());
  EXPECT_TRUE(config.input(1).optional());
  EXPECT_EQ(config.input(0).data_type(), inference::TYPE_FP32);
  EXPECT_THAT(config.input(0).dims(), ElementsAre(-1, -1, -1));
  EXPECT_EQ(config.input(3).data_type(), inference::TYPE_INT32);
  ASSERT_EQ(config.output_size(), 2);
  EXPECT_THAT(config.output(1).dims(), ElementsAre(-1, -1, -1));
  EXPECT_EQ(config.parameters().at("precision").string_value(), "fp32");
  EXPECT_FALSE(config.parameters().contains("num_kv_heads")) << "dot_product has no heads";
}

TEST(InferenceAdapterTest, MetadataAndConfigDescribeTheLayer) {
  Model layer;
  layer.name = "qwen";
  layer.kind = Kind::kMultiHead;
  layer.num_heads = 4;
  layer.num_kv_heads = 2;
  layer.head_size = 16;
  layer.query_size = 48;
  layer.output_size = 48;
  layer.terms.rotary.dims = 16;
  layer.terms.rotary.type = "yarn";
  layer.terms.rotary.theta = 1000000;
  layer.terms.sliding_window = 5;
  layer.terms.softcap = 30.5f;
  const inference::ModelMetadataResponse metadata = ToModelMetadata(layer);
  const auto& properties = metadata.properties();
  EXPECT_EQ(properties.at("num_heads"), "4");
  EXPECT_EQ(properties.at("num_kv_heads"), "2");
  EXPECT_EQ(properties.at("head_dim"), "16");
  EXPECT_EQ(properties.at("rope_type"), "yarn");
  EXPECT_EQ(properties.at("rope_theta"), "1000000");
  EXPECT_EQ(properties.at("rope_interleaved"), "false");
  EXPECT_EQ(properties.at("rotary_dim"), "16");
  EXPECT_EQ(properties.at("sliding_window"), "5");
  EXPECT_EQ(properties.at("softcap"), "30.5");
  EXPECT_EQ(properties.at("alibi"), "false");
  // A layer with rotary positions takes them as an optional input.
  ASSERT_EQ(metadata.inputs_size(), 5);
  EXPECT_EQ(metadata.inputs(4).name(), "position_ids");
  EXPECT_EQ(metadata.inputs(4).datatype(), "INT64");
  const inference::ModelConfig config = ToModelConfig(layer);
  for (const auto& [name, value] : properties) {
    if (name == "kind") continue;  // metadata's only
    ASSERT_TRUE(config.parameters().contains(name)) << name;
    EXPECT_EQ(config.parameters().at(name).string_value(), value) << name;
  }
  ASSERT_EQ(config.input_size(), 5);
  EXPECT_EQ(config.input(4).data_type(), inference::TYPE_INT64);
  EXPECT_TRUE(config.input(4).optional());

  // The older layouts read no positions: no such input, no rotary.
  Model mha = layer;
  mha.num_kv_heads = 0;
  mha.head_size = 0;
  mha.terms = LayerTerms();
  const inference::ModelMetadataResponse plain = ToModelMetadata(mha);
  EXPECT_EQ(plain.inputs_size(), 4);
  EXPECT_EQ(plain.properties().at("num_kv_heads"), "4");
  EXPECT_EQ(plain.properties().at("head_dim"), "12");
  EXPECT_EQ(plain.properties().at("rope_type"), "");
  EXPECT_FALSE(plain.properties().contains("rope_theta"));
}

// Requests from the network are untrusted: any bytes that parse as a
// ModelInferRequest decode to a request (then validated by core) or to
// INVALID_ARGUMENT, never to a crash or another code. Run under ASan by
// scripts/sanitize.sh.
TEST(InferenceAdapterTest, MutatedRequestsDecodeOrAreRefused) {
  inference::ModelInferRequest proto = RawQueries();
  AddInput(&proto, "valid_lens", "INT64", {1, 2});
  proto.add_raw_input_contents(Bytes(std::vector<int64_t>{1, 2}));
  AddInput(&proto, "keys", "FP16", {1, 3, 2});
  proto.add_raw_input_contents(Bytes(std::vector<uint16_t>{0x3c00, 0, 0x3c00, 0, 0, 0x3c00}));
  (*proto.mutable_parameters())["scale"].set_double_param(0.5);
  proto.add_outputs()->set_name("attention_weights");
  const std::string wire = proto.SerializeAsString();

  std::mt19937 random(15);
  int decoded_ok = 0;
  int refused = 0;
  for (int round = 0; round < 20000; ++round) {
    std::string mutated = wire;
    const int flips = 1 + static_cast<int>(random() % 4);
    for (int i = 0; i < flips; ++i) {
      mutated[random() % mutated.size()] = static_cast<char>(random() % 256);
    }
    inference::ModelInferRequest parsed;
    if (!parsed.ParseFromString(mutated)) continue;
    DecodedInferRequest decoded;
    const absl::Status status = DecodeInferRequest(parsed, &decoded);
    if (!status.ok()) {
      ASSERT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
      ++refused;
      continue;
    }
    ++decoded_ok;
    const absl::StatusOr<AttentionDims> dims = Validate(DotProductModel(), decoded.request);
    if (!dims.ok()) {
      EXPECT_EQ(dims.status().code(), absl::StatusCode::kInvalidArgument) << dims.status();
    }
  }
  EXPECT_GT(decoded_ok, 0) << "some mutations keep the request valid";
  EXPECT_GT(refused, 0) << "some mutations break it";
}

}  // namespace
}  // namespace attention::server
