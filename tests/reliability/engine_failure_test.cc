// engine_failure_test.cc: an engine call that throws. The test gate's byte
// 'x' makes a batch's engine call fail as an exception would: each request of
// that batch is answered INTERNAL (unary, or in place in a stream, which goes
// on), the failure is counted, and the server keeps serving and exits 0.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>
#include <thread>

#include "tests/support/gate.h"
#include "tests/support/metrics.h"
#include "tests/support/probes.h"
#include "tests/support/requests.h"
#include "tests/support/server_process.h"

namespace attention::testing {
namespace {

TEST(EngineFailureTest, FailedBatchIsInternalAndTheServerGoesOn) {
  TestGate gate;
  ASSERT_TRUE(gate.ok()) << "mkfifo failed";
  auto server = ServerProcess::Start(
      gate.Flags({"--max-batch-size", "1", "--max-queue-delay-us", "0", "--threads", "1"}));
  ASSERT_TRUE(server.ok()) << server.status();
  auto stub = (*server)->Stub();

  // A unary call and a stream's first request fail; the stream's second
  // request computes.
  grpc::Status unary;
  std::thread call([&] {
    grpc::ClientContext context;
    v1::AttendResponse response;
    unary = stub->Attend(&context, GateRequest(1, 4, 4, 1), &response);
  });
  ASSERT_TRUE(WaitForMetrics((*server)->metrics_address(), [](const std::string& m) {
    return MetricValue(m, "attention_batch_size_count", {{"model", "gate"}}) == 1;
  }));
  ASSERT_TRUE(gate.Fail());
  call.join();
  EXPECT_EQ(unary.error_code(), grpc::StatusCode::INTERNAL) << unary.error_message();
  EXPECT_THAT(unary.error_message(), ::testing::HasSubstr("the engine failed"));

  grpc::ClientContext context;
  auto stream = stub->AttendStream(&context);
  const v1::AttendRequest failing = GateRequest(1, 4, 4, 2);
  const v1::AttendRequest computed = GateRequest(1, 4, 4, 3);
  ASSERT_TRUE(stream->Write(failing));
  ASSERT_TRUE(stream->Write(computed));
  stream->WritesDone();
  ASSERT_TRUE(gate.Fail());
  ASSERT_TRUE(gate.Release());
  v1::AttendResponse response;
  ASSERT_TRUE(stream->Read(&response));
  EXPECT_EQ(response.request_id(), failing.request_id());
  EXPECT_EQ(response.error().code(), static_cast<int>(grpc::StatusCode::INTERNAL));
  ASSERT_TRUE(stream->Read(&response));
  EXPECT_EQ(CheckAnswer(computed, response), "");
  EXPECT_FALSE(stream->Read(&response));
  EXPECT_TRUE(stream->Finish().ok());

  const std::string metrics = ScrapeMetrics((*server)->metrics_address());
  EXPECT_EQ(MetricValue(metrics, "attention_requests_total", {{"model", "gate"}, {"code", "INTERNAL"}}),
            2);
  EXPECT_EQ(MetricValue(metrics, "attention_inflight_requests"), 0);
  EXPECT_EQ(HealthStatus((*server)->Channel()), "SERVING");
  {
    grpc::ClientContext after;
    const v1::AttendRequest request = SelfAttentionRequest(1, 4, 4, 4);
    v1::AttendResponse answer;
    ASSERT_TRUE(stub->Attend(&after, request, &answer).ok());
    EXPECT_EQ(CheckAnswer(request, answer), "");
  }
  stub.reset();
  EXPECT_EQ((*server)->Stop(), 0) << (*server)->Log();
}

}  // namespace
}  // namespace attention::testing
