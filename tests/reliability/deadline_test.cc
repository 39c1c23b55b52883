// deadline_test.cc: deadlines shorter than the wait in the queue. A request
// whose deadline passes in the queue is answered DEADLINE_EXCEEDED when the
// server reaches it, and never computed.
//
// A request held at the test gate keeps the one engine thread busy; behind it
// wait unary calls with a short deadline, calls with a long one, and a stream
// with a short deadline. The gate opens only once the short ones have ended:
// they end with DEADLINE_EXCEEDED and are never computed (the engine's time
// goes to requests someone still waits for); the long ones get their right
// answers.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "health.grpc.pb.h"
#include "tests/reliability/queue_fixture.h"
#include "tests/support/gate.h"
#include "tests/support/metrics.h"
#include "tests/support/probes.h"
#include "tests/support/requests.h"
#include "tests/support/server_process.h"

namespace attention::testing {
namespace {

constexpr int kShortCalls = 20;
constexpr int kLongCalls = 20;
constexpr int kStreamRequests = 4;
// Long enough for every call to reach the server before it passes, which the
// test checks; the gate holds the queue for as long as it takes.
constexpr auto kShortDeadline = std::chrono::seconds(5);
constexpr auto kLongDeadline = std::chrono::seconds(60);
// How much later than the client's a server's deadline can be.
constexpr auto kDeadlineRounding = std::chrono::seconds(1);

std::chrono::system_clock::time_point In(std::chrono::system_clock::duration d) {
  return std::chrono::system_clock::now() + d;
}

TEST(DeadlineTest, ShortDeadlinesEndInTheQueueAndTheEngineSkipsThem) {
  TestGate gate;
  ASSERT_TRUE(gate.ok()) << "mkfifo failed";
  auto server = ServerProcess::Start(gate.Flags(
      {"--max-batch-size", "1", "--max-queue-delay-us", "0", "--threads", "1"}));
  ASSERT_TRUE(server.ok()) << server.status();
  auto stub = (*server)->Stub();
  const auto metric = [&](const std::string& name, const std::map<std::string, std::string>& l) {
    return MetricValue(ScrapeMetrics((*server)->metrics_address()), name, l);
  };
  const auto wait_for = [&](const std::function<bool(const std::string&)>& done) {
    return WaitForMetrics((*server)->metrics_address(), done);
  };
  const std::map<std::string, std::string> model = {{"model", "gate"}};

  // The held request: its batch waits at the gate, the others queue behind.
  grpc::Status held_status;
  const v1::AttendRequest held_request = GateRequest(1, 16, 8, -1);
  v1::AttendResponse held_response;
  std::thread held([&] {
    grpc::ClientContext context;
    held_status = stub->Attend(&context, held_request, &held_response);
  });
  ASSERT_TRUE(wait_for(
      [&](const std::string& m) { return MetricValue(m, "attention_batch_size_count", model) == 1; }));

  std::vector<std::thread> short_calls, long_calls;
  std::vector<grpc::Status> short_status(kShortCalls), long_status(kLongCalls);
  std::vector<std::string> long_wrong(kLongCalls);
  for (int i = 0; i < kShortCalls + kLongCalls; ++i) {
    const bool is_short = i % 2 == 0;
    (is_short ? short_calls : long_calls).emplace_back([&, i, is_short] {
      const v1::AttendRequest request = GateRequest(1, 16, 8, i);
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
  short_calls.emplace_back([&] {
    grpc::ClientContext context;
    context.set_deadline(In(kShortDeadline));
    auto stream = stub->AttendStream(&context);
    for (int r = 0; r < kStreamRequests; ++r) stream->Write(GateRequest(1, 8, 4, 100 + r));
    stream->WritesDone();
    v1::AttendResponse response;
    while (stream->Read(&response)) {
    }
    stream_status = stream->Finish();
  });
  // Everything reached the server (and waits there) before a deadline passed.
  const bool all_queued = wait_for([&](const std::string& m) {
    return MetricValue(m, "attention_inflight_requests") ==
           1 + kShortCalls + kLongCalls + kStreamRequests;
  });
  const auto queued_at = std::chrono::steady_clock::now();
  for (std::thread& call : short_calls) call.join();
  ASSERT_TRUE(all_queued) << "calls did not reach the server in time";
  // The server's deadline of a call can be later than the client's (gRPC sends
  // the time left rounded up to a coarser unit), and a call whose client gave
  // up before the server's deadline passed is answered CANCELLED: wait until
  // every short call's server deadline has passed too.
  std::this_thread::sleep_until(queued_at + kShortDeadline + kDeadlineRounding);
  // Only now may the engine go on: the held request, then each long call.
  ASSERT_TRUE(gate.Release(1 + kLongCalls));
  for (std::thread& call : long_calls) call.join();
  held.join();

  ASSERT_TRUE(held_status.ok()) << held_status.error_message();
  EXPECT_EQ(CheckAnswer(held_request, held_response), "");
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
  EXPECT_EQ(metric("attention_batch_size_sum", model), 1 + kLongCalls)
      << "requests whose deadline had passed were computed";
  EXPECT_EQ(metric("attention_requests_total", {{"code", "DEADLINE_EXCEEDED"}}),
            kShortCalls + kStreamRequests);
  EXPECT_EQ(metric("attention_queue_depth", model), 0);
  EXPECT_EQ(HealthStatus((*server)->Channel()), "SERVING");
  stub.reset();
  EXPECT_EQ((*server)->Stop(), 0) << (*server)->Log();
}

// One call, queued behind two held ones, whose deadline passes while the gate
// is closed.
TEST_F(QueueTest, DeadlinePassedInTheQueueIsAnsweredAndNeverComputed) {
  Start(/*queue_capacity=*/"8");
  SendHeld(2);

  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + kShortDeadline);
  grpc::Status status;
  std::thread call([&] {
    v1::AttendResponse response;
    status = stub_->Attend(&context, GateRequest(1, 2, 2, 9), &response);
  });
  const bool queued = WaitForInflight(3);
  const auto queued_at = std::chrono::steady_clock::now();
  call.join();
  ASSERT_TRUE(queued) << "the call did not reach the server before its deadline";
  EXPECT_EQ(status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  // Past the server's deadline too (see above).
  std::this_thread::sleep_until(queued_at + kShortDeadline + kDeadlineRounding);

  ReleaseAndExpectDroppedAfterTheHeldOnes("DEADLINE_EXCEEDED");
}

}  // namespace
}  // namespace attention::testing
