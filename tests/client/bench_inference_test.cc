// client_bench_inference_test.cc: `attention-client bench --api inference`:
// the AttendRequest -> ModelInferRequest restatement, and a load run against
// a real attention-server that must reach it as ModelInfer calls only.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "client/cpp/attention_client.h"
#include "client/cli/bench_report.h"
#include "client/cli/inference_request.h"
#include "client/cli/load_generator.h"
#include "nlohmann/json.hpp"
#include "tests/support/metrics.h"
#include "tests/support/server_process.h"

namespace attention::client {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

template <typename T>
std::vector<T> FromBytes(const std::string& bytes) {
  std::vector<T> values(bytes.size() / sizeof(T));
  std::memcpy(values.data(), bytes.data(), values.size() * sizeof(T));
  return values;
}

attention::v1::AttendRequest Request() {
  attention::v1::AttendRequest request;
  request.set_model("dot_product");
  request.set_request_id("bench");
  for (int64_t s : {1, 2, 2}) request.mutable_queries()->add_shape(s);
  for (float v : {1.0f, 2.0f, 3.0f, 4.0f}) request.mutable_queries()->add_data(v);
  for (int64_t s : {1, 2, 1}) request.mutable_values()->add_shape(s);
  for (float v : {5.0f, 6.0f}) request.mutable_values()->add_data(v);
  request.add_valid_lens(1);
  return request;
}

TEST(BenchInferenceTest, ModelInferRequestCarriesTheSameTensorsAndOptions) {
  attention::v1::AttendRequest attend = Request();
  attend.set_causal(true);
  attend.set_scale(0.5f);
  attend.set_return_attention_weights(true);
  const inference::ModelInferRequest infer = ToModelInferRequest(attend);
  EXPECT_EQ(infer.model_name(), "dot_product");
  EXPECT_EQ(infer.id(), "bench");
  ASSERT_EQ(infer.inputs_size(), 3);
  ASSERT_EQ(infer.raw_input_contents_size(), 3);
  EXPECT_EQ(infer.inputs(0).name(), "queries");
  EXPECT_EQ(infer.inputs(0).datatype(), "FP32");
  EXPECT_THAT(infer.inputs(0).shape(), ElementsAre(1, 2, 2));
  EXPECT_THAT(FromBytes<float>(infer.raw_input_contents(0)), ElementsAre(1, 2, 3, 4));
  EXPECT_EQ(infer.inputs(1).name(), "values") << "absent keys stay absent (keys = queries)";
  EXPECT_THAT(FromBytes<float>(infer.raw_input_contents(1)), ElementsAre(5, 6));
  EXPECT_EQ(infer.inputs(2).name(), "valid_lens");
  EXPECT_EQ(infer.inputs(2).datatype(), "INT32");
  EXPECT_THAT(FromBytes<int32_t>(infer.raw_input_contents(2)), ElementsAre(1));
  EXPECT_TRUE(infer.parameters().at("causal").bool_param());
  EXPECT_EQ(infer.parameters().at("scale").double_param(), 0.5);
  EXPECT_TRUE(infer.parameters().at("return_attention_weights").bool_param());

  const inference::ModelInferRequest plain = ToModelInferRequest(Request());
  EXPECT_TRUE(plain.parameters().empty()) << "defaults add no parameters";
}

TEST(BenchInferenceTest, PositionsWindowAndSoftcapBecomeAnInputAndParameters) {
  attention::v1::AttendRequest attend = Request();  // queries (1, 2, 2)
  for (int64_t id : {int64_t{1} << 40, int64_t{3}}) attend.add_position_ids(id);
  attend.set_sliding_window(0);
  attend.set_softcap(30.0f);
  const inference::ModelInferRequest infer = ToModelInferRequest(attend);
  ASSERT_EQ(infer.inputs_size(), 4);
  ASSERT_EQ(infer.raw_input_contents_size(), 4);
  EXPECT_EQ(infer.inputs(3).name(), "position_ids");
  EXPECT_EQ(infer.inputs(3).datatype(), "INT64");
  EXPECT_THAT(infer.inputs(3).shape(), ElementsAre(1, 2)) << "one per query: [B, n_q]";
  EXPECT_THAT(FromBytes<int64_t>(infer.raw_input_contents(3)), ElementsAre(int64_t{1} << 40, 3));
  ASSERT_TRUE(infer.parameters().contains("sliding_window")) << "0 is a value, not absence";
  EXPECT_EQ(infer.parameters().at("sliding_window").int64_param(), 0);
  EXPECT_EQ(infer.parameters().at("softcap").double_param(), 30.0);

  // n_q entries for every example of a batch of two: [n_q].
  attention::v1::AttendRequest batch = Request();
  batch.mutable_queries()->set_shape(0, 2);
  batch.mutable_queries()->set_shape(1, 1);
  batch.add_position_ids(5);
  EXPECT_THAT(ToModelInferRequest(batch).inputs(3).shape(), ElementsAre(1));
}

TEST(BenchInferenceTest, LoadReachesTheServerAsModelInferCalls) {
  auto server = attention::testing::ServerProcess::Start({});
  ASSERT_TRUE(server.ok()) << server.status();
  ClientOptions options;
  options.target = (*server)->address();
  absl::StatusOr<std::unique_ptr<AttentionClient>> client = AttentionClient::Create(options);
  ASSERT_TRUE(client.ok()) << client.status();

  const inference::ModelInferRequest request = ToModelInferRequest(Request());
  const LoadOptions load{.concurrency = 2, .warmup = absl::ZeroDuration(),
                         .duration = absl::Milliseconds(300)};
  LoadGenerator generator(**client, request, load);
  const LoadResult result = generator.Run({});
  EXPECT_GT(result.requests, 0);
  EXPECT_EQ(result.errors, 0);

  const std::string metrics = attention::testing::ScrapeMetrics((*server)->metrics_address());
  EXPECT_GE(attention::testing::MetricValue(metrics, "attention_api_requests_total",
                                            {{"api", "inference"}, {"code", "OK"}}),
            static_cast<double>(result.requests));
  EXPECT_EQ(attention::testing::MetricValue(metrics, "attention_api_requests_total",
                                            {{"api", "attention"}}),
            0);

  const BenchSetup setup{.target = options.target, .model = "dot_product", .api = "inference",
                         .load = load};
  EXPECT_EQ(nlohmann::json::parse(FormatJson(setup, result))["api"], "inference");
  EXPECT_THAT(FormatReport(setup, result), HasSubstr("api          inference"));
  client->reset();
  EXPECT_EQ((*server)->Stop(), 0) << (*server)->Log();
}

}  // namespace
}  // namespace attention::client
