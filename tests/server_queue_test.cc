// server_queue_test.cc: what happens to requests that wait. A full queue
// refuses at once; a request whose deadline passes in the queue, or whose
// call (unary or stream) is cancelled there, is answered without being
// computed.
//
// The server runs one request per batch on one engine thread, and a few big
// requests keep it busy while the test looks at the queue through /metrics.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "tests/server_test_util.h"

namespace attention::testing {
namespace {

// Self-attention over n = 4096 keys of size 128: hundreds of milliseconds on
// one thread, so the queue behind it stays put while the test acts.
v1::AttendRequest SlowRequest() {
  v1::AttendRequest request;
  request.set_model("dot_product");
  request.set_request_id("slow");
  v1::Tensor* queries = request.mutable_queries();
  const int n = 4096, d = 128;
  for (int64_t s : {1, n, d}) queries->add_shape(s);
  for (int i = 0; i < n * d; ++i) queries->add_data(static_cast<float>(i % 13) * 0.01f);
  return request;
}

v1::AttendRequest SmallRequest() {
  v1::AttendRequest request;
  request.set_model("dot_product");
  request.set_request_id("small");
  v1::Tensor* queries = request.mutable_queries();
  for (int64_t s : {1, 2, 2}) queries->add_shape(s);
  for (float v : {1.0f, 2.0f, 3.0f, 4.0f}) queries->add_data(v);
  return request;
}

class ServerQueueTest : public ::testing::Test {
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

  // Scrapes /metrics until `done` holds for it; false after 60 s.
  bool WaitForMetrics(const std::function<bool(const std::string&)>& done) {
    const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    while (std::chrono::steady_clock::now() < give_up) {
      if (done(ScrapeMetrics(server_->metrics_address()))) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    return false;
  }
  bool WaitForInflight(double n) {
    return WaitForMetrics(
        [n](const std::string& m) { return MetricValue(m, "attention_inflight_requests") == n; });
  }
  double Count(const std::string& code) {
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

TEST_F(ServerQueueTest, FullQueueAnswersResourceExhaustedAtOnce) {
  Start(/*queue_capacity=*/"2");
  EXPECT_EQ(MetricValue(ScrapeMetrics(server_->metrics_address()), "attention_queue_capacity",
                        {{"model", "dot_product"}}),
            2);
  SendSlow(3);  // one computing, two filling the queue
  ASSERT_TRUE(WaitForMetrics([](const std::string& m) {
    return MetricValue(m, "attention_queue_depth", {{"model", "dot_product"}}) == 2;
  }));

  grpc::ClientContext context;
  v1::AttendResponse response;
  const grpc::Status status = stub_->Attend(&context, SmallRequest(), &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << status.error_message();
  EXPECT_THAT(status.error_message(), ::testing::HasSubstr("queue"));

  JoinSlow();
  EXPECT_THAT(slow_codes_, ::testing::Each(grpc::StatusCode::OK));
  EXPECT_EQ(Count("RESOURCE_EXHAUSTED"), 1);
  EXPECT_EQ(Count("OK"), 3);
}

// With --max-concurrent-streams 2, one connection cannot have more calls at
// the server than one computing and one queued, so a queue of 1 never
// overflows: the third call waits in the client. (Without the cap it is
// refused, as in the test above; and gRPC would hold every call a client
// opens, however far the server is behind.)
TEST_F(ServerQueueTest, CallsBeyondMaxConcurrentStreamsWaitInTheClient) {
  Start(/*queue_capacity=*/"1", {"--max-concurrent-streams", "2"});
  SendSlow(3);
  ASSERT_TRUE(WaitForMetrics([](const std::string& m) {
    return MetricValue(m, "attention_queue_depth", {{"model", "dot_product"}}) == 1;
  }));
  JoinSlow();
  EXPECT_THAT(slow_codes_, ::testing::Each(grpc::StatusCode::OK));
  EXPECT_EQ(Count("RESOURCE_EXHAUSTED"), 0);
  EXPECT_EQ(Count("OK"), 3);
}

TEST_F(ServerQueueTest, DeadlinePassedInTheQueueIsAnsweredAndNeverComputed) {
  Start(/*queue_capacity=*/"8");
  SendSlow(2);
  ASSERT_TRUE(WaitForInflight(2));

  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(50));
  v1::AttendResponse response;
  EXPECT_EQ(stub_->Attend(&context, SmallRequest(), &response).error_code(),
            grpc::StatusCode::DEADLINE_EXCEEDED);

  ExpectDroppedAfterTheSlowOnes("DEADLINE_EXCEEDED");
}

TEST_F(ServerQueueTest, CancelledCallIsDroppedFromTheQueue) {
  Start(/*queue_capacity=*/"8");
  SendSlow(2);
  ASSERT_TRUE(WaitForInflight(2));

  grpc::ClientContext context;
  grpc::Status status;
  std::thread call([&] {
    v1::AttendResponse response;
    status = stub_->Attend(&context, SmallRequest(), &response);
  });
  ASSERT_TRUE(WaitForInflight(3));  // the small request is queued
  context.TryCancel();
  call.join();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::CANCELLED);

  ExpectDroppedAfterTheSlowOnes("CANCELLED");
}

TEST_F(ServerQueueTest, CancelledStreamDropsItsQueuedRequestsAndTheServerGoesOn) {
  Start(/*queue_capacity=*/"8");
  {
    grpc::ClientContext context;
    auto stream = stub_->AttendStream(&context);
    for (int i = 0; i < 3; ++i) {
      ASSERT_TRUE(stream->Write(SlowRequest()));
    }
    ASSERT_TRUE(WaitForInflight(3));  // one computing, two queued
    context.TryCancel();
    EXPECT_EQ(stream->Finish().error_code(), grpc::StatusCode::CANCELLED);
  }
  ASSERT_TRUE(WaitForInflight(0)) << server_->Log();
  const std::string metrics = ScrapeMetrics(server_->metrics_address());
  EXPECT_EQ(MetricValue(metrics, "attention_batch_size_sum", {{"model", "dot_product"}}), 1)
      << "requests of a cancelled stream were computed";
  EXPECT_EQ(MetricValue(metrics, "attention_requests_total", {{"code", "CANCELLED"}}), 2);

  grpc::ClientContext context;
  v1::AttendResponse response;
  EXPECT_TRUE(stub_->Attend(&context, SmallRequest(), &response).ok());
}

}  // namespace
}  // namespace attention::testing
