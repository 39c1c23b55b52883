// server_batching_test.cc: 64 concurrent clients with random shapes get
// exactly the answer the engine gives each request alone, the server really
// merged requests (batch size histogram), and /metrics counts every call.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "core/engine/engine.h"
#include "core/model/model_loader.h"
#include "server/api/attention/attention_adapter.h"
#include "tests/support/metrics.h"
#include "tests/support/requests.h"
#include "tests/support/server_process.h"

namespace attention::testing {
namespace {

constexpr int kClients = 64;
constexpr int kRequestsPerClient = 6;
// A repository model, so projections and heads are part of the batches too.
constexpr char kMultiHeadModel[] = "mh_torch_small";  // d = 16

void Fill(v1::Tensor* tensor, std::vector<int64_t> shape, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  int64_t size = 1;
  for (int64_t d : shape) {
    tensor->add_shape(d);
    size *= d;
  }
  for (int64_t i = 0; i < size; ++i) tensor->add_data(normal(rng));
}

// A random valid request for `model` (dot_product: any d; the multi-head
// model: d = 16), with random lengths, masks and flags.
v1::AttendRequest RandomRequest(const std::string& model, std::mt19937& rng) {
  auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  const int b = pick(1, 3), n_q = pick(1, 9), n_k = pick(1, 9);
  const int d = model == "dot_product" ? pick(1, 24) : 16;
  v1::AttendRequest request;
  request.set_model(model);
  Fill(request.mutable_queries(), {b, n_q, d}, rng);
  if (pick(0, 3) > 0) {
    Fill(request.mutable_keys(), {b, n_k, d}, rng);
    Fill(request.mutable_values(), {b, n_k, model == "dot_product" ? pick(1, 24) : 16}, rng);
  }
  const int lengths = pick(0, 2);  // none, per example, per query
  const int keys = request.has_keys() ? n_k : n_q;
  const int count = lengths == 0 ? 0 : (lengths == 1 ? b : b * n_q);
  for (int i = 0; i < count; ++i) request.add_valid_lens(pick(0, keys + 1));
  request.set_causal(pick(0, 1) == 1);
  request.set_return_attention_weights(pick(0, 1) == 1);
  if (model == "dot_product" && pick(0, 3) == 0) request.set_scale(0.3f);
  return request;
}

float MaxAbsDiff(const v1::Tensor& actual, const Tensor& expected) {
  if (std::vector<int64_t>(actual.shape().begin(), actual.shape().end()) != expected.shape ||
      actual.data_size() != static_cast<int>(expected.data.size())) {
    return INFINITY;
  }
  float diff = 0;
  for (size_t i = 0; i < expected.data.size(); ++i) {
    diff = std::max(diff, std::abs(actual.data(static_cast<int>(i)) - expected.data[i]));
  }
  return diff;
}

class ServerBatchingTest : public ::testing::Test {
 protected:
  // --inline-work 0: these requests are small enough to be computed on the
  // receiving thread whenever their batcher is idle, and this test is about
  // the ones merged.
  void SetUp() override {
    auto started = ServerProcess::Start(
        {"--model-repository", (ConformanceDir() / "models").string(), "--max-batch-size", "16",
         "--max-queue-delay-us", "2000", "--inline-work", "0"});
    ASSERT_TRUE(started.ok()) << started.status();
    server_ = *std::move(started);
  }
  void TearDown() override {
    if (server_) {
      EXPECT_EQ(server_->Stop(), 0) << server_->Log();
    }
  }

