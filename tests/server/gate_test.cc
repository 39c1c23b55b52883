// gate_test.cc: the test-only model `gate` (server/test_gate.h), which
// lets tests hold a batch for as long as they need instead of relying on a
// request being slow: a held request does not complete until a byte is
// written to the FIFO, 'x' fails the batch as an engine exception would, and
// a batch still held when the shutdown grace period runs out does not keep
// the server from exiting.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <future>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "tests/support/gate.h"
#include "tests/support/server_process.h"

namespace attention::testing {
namespace {

using ::testing::ElementsAreArray;
using ::testing::HasSubstr;
using ::testing::Not;

constexpr auto kCallTimeout = std::chrono::seconds(60);
// Long enough for an ungated request to finish many times over, so a request
// still pending after it is held by the gate.
constexpr auto kHeldFor = std::chrono::milliseconds(500);

v1::AttendRequest Request(const std::string& model) {
  v1::AttendRequest request;
  request.set_model(model);
  request.set_request_id("r1");
  request.set_return_attention_weights(true);
  v1::Tensor* queries = request.mutable_queries();
  for (int64_t s : {1, 3, 2}) queries->add_shape(s);
  for (float v : {1.0f, -2.0f, 0.5f, 3.0f, 2.0f, 1.0f}) queries->add_data(v);
  return request;
}

struct Reply {
  grpc::Status status;
  v1::AttendResponse response;
};

class ServerGateTest : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_TRUE(gate_.ok()) << "mkfifo failed"; }

  void Start(std::vector<std::string> flags, std::map<std::string, std::string> env = {}) {
    auto started = ServerProcess::Start(flags, env);
    ASSERT_TRUE(started.ok()) << started.status();
    server_ = *std::move(started);
    stub_ = server_->Stub();
  }
  void StartGated(std::vector<std::string> more_flags = {}) {
    Start(gate_.Flags(more_flags));
  }

  Reply Call(const v1::AttendRequest& request) {
    Reply reply;
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + kCallTimeout);
    reply.status = stub_->Attend(&context, request, &reply.response);
    return reply;
  }
  std::future<Reply> CallInBackground(const v1::AttendRequest& request) {
    return std::async(std::launch::async, [this, request] { return Call(request); });
  }

  TestGate gate_;
  std::unique_ptr<ServerProcess> server_;
  std::unique_ptr<v1::AttentionService::Stub> stub_;
};

TEST_F(ServerGateTest, HeldUntilAByteThenAnsweredLikeDotProduct) {
  StartGated();
  std::future<Reply> held = CallInBackground(Request("gate"));
  EXPECT_EQ(held.wait_for(kHeldFor), std::future_status::timeout);

  ASSERT_TRUE(gate_.Release());
  const Reply gate = held.get();
  ASSERT_TRUE(gate.status.ok()) << gate.status.error_message();
  EXPECT_EQ(gate.response.model(), "gate");
  EXPECT_EQ(gate.response.request_id(), "r1");

  const Reply reference = Call(Request("dot_product"));
  ASSERT_TRUE(reference.status.ok()) << reference.status.error_message();
  EXPECT_THAT(gate.response.output().shape(),
              ElementsAreArray(reference.response.output().shape()));
  EXPECT_THAT(gate.response.output().data(), ElementsAreArray(reference.response.output().data()));
  EXPECT_THAT(gate.response.attention_weights().data(),
              ElementsAreArray(reference.response.attention_weights().data()));
  EXPECT_EQ(gate.response.output().data_size(), 6);
  stub_.reset();
  EXPECT_EQ(server_->Stop(), 0) << server_->Log();
}

TEST_F(ServerGateTest, XFailsTheBatchWithInternal) {
  // Through the environment variable this time.
  Start({}, {{"ATTENTION_TEST_GATE_FIFO", gate_.fifo()}});
  std::future<Reply> held = CallInBackground(Request("gate"));
  EXPECT_EQ(held.wait_for(kHeldFor), std::future_status::timeout);

  ASSERT_TRUE(gate_.Fail());
  const Reply failed = held.get();
  EXPECT_EQ(failed.status.error_code(), grpc::StatusCode::INTERNAL)
      << failed.status.error_message();
  EXPECT_THAT(failed.status.error_message(), HasSubstr("the engine failed"));
  stub_.reset();
  EXPECT_EQ(server_->Stop(), 0) << server_->Log();
}

TEST_F(ServerGateTest, ValidatesLikeDotProductWithoutWaiting) {
  StartGated();
  v1::AttendRequest bad = Request("gate");
  bad.mutable_queries()->add_data(9.0f);  // 7 values for shape (1, 3, 2)
  const Reply refused = Call(bad);
  EXPECT_EQ(refused.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
      << refused.status.error_message();

  grpc::ClientContext context;
  v1::ListModelsResponse models;
  ASSERT_TRUE(stub_->ListModels(&context, v1::ListModelsRequest(), &models).ok());
  bool listed = false;
  for (const auto& model : models.models()) {
    if (model.name() == "gate") {
      listed = true;
      EXPECT_EQ(model.kind(), "dot_product");
    }
  }
  EXPECT_TRUE(listed);
  stub_.reset();
  EXPECT_EQ(server_->Stop(), 0) << server_->Log();
}

TEST_F(ServerGateTest, NoGateModelWithoutTheFlagAndNoFlagInHelp) {
  Start({});
  const Reply refused = Call(Request("gate"));
  EXPECT_EQ(refused.status.error_code(), grpc::StatusCode::NOT_FOUND);
  stub_.reset();
  EXPECT_EQ(server_->Stop(), 0) << server_->Log();

  std::string help;
  ASSERT_EQ(ServerProcess::RunToExit({"--help"}, {}, &help), 0);
  EXPECT_THAT(help, Not(HasSubstr("test-gate")));
}

// A batch held past --shutdown-grace-seconds fails once the grace period ran
// out, so the server exits as documented (0, after cancelling the calls still
// open) instead of waiting for the gate forever.
TEST_F(ServerGateTest, HeldBatchDoesNotOutliveTheGracePeriod) {
  StartGated({"--shutdown-grace-seconds", "1"});
  std::future<Reply> held = CallInBackground(Request("gate"));
  EXPECT_EQ(held.wait_for(kHeldFor), std::future_status::timeout);

  const auto signalled = std::chrono::steady_clock::now();
  server_->Signal(SIGTERM);
  // Polled without reaping, so that a server that hangs fails the test here
  // (and is killed by ~ServerProcess) instead of hanging it.
  bool exited = false;
  while (!exited && std::chrono::steady_clock::now() - signalled < std::chrono::seconds(30)) {
    siginfo_t info = {};
    ASSERT_EQ(waitid(P_PID, server_->pid(), &info, WEXITED | WNOHANG | WNOWAIT), 0);
    exited = info.si_pid == server_->pid();
    if (!exited) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ASSERT_TRUE(exited) << "still running 30 s after SIGTERM with a 1 s grace period\n"
                      << server_->Log();
  const auto took = std::chrono::steady_clock::now() - signalled;
  // 1 s of grace, at most 100 ms for the gate to notice, the rest slack for
  // a busy machine.
  EXPECT_LT(took, std::chrono::seconds(6));
  EXPECT_EQ(server_->Wait(), 0);
  EXPECT_THAT(server_->Log(), HasSubstr("calls still open after --shutdown-grace-seconds"));
  EXPECT_FALSE(held.get().status.ok());
}

}  // namespace
}  // namespace attention::testing
