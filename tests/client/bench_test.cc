// client_bench_test.cc: the parts of `bench` that need no server: latency
// percentiles, the generated request, load option checks and the reports.
#include <numeric>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "client/cli/bench_report.h"
#include "client/cli/latency_summary.h"
#include "client/cli/load_generator.h"
#include "client/cli/request_generator.h"

namespace attention::client {
namespace {

using ::testing::HasSubstr;

TEST(LatencySummaryTest, NearestRankOfShuffledSamples) {
  // 1..200 ms in a scrambled order: the p-th percentile by nearest rank is
  // the ceil(p * 200 / 100)-th smallest, i.e. 2p ms.
  std::vector<int64_t> samples(200);
  for (int i = 0; i < 200; ++i) samples[i] = int64_t{(i * 37) % 200 + 1} * 1'000'000;
  const LatencySummary s = Summarize(samples);
  EXPECT_DOUBLE_EQ(s.p50_ms, 100);
  EXPECT_DOUBLE_EQ(s.p90_ms, 180);
  EXPECT_DOUBLE_EQ(s.p95_ms, 190);
  EXPECT_DOUBLE_EQ(s.p99_ms, 198);
  EXPECT_DOUBLE_EQ(s.max_ms, 200);
}

TEST(LatencySummaryTest, OneSampleIsEveryPercentileAndNoneIsZero) {
  std::vector<int64_t> one = {2'500'000};
  const LatencySummary s = Summarize(one);
  EXPECT_DOUBLE_EQ(s.p50_ms, 2.5);
  EXPECT_DOUBLE_EQ(s.max_ms, 2.5);
  std::vector<int64_t> none;
  EXPECT_DOUBLE_EQ(Summarize(none).p99_ms, 0);
}

TEST(RequestGeneratorTest, BuiltInTakesDimForEverySize) {
  attention::v1::ModelInfo dot_product;
  dot_product.set_name("dot_product");
  absl::StatusOr<attention::v1::AttendRequest> request = GenerateRequest(
      {.model = "dot_product", .batch = 3, .n = 5, .dim = 7, .causal = true}, dot_product);
  ASSERT_TRUE(request.ok()) << request.status();
  EXPECT_EQ(request->model(), "dot_product");
  EXPECT_TRUE(request->causal());
  for (const attention::v1::Tensor* t :
       {&request->queries(), &request->keys(), &request->values()}) {
    EXPECT_THAT(t->shape(), ::testing::ElementsAre(3, 5, 7));
    EXPECT_EQ(t->data_size(), 3 * 5 * 7);
  }
}

TEST(RequestGeneratorTest, RepositoryModelSizesWin) {
  attention::v1::ModelInfo mixed;
  mixed.set_query_size(10);
  mixed.set_key_size(7);
  mixed.set_value_size(5);
  absl::StatusOr<attention::v1::AttendRequest> request =
      GenerateRequest({.model = "mh_d2l_mixed", .batch = 2, .n = 4, .dim = 64}, mixed);
  ASSERT_TRUE(request.ok()) << request.status();
  EXPECT_THAT(request->queries().shape(), ::testing::ElementsAre(2, 4, 10));
  EXPECT_THAT(request->keys().shape(), ::testing::ElementsAre(2, 4, 7));
  EXPECT_THAT(request->values().shape(), ::testing::ElementsAre(2, 4, 5));
}

TEST(RequestGeneratorTest, SameShapeSameData) {
  const attention::v1::ModelInfo any;
  absl::StatusOr<attention::v1::AttendRequest> a = GenerateRequest({.n = 3, .dim = 2}, any);
  absl::StatusOr<attention::v1::AttendRequest> b = GenerateRequest({.n = 3, .dim = 2}, any);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->SerializeAsString(), b->SerializeAsString());
  // Random normal values, not a constant fill.
  EXPECT_NE(a->queries().data(0), a->queries().data(1));
}

TEST(RequestGeneratorTest, SelfAttentionSendsQueriesOnly) {
  attention::v1::ModelInfo torch_layout;
  torch_layout.set_query_size(16);
  torch_layout.set_key_size(16);
  torch_layout.set_value_size(16);
  absl::StatusOr<attention::v1::AttendRequest> request = GenerateRequest(
      {.model = "mh", .batch = 1, .n = 1, .dim = 64, .self_attention = true}, torch_layout);
  ASSERT_TRUE(request.ok()) << request.status();
  EXPECT_THAT(request->queries().shape(), ::testing::ElementsAre(1, 1, 16));
  EXPECT_EQ(request->queries().data_size(), 16);
  // Absent, not empty: the server reads an absent message as "use the queries".
  EXPECT_FALSE(request->has_keys());
  EXPECT_FALSE(request->has_values());
}

TEST(RequestGeneratorTest, SelfAttentionNeedsEqualInputSizes) {
  attention::v1::ModelInfo kv_dims;
  kv_dims.set_query_size(64);
  kv_dims.set_key_size(32);
  kv_dims.set_value_size(48);
  absl::StatusOr<attention::v1::AttendRequest> request =
      GenerateRequest({.model = "mh_kv", .self_attention = true}, kv_dims);
  EXPECT_EQ(request.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(request.status().message(),
              HasSubstr("--self-attention: model 'mh_kv' takes inputs of different sizes "
                        "(d_q 64, d_k 32, d_v 48)"));
}

TEST(RequestGeneratorTest, BadSizesAreNamed) {
  const attention::v1::ModelInfo any;
  EXPECT_THAT(GenerateRequest({.batch = 0}, any).status().message(),
              HasSubstr("--batch must be 1..268435456; was 0"));
  EXPECT_THAT(GenerateRequest({.n = -4}, any).status().message(), HasSubstr("--n must be"));
  absl::StatusOr<attention::v1::AttendRequest> huge =
      GenerateRequest({.batch = 1 << 14, .n = 1 << 14, .dim = 2}, any);
  EXPECT_EQ(huge.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(huge.status().message(), HasSubstr("above the limit"));
}

TEST(LoadOptionsTest, ValidateNamesTheBadOption) {
  EXPECT_TRUE(LoadGenerator::Validate({}).ok());
  EXPECT_TRUE(LoadGenerator::Validate({.concurrency = 0, .rate_rps = 10}).ok());
  EXPECT_THAT(LoadGenerator::Validate({.concurrency = 0}).message(),
              HasSubstr("concurrency must be >= 1; was 0"));
  EXPECT_THAT(LoadGenerator::Validate({.rate_rps = -1}).message(), HasSubstr("rate must be >= 0"));
  EXPECT_THAT(LoadGenerator::Validate({.duration = absl::ZeroDuration()}).message(),
              HasSubstr("duration must be positive"));
  EXPECT_THAT(LoadGenerator::Validate({.warmup = absl::Seconds(-1)}).message(),
              HasSubstr("warmup must be >= 0"));
  EXPECT_TRUE(LoadGenerator::Validate({.rate_rps = 10, .max_in_flight = 4}).ok());
  EXPECT_THAT(LoadGenerator::Validate({.rate_rps = 10, .max_in_flight = -1}).message(),
              HasSubstr("max in flight must be >= 0; was -1"));
  EXPECT_THAT(LoadGenerator::Validate({.max_in_flight = 4}).message(),
              HasSubstr("open loop (rate > 0) only"));
}

TEST(BenchReportTest, JsonHasTheDocumentedKeys) {
  const BenchSetup setup{.target = "127.0.0.1:1", .model = "dot_product",
                         .load = {.concurrency = 4, .duration = absl::Seconds(2)}};
  LoadResult result;
  result.requests = 10;
  result.errors = 3;
  result.errors_by_code = {{absl::StatusCode::kUnavailable, 2},
                           {absl::StatusCode::kInvalidArgument, 1}};
  result.throughput_rps = 3.5;
  result.latency = {.p50_ms = 1, .p90_ms = 2, .p95_ms = 3, .p99_ms = 4, .max_ms = 5};
  const nlohmann::json json = nlohmann::json::parse(FormatJson(setup, result));
  EXPECT_EQ(json["requests"], 10);
  EXPECT_EQ(json["errors"], 3);
  EXPECT_EQ(json["errors_by_code"]["UNAVAILABLE"], 2);
  EXPECT_EQ(json["errors_by_code"]["INVALID_ARGUMENT"], 1);
  EXPECT_EQ(json["throughput_rps"], 3.5);
  EXPECT_EQ(json["latency_ms"], nlohmann::json::parse(
                                    R"({"p50": 1, "p90": 2, "p95": 3, "p99": 4, "max": 5})"));
  EXPECT_EQ(json["concurrency"], 4);
  EXPECT_FALSE(json.contains("rate_rps"));

  const std::string report = FormatReport(setup, result);
  EXPECT_THAT(report, HasSubstr("closed loop at concurrency 4"));
  EXPECT_THAT(report, HasSubstr("INVALID_ARGUMENT 1, UNAVAILABLE 2"));
}

}  // namespace
}  // namespace attention::client