  std::unique_ptr<ServerProcess> server_;
};

TEST_F(ServerBatchingTest, ConcurrentClientsGetTheirUnbatchedAnswers) {
  auto multi_head = LoadModel(ConformanceDir() / "models" / (std::string(kMultiHeadModel) +
                                                            ".safetensors"));
  ASSERT_TRUE(multi_head.ok()) << multi_head.status();
  const Model dot_product = DotProductModel();
  Engine engine(EngineOptions{.num_threads = 1});

  std::atomic<int> ok_calls[2] = {0, 0};  // dot_product, multi-head
  std::vector<std::string> failures(kClients);
  std::vector<std::thread> clients;
  auto channel = server_->Channel();
  for (int c = 0; c < kClients; ++c) {
    clients.emplace_back([&, c] {
      std::mt19937 rng(1000 + c);
      auto stub = v1::AttentionService::NewStub(channel);
      for (int r = 0; r < kRequestsPerClient; ++r) {
        const bool use_multi_head = (c + r) % 2 == 1;
        const v1::AttendRequest request =
            RandomRequest(use_multi_head ? kMultiHeadModel : "dot_product", rng);
        grpc::ClientContext context;
        v1::AttendResponse response;
        const grpc::Status status = stub->Attend(&context, request, &response);
        if (!status.ok()) {
          failures[c] = CodeName(status.error_code()) + ": " + status.error_message();
          return;
        }
        ++ok_calls[use_multi_head ? 1 : 0];
        auto alone = engine.Attend(use_multi_head ? *multi_head : dot_product,
                                   server::ToAttentionRequest(request));
        if (!alone.ok()) {
          failures[c] = "in-process: " + std::string(alone.status().message());
          return;
        }
        float diff = MaxAbsDiff(response.output(), alone->output);
        if (request.return_attention_weights()) {
          diff = std::max(diff, MaxAbsDiff(response.attention_weights(), alone->attention_weights));
        } else if (response.has_attention_weights()) {
          diff = INFINITY;
        }
        if (!(diff <= 1e-5f)) {
          failures[c] = "client " + std::to_string(c) + " request " + std::to_string(r) +
                        ": max abs diff " + std::to_string(diff);
          return;
        }
      }
    });
  }
  for (auto& client : clients) client.join();
  for (const std::string& failure : failures) EXPECT_EQ(failure, "");

  const std::string metrics = ScrapeMetrics(server_->metrics_address());
  ASSERT_FALSE(metrics.empty());
  for (const auto& [model, calls] :
       {std::pair<std::string, int>{"dot_product", ok_calls[0].load()},
        std::pair<std::string, int>{kMultiHeadModel, ok_calls[1].load()}}) {
    SCOPED_TRACE(model);
    EXPECT_EQ(calls, kClients * kRequestsPerClient / 2);
    EXPECT_EQ(MetricValue(metrics, "attention_requests_total", {{"model", model}, {"code", "OK"}}),
              calls);
    // Every computed request is in exactly one batch.
    EXPECT_EQ(MetricValue(metrics, "attention_batch_size_sum", {{"model", model}}), calls);
    const std::optional<double> batches =
        MetricValue(metrics, "attention_batch_size_count", {{"model", model}});
    const std::optional<double> single =
        MetricValue(metrics, "attention_batch_size_bucket", {{"model", model}, {"le", "1"}});
    ASSERT_TRUE(batches.has_value() && single.has_value()) << metrics;
    EXPECT_GT(*batches - *single, 0) << "no batch held more than one request";
    EXPECT_LT(*batches, calls) << "requests were never merged";
  }
}

TEST_F(ServerBatchingTest, MetricsCountEveryCallByModelAndCode) {
  auto stub = server_->Stub();
  std::mt19937 rng(7);
  auto call = [&](const v1::AttendRequest& request) {
    grpc::ClientContext context;
    v1::AttendResponse response;
    return stub->Attend(&context, request, &response).error_code();
  };
  const int ok = 5, invalid = 3, unknown = 2;
  for (int i = 0; i < ok; ++i) ASSERT_EQ(call(RandomRequest("distance", rng)), grpc::StatusCode::OK);
  for (int i = 0; i < invalid; ++i) {
    v1::AttendRequest request = RandomRequest("distance", rng);
    request.mutable_queries()->add_data(1.0f);  // one value more than the shape holds
    ASSERT_EQ(call(request), grpc::StatusCode::INVALID_ARGUMENT);
  }
  for (int i = 0; i < unknown; ++i) {
    v1::AttendRequest request = RandomRequest("distance", rng);
    request.set_model("no_such_model_" + std::to_string(i));
    ASSERT_EQ(call(request), grpc::StatusCode::NOT_FOUND);
  }

  const std::string metrics = ScrapeMetrics(server_->metrics_address());
  EXPECT_EQ(MetricValue(metrics, "attention_requests_total", {{"model", "distance"}, {"code", "OK"}}),
            ok);
  EXPECT_EQ(MetricValue(metrics, "attention_requests_total",
                        {{"model", "distance"}, {"code", "INVALID_ARGUMENT"}}),
            invalid);
  // Unknown names share the empty model label: clients cannot mint series.
  EXPECT_EQ(MetricValue(metrics, "attention_requests_total", {{"code", "NOT_FOUND"}}), unknown);
  EXPECT_EQ(metrics.find("no_such_model"), std::string::npos);
  EXPECT_EQ(MetricValue(metrics, "attention_request_duration_seconds_count", {{"model", "distance"}}),
            ok + invalid);
  EXPECT_EQ(MetricValue(metrics, "attention_queue_duration_seconds_count", {{"model", "distance"}}),
            ok);
  EXPECT_EQ(
      MetricValue(metrics, "attention_compute_duration_seconds_count", {{"model", "distance"}}), ok);
  EXPECT_EQ(MetricValue(metrics, "attention_queue_depth", {{"model", "distance"}}), 0);
  EXPECT_EQ(MetricValue(metrics, "attention_inflight_requests"), 0);
  // Durations are in seconds: small requests on an idle server take well
  // under 1 s each, and at least half of them under 100 ms (a microsecond or
  // millisecond slip puts them far above).
  for (const char* histogram : {"attention_request_duration_seconds",
                                "attention_queue_duration_seconds",
                                "attention_compute_duration_seconds"}) {
    const std::string name = histogram;
    const std::optional<double> count = MetricValue(metrics, name + "_count", {{"model", "distance"}});
    const std::optional<double> sum = MetricValue(metrics, name + "_sum", {{"model", "distance"}});
    const std::optional<double> fast =
        MetricValue(metrics, name + "_bucket", {{"model", "distance"}, {"le", "0.1"}});
    ASSERT_TRUE(count.has_value() && sum.has_value() && fast.has_value()) << name;
    EXPECT_GE(*sum, 0) << name;
    EXPECT_LT(*sum, *count * 1.0) << name << ": a mean of 1 s or more";
    EXPECT_GE(*fast, *count / 2) << name << ": most took more than 100 ms";
  }
  EXPECT_GT(MetricValue(metrics, "attention_compute_duration_seconds_sum", {{"model", "distance"}}),
            0)
      << "computing took no time";
  // The duration histograms span 50 us to 10 s.
  EXPECT_NE(metrics.find("attention_request_duration_seconds_bucket{model=\"distance\",le=\"5e-05\"}"),
            std::string::npos);
  EXPECT_NE(metrics.find("attention_request_duration_seconds_bucket{model=\"distance\",le=\"10\"}"),
            std::string::npos);
}

// More engine threads than the machine has cores (CI machines have 2): the
// answers of concurrent calls are still each their own, and right.
TEST(ServerThreadsTest, MoreEngineThreadsThanCoresAnswerRight) {
  const int threads = 4 * static_cast<int>(std::max(2u, std::thread::hardware_concurrency()));
  auto server = ServerProcess::Start(
      {"--threads", std::to_string(threads), "--max-batch-size", "4", "--max-queue-delay-us", "2000"});
  ASSERT_TRUE(server.ok()) << server.status();
  constexpr int kClients = 16, kCallsPerClient = 8;
  std::vector<std::string> wrong(kClients);
  std::vector<std::thread> clients;
  for (int c = 0; c < kClients; ++c) {
    clients.emplace_back([&, c] {
      auto stub = (*server)->Stub();
      for (int i = 0; i < kCallsPerClient && wrong[c].empty(); ++i) {
        // Sizes vary so batches are ragged and split across the threads.
        const v1::AttendRequest request =
            SelfAttentionRequest(1 + (c + i) % 3, 8 + 16 * ((c * 7 + i) % 5), 16, c * 100 + i);
        grpc::ClientContext context;
        v1::AttendResponse response;
        const grpc::Status status = stub->Attend(&context, request, &response);
        wrong[c] = status.ok() ? CheckAnswer(request, response) : status.error_message();
      }
    });
  }
  for (std::thread& client : clients) client.join();
  EXPECT_THAT(wrong, ::testing::Each(""));
  EXPECT_THAT((*server)->Log(), ::testing::HasSubstr("engine threads " + std::to_string(threads)));
  EXPECT_EQ((*server)->Stop(), 0) << (*server)->Log();
}

}  // namespace
}  // namespace attention::testing
