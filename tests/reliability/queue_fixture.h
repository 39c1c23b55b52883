// queue_fixture.h: the fixture of the queue tests (overload_test,
// deadline_test, cancel_test): a server with one engine thread and one request
// per batch, kept busy by slow requests while a test looks at its queue
// through /metrics.
#pragma once

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "tests/support/metrics.h"
#include "tests/support/server_process.h"

namespace attention::testing {

// Self-attention over n = 4096 keys of size 128: hundreds of milliseconds on
// one thread, so the queue behind it stays put while the test acts.
inline v1::AttendRequest SlowRequest() {
  v1::AttendRequest request;
  request.set_model("dot_product");
  request.set_request_id("slow");
  v1::Tensor* queries = request.mutable_queries();
  const int n = 4096, d = 128;
  for (int64_t s : {1, n, d}) queries->add_shape(s);
  for (int i = 0; i < n * d; ++i) queries->add_data(static_cast<float>(i % 13) * 0.01f);
  return request;
}

inline v1::AttendRequest SmallRequest() {
  v1::AttendRequest request;
  request.set_model("dot_product");
  request.set_request_id("small");
  v1::Tensor* queries = request.mutable_queries();
  for (int64_t s : {1, 2, 2}) queries->add_shape(s);
  for (float v : {1.0f, 2.0f, 3.0f, 4.0f}) queries->add_data(v);
  return request;
}

class QueueTest : public ::testing::Test {
 protected:
  void Start(const std::string& queue_capacity, std::vector<std::string> more_flags = {}) {
    std::vector<std::string> flags = {"--max-batch-size", "1", "--max-queue-delay-us", "0",
                                      "--threads", "1", "--queue-capacity", queue_capacity};
    flags.insert(flags.end(), more_flags.begin(), more_flags.end());
    auto started = ServerProcess::Start(flags);
    ASSERT_TRUE(started.ok()) << started.status();
    server_ = *std::move(started);
    stub_ = server_->Stub();
  }
  void TearDown() override {
    for (auto& call : background_) call.join();
    if (server_) {
      EXPECT_EQ(server_->Stop(), 0) << server_->Log();
    }
  }

  // Sends `count` slow requests from background threads; their codes land in
  // slow_codes_ once answered.
  void SendSlow(int count) {
    slow_codes_.resize(count, grpc::StatusCode::UNKNOWN);
    for (int i = 0; i < count; ++i) {
      background_.emplace_back([this, i] {
        grpc::ClientContext context;
        v1::AttendResponse response;
        slow_codes_[i] = stub_->Attend(&context, SlowRequest(), &response).error_code();
      });
    }
  }

  bool WaitForMetrics(const std::function<bool(const std::string&)>& done) {
    return attention::testing::WaitForMetrics(server_->metrics_address(), done);
  }
  bool WaitForInflight(double n) {
    return WaitForMetrics(
        [n](const std::string& m) { return MetricValue(m, "attention_inflight_requests") == n; });
  }
  std::optional<double> Count(const std::string& code) {
    return MetricValue(ScrapeMetrics(server_->metrics_address()), "attention_requests_total",
                       {{"model", "dot_product"}, {"code", code}});
  }
  void JoinSlow() {
    for (auto& call : background_) call.join();
    background_.clear();
  }
  // Two slow requests ran ahead of one small request that ended with `code`:
  // the server answers it when it reaches it, without computing it.
  void ExpectDroppedAfterTheSlowOnes(const std::string& code) {
    JoinSlow();
    EXPECT_THAT(slow_codes_, ::testing::Each(grpc::StatusCode::OK));
    ASSERT_TRUE(WaitForMetrics([&code](const std::string& m) {
      return MetricValue(m, "attention_requests_total", {{"code", code}}) == 1;
    })) << server_->Log();
    const std::string metrics = ScrapeMetrics(server_->metrics_address());
    EXPECT_EQ(MetricValue(metrics, "attention_batch_size_sum", {{"model", "dot_product"}}), 2)
        << "the " << code << " request was computed";
    EXPECT_EQ(MetricValue(metrics, "attention_queue_depth", {{"model", "dot_product"}}), 0);
    EXPECT_EQ(MetricValue(metrics, "attention_inflight_requests"), 0);
    EXPECT_THAT(server_->Log(), ::testing::HasSubstr("code=" + code));
  }

  std::unique_ptr<ServerProcess> server_;
  std::unique_ptr<v1::AttentionService::Stub> stub_;
  std::vector<std::thread> background_;
  std::vector<grpc::StatusCode> slow_codes_;
};

}  // namespace attention::testing
