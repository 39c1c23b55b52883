// queued_bytes_test.cc: the server-wide byte budget of held requests,
// --max-queued-bytes (docs/api.md, section 6.2). Queue bounds count requests
// (512 per model), and a request may be 64 MiB; the byte budget keeps what
// all queues together hold bounded. The test gate holds batches so that the
// budget fills deterministically.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <future>
#include <string>
#include <vector>

#include "tests/support/gate.h"
#include "tests/support/metrics.h"
#include "tests/support/probes.h"
#include "tests/support/requests.h"
#include "tests/support/server_process.h"

namespace attention::testing {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

// About 1 MB on the wire: queries [1, 500, 500].
v1::AttendRequest Megabyte(const std::string& model) {
  v1::AttendRequest request;
  request.set_model(model);
  v1::Tensor* queries = request.mutable_queries();
  for (int64_t s : {1, 500, 500}) queries->add_shape(s);
  queries->mutable_data()->Resize(250000, 0.01f);
  return request;
}

TEST(QueuedBytesTest, RequestsPastTheByteBudgetGetResourceExhaustedUntilOthersAreAnswered) {
  TestGate gate;
  ASSERT_TRUE(gate.ok());
  auto server = ServerProcess::Start(
      gate.Flags({"--max-batch-size", "1", "--max-queued-bytes", "3100000"}));
  ASSERT_TRUE(server.ok()) << server.status();
  auto stub = (*server)->Stub();
  const v1::AttendRequest request = Megabyte("gate");
  const int64_t bytes = static_cast<int64_t>(request.ByteSizeLong());
  ASSERT_GT(bytes, 1000000);

  // One held at the gate, two queued behind it: 3 MB held.
  std::vector<std::future<grpc::Status>> held;
  for (int i = 0; i < 3; ++i) {
    held.push_back(std::async(std::launch::async, [&] { return AttendWithin(*stub, std::chrono::seconds(60), request); }));
    ASSERT_EQ(held.back().wait_for(std::chrono::milliseconds(300)), std::future_status::timeout);
  }
  // Another model's request is refused too: the budget is the server's.
  const grpc::Status refused = AttendWithin(*stub, std::chrono::seconds(60), Megabyte("dot_product"));
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << refused.error_message();
  EXPECT_THAT(refused.error_message(),
              AllOf(HasSubstr("the server holds " + std::to_string(3 * bytes) + " bytes"),
                    HasSubstr("--max-queued-bytes 3100000")));
  // A small one still fits.
  v1::AttendRequest small;
  small.set_model("dot_product");
  for (int64_t s : {1, 2, 2}) small.mutable_queries()->add_shape(s);
  small.mutable_queries()->mutable_data()->Resize(4, 1.0f);
  EXPECT_TRUE(AttendWithin(*stub, std::chrono::seconds(60), small).ok());

  ASSERT_TRUE(gate.Release(3));
  for (auto& call : held) EXPECT_TRUE(call.get().ok());
  // Answered requests no longer count.
  EXPECT_TRUE(AttendWithin(*stub, std::chrono::seconds(60), Megabyte("dot_product")).ok());
  stub.reset();
  EXPECT_EQ((*server)->Stop(), 0);
}

}  // namespace
}  // namespace attention::testing
