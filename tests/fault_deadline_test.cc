// fault_deadline_test.cc: deadlines shorter than the wait in the queue.
//
// Slow requests keep the one engine thread busy for three times the short
// deadline (their number sized by timing one first, so a fast machine gets
// more of them); behind them wait unary calls with a short deadline, calls
// with a long one, and a stream with a short deadline. The short ones end
// with DEADLINE_EXCEEDED and are never computed (the engine's time goes to
// requests someone still waits for); the long ones get their right answers.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "tests/fault_util.h"
#include "tests/server_test_util.h"

namespace attention::testing {
namespace {

constexpr int kShortCalls = 20;
constexpr int kLongCalls = 20;
constexpr int kStreamRequests = 4;
constexpr auto kShortDeadline = std::chrono::seconds(1);
constexpr auto kLongDeadline = std::chrono::seconds(300);

std::chrono::system_clock::time_point In(std::chrono::system_clock::duration d) {
  return std::chrono::system_clock::now() + d;
}

TEST(FaultDeadlineTest, ShortDeadlinesEndInTheQueueAndTheEngineSkipsThem) {
  // The slow request ([1, 8192, 128]) is over the default work budget.
  auto server = ServerProcess::Start({"--max-batch-size", "1", "--max-queue-delay-us", "0",
                                      "--threads", "1", "--max-request-work", "0"});
  ASSERT_TRUE(server.ok()) << server.status();
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(-1);
  auto stub = v1::AttentionService::NewStub(
      grpc::CreateCustomChannel((*server)->address(), grpc::InsecureChannelCredentials(), args));
  const auto metric = [&](const std::string& name, const std::map<std::string, std::string>& l) {
    return MetricValue(ScrapeMetrics((*server)->metrics_address()), name, l);
  };
  const auto wait_for = [&](const std::function<bool(const std::string&)>& done) {
    return WaitForMetrics((*server)->metrics_address(), done);
  };
  const std::map<std::string, std::string> model = {{"model", "dot_product"}};

  const v1::AttendRequest slow_request = DotProductRequest(1, 8192, 128, -1);
  const auto started = std::chrono::steady_clock::now();
  {
    grpc::ClientContext context;
    v1::AttendResponse response;
    ASSERT_TRUE(stub->Attend(&context, slow_request, &response).ok());
  }
  const auto slow_time = std::chrono::steady_clock::now() - started;
  const int num_slow = std::clamp<int>(3 * kShortDeadline / slow_time + 1, 2, 50);

  // The slow requests, one per batch: the first computes, the others wait at
  // the head of the queue.
  std::vector<std::thread> calls;
  std::vector<grpc::Status> slow_status(num_slow);
  for (int i = 0; i < num_slow; ++i) {
    calls.emplace_back([&, i] {
      grpc::ClientContext context;
      v1::AttendResponse response;
      slow_status[i] = stub->Attend(&context, slow_request, &response);
    });
  }
  ASSERT_TRUE(wait_for([&](const std::string& m) {
    return MetricValue(m, "attention_batch_size_count", model) == 2 &&
           MetricValue(m, "attention_queue_depth", model) == num_slow - 1;
  }));

  std::vector<grpc::Status> short_status(kShortCalls), long_status(kLongCalls);
  std::vector<std::string> long_wrong(kLongCalls);
  for (int i = 0; i < kShortCalls + kLongCalls; ++i) {
    calls.emplace_back([&, i] {
      const bool is_short = i % 2 == 0;
      const v1::AttendRequest request = DotProductRequest(1, 16, 8, i);
      grpc::ClientContext context;
      context.set_deadline(In(is_short ? kShortDeadline : kLongDeadline));
      v1::AttendResponse response;
      const grpc::Status status = stub->Attend(&context, request, &response);
      if (is_short) {
        short_status[i / 2] = status;
      } else {
        long_status[i / 2] = status;
        if (status.ok()) long_wrong[i / 2] = CheckAnswer(request, response);
      }
    });
  }
  grpc::Status stream_status;
  calls.emplace_back([&] {
    grpc::ClientContext context;
    context.set_deadline(In(kShortDeadline));
    auto stream = stub->AttendStream(&context);
    for (int r = 0; r < kStreamRequests; ++r) stream->Write(DotProductRequest(1, 8, 4, 100 + r));
    stream->WritesDone();
    v1::AttendResponse response;
    while (stream->Read(&response)) {
    }
    stream_status = stream->Finish();
  });
  for (std::thread& call : calls) call.join();

  for (const grpc::Status& status : slow_status) {
    EXPECT_TRUE(status.ok()) << status.error_message();
  }
  for (int i = 0; i < kShortCalls; ++i) {
    EXPECT_EQ(short_status[i].error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << "short " << i;
  }
  for (int i = 0; i < kLongCalls; ++i) {
    ASSERT_TRUE(long_status[i].ok()) << "long " << i << ": " << long_status[i].error_message();
    EXPECT_EQ(long_wrong[i], "") << "long " << i;
  }
  EXPECT_EQ(stream_status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);

  ASSERT_TRUE(wait_for(
      [](const std::string& m) { return MetricValue(m, "attention_inflight_requests") == 0; }));
  EXPECT_EQ(metric("attention_batch_size_sum", model), 1 + num_slow + kLongCalls)
      << "requests whose deadline had passed were computed";
  EXPECT_EQ(metric("attention_requests_total", {{"code", "DEADLINE_EXCEEDED"}}),
            kShortCalls + kStreamRequests);
  EXPECT_EQ(metric("attention_queue_depth", model), 0);
  EXPECT_EQ(HealthStatus((*server)->Channel()), "SERVING");
  EXPECT_EQ((*server)->Stop(), 0) << (*server)->Log();
}

}  // namespace
}  // namespace attention::testing
