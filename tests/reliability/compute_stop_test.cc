// compute_stop_test.cc: a request whose deadline passes, or whose caller
// cancels, while the engine computes it stops costing CPU within
// milliseconds, and the request batched with it is answered right
// (docs/api.md section 3). Without it, a budget-sized request would hold the
// engine for its whole computation whatever its deadline.
//
// The engine time is read from the server's own metrics: the batch's
// attention_compute_duration_seconds, observed once per request of it.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <iostream>
#include <memory>
#include <string>
#include <thread>

#include "tests/support/metrics.h"
#include "tests/support/requests.h"
#include "tests/support/server_process.h"

namespace attention::testing {
namespace {

using std::chrono::milliseconds;

// dot_product self-attention over (1, 30000, 1) queries: 1.6e10 work units,
// just under the default budget (2^34), about a second of one core or more.
v1::AttendRequest BudgetSized() {
  v1::AttendRequest request;
  request.set_model("dot_product");
  request.set_request_id("budget-sized");
  request.mutable_queries()->add_shape(1);
  request.mutable_queries()->add_shape(30000);
  request.mutable_queries()->add_shape(1);
  for (int i = 0; i < 30000; ++i) request.mutable_queries()->add_data(0.001f * (i % 1000));
  return request;
}

class ComputeStopTest : public ::testing::Test {
 protected:
  void SetUp() override {
    // One engine thread; a batch forms once two requests are queued (the
    // fixed delay: an idle model would run the first one alone).
    auto started = ServerProcess::Start({"--threads", "1", "--max-batch-size", "2",
                                         "--batching-delay", "fixed",
                                         "--max-queue-delay-us", "10000000"});
    ASSERT_TRUE(started.ok()) << started.status();
    server_ = *std::move(started);
    stub_ = server_->Stub();
  }
  void TearDown() override {
    stub_.reset();
    if (server_) {
      EXPECT_EQ(server_->Stop(), 0) << server_->Log();
    }
  }

  double Metric(const std::string& name, std::map<std::string, std::string> labels = {}) {
    labels["model"] = "dot_product";
    return MetricValue(ScrapeMetrics(server_->metrics_address()), name, labels).value_or(-1);
  }

  // Sends `big` (through `send_big`, which returns its status) and then a
  // small request, which completes their batch; checks the small one's answer
  // and returns the big one's status and the batch's engine seconds.
  std::pair<grpc::Status, double> RunBatch(
      const std::function<grpc::Status()>& send_big) {
    const double compute_before = Metric("attention_compute_duration_seconds_sum");
    const double batches_before = Metric("attention_batch_size_count");
    grpc::Status big_status;
    std::thread big([&] { big_status = send_big(); });
    // The small one must reach the queue after the big one.
    EXPECT_TRUE(WaitForMetrics(server_->metrics_address(), [](const std::string& m) {
      return MetricValue(m, "attention_queue_depth", {{"model", "dot_product"}}) == 1;
    }));
    const v1::AttendRequest small = SelfAttentionRequest(2, 5, 8, 7);
    v1::AttendResponse answer;
    const grpc::Status small_status = AttendWithin(*stub_, milliseconds(60000), small, &answer);
    big.join();
    EXPECT_TRUE(small_status.ok()) << small_status.error_message();
    EXPECT_EQ(CheckAnswer(small, answer), "");
    EXPECT_EQ(Metric("attention_batch_size_count") - batches_before, 1) << "not one batch";
    // Both requests observe the batch's duration.
    const double engine_seconds =
        (Metric("attention_compute_duration_seconds_sum") - compute_before) / 2;
    std::cout << "the engine held the batch " << engine_seconds << " s\n";
    return {big_status, engine_seconds};
  }

  std::unique_ptr<ServerProcess> server_;
  std::unique_ptr<v1::AttentionService::Stub> stub_;
};

TEST_F(ComputeStopTest, DeadlinePassingWhileComputedStopsTheRequest) {
  // The request's whole cost on this machine (0.3 s on a quiet Zen 5, over a
  // second on slower or busier hosts), so that its deadline falls well
  // inside the computation wherever the test runs.
  const auto [whole_status, whole_seconds] = RunBatch(
      [&] { return AttendWithin(*stub_, milliseconds(600000), BudgetSized()); });
  ASSERT_TRUE(whole_status.ok()) << whole_status.error_message();
  const double deadline_seconds = std::max(0.15, whole_seconds / 3);

  const auto [status, engine_seconds] = RunBatch([&] {
    return AttendWithin(*stub_, milliseconds(static_cast<int64_t>(deadline_seconds * 1000)),
                        BudgetSized());
  });
  EXPECT_EQ(status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << status.error_message();
  // The batch started within the deadline and stopped soon after it, well
  // before the whole computation would have ended.
  EXPECT_GT(engine_seconds, 0);
  EXPECT_LT(engine_seconds, deadline_seconds + 0.1)
      << "deadline " << deadline_seconds << " s, the whole request " << whole_seconds << " s";
  EXPECT_LT(engine_seconds, whole_seconds) << "the request was not stopped";
  EXPECT_EQ(Metric("attention_requests_total", {{"code", "DEADLINE_EXCEEDED"}}), 1);
  EXPECT_EQ(Metric("attention_requests_total", {{"code", "OK"}}), 3);
}

TEST_F(ComputeStopTest, CancellingWhileComputedStopsTheRequest) {
  grpc::ClientContext context;
  const auto [status, engine_seconds] = RunBatch([&] {
    std::thread canceller([&] {
      // Cancel once the batch computes: the queue is empty again.
      WaitForMetrics(server_->metrics_address(), [](const std::string& m) {
        return MetricValue(m, "attention_batch_size_count", {{"model", "dot_product"}}) == 1;
      });
      std::this_thread::sleep_for(milliseconds(100));
      context.TryCancel();
    });
    v1::AttendResponse response;
    const grpc::Status s = stub_->Attend(&context, BudgetSized(), &response);
    canceller.join();
    return s;
  });
  EXPECT_EQ(status.error_code(), grpc::StatusCode::CANCELLED) << status.error_message();
  EXPECT_GT(engine_seconds, 0);
  EXPECT_LT(engine_seconds, 0.6) << "the engine held the batch " << engine_seconds << " s";
  EXPECT_TRUE(WaitForMetrics(server_->metrics_address(), [](const std::string& m) {
    return MetricValue(m, "attention_requests_total",
                       {{"model", "dot_product"}, {"code", "CANCELLED"}}) == 1;
  }));
}

}  // namespace
}  // namespace attention::testing
