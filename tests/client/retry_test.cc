// client_retry_test.cc: the AttentionClient's call semantics: retries with
// backoff on UNAVAILABLE, Attend sent again when its answer was cut off
// (UNKNOWN), nothing else retried, deadlines, the bearer token header, and
// the async call.
//
// The real attention-server cannot be told to answer UNAVAILABLE on demand,
// so these tests run a scripted AttentionService in this process, listening
// on 127.0.0.1 (port picked by the system). Everything that needs real
// answers is tested against attention-server in client_balance_test and
// client_tls_test.
#include <atomic>
#include <functional>
#include <mutex>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <grpcpp/grpcpp.h>

#include "absl/synchronization/notification.h"
#include "attention.grpc.pb.h"
#include "client/cpp/attention_client.h"

namespace attention::client {
namespace {

using attention::v1::AttendRequest;
using attention::v1::AttendResponse;

// Answers the n-th Attend call with the n-th scripted code (the last one
// repeats); an OK answer echoes the request_id.
class ScriptedService final : public attention::v1::AttentionService::Service {
 public:
  explicit ScriptedService(std::vector<grpc::StatusCode> codes) : codes_(std::move(codes)) {}

  grpc::Status Attend(grpc::ServerContext* context, const AttendRequest* request,
                      AttendResponse* response) override {
    const int n = calls_++;
    {
      std::lock_guard<std::mutex> lock(mu_);
      const auto found = context->client_metadata().find("authorization");
      authorization_ = found == context->client_metadata().end()
                           ? "(none)"
                           : std::string(found->second.data(), found->second.size());
    }
    if (hold_ != nullptr) hold_->WaitForNotification();
    const grpc::StatusCode code = codes_[std::min<size_t>(n, codes_.size() - 1)];
    if (code != grpc::StatusCode::OK) return grpc::Status(code, "scripted failure");
    response->set_request_id(request->request_id());
    return grpc::Status::OK;
  }

  int calls() const { return calls_; }
  std::string authorization() {
    std::lock_guard<std::mutex> lock(mu_);
    return authorization_;
  }
  // Calls wait for `hold` before answering; not owned.
  void HoldCallsUntil(absl::Notification* hold) { hold_ = hold; }

 private:
  const std::vector<grpc::StatusCode> codes_;
  std::atomic<int> calls_{0};
  absl::Notification* hold_ = nullptr;
  std::mutex mu_;
  std::string authorization_;
};

class ScriptedServer {
 public:
  explicit ScriptedServer(std::vector<grpc::StatusCode> codes) : service_(std::move(codes)) {
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port_);
    builder.SetMaxReceiveMessageSize(-1);
    builder.RegisterService(&service_);
    server_ = builder.BuildAndStart();
  }
  ~ScriptedServer() { server_->Shutdown(); }

  std::string address() const { return "127.0.0.1:" + std::to_string(port_); }
  ScriptedService& service() { return service_; }

 private:
  ScriptedService service_;
  int port_ = 0;
  std::unique_ptr<grpc::Server> server_;
};

// A client of `server` with the default options changed by `edit`.
std::unique_ptr<AttentionClient> ClientFor(
    const ScriptedServer& server, const std::function<void(ClientOptions&)>& edit = {}) {
  ClientOptions options;
  if (edit) edit(options);
  options.target = server.address();
  // Short backoff: the tests count attempts, not time.
  options.retry.initial_backoff = absl::Milliseconds(1);
  options.retry.max_backoff = absl::Milliseconds(5);
  absl::StatusOr<std::unique_ptr<AttentionClient>> client = AttentionClient::Create(options);
  EXPECT_TRUE(client.ok()) << client.status();
  return client.ok() ? *std::move(client) : nullptr;
}

AttendRequest Request(const std::string& id) {
  AttendRequest request;
  request.set_model("dot_product");
  request.set_request_id(id);
  return request;
}

// AttendAsync's answer, waited for.
absl::StatusOr<AttendResponse> AttendAsyncAndWait(AttentionClient& client,
                                                  const AttendRequest& request) {
  absl::Notification done;
  absl::StatusOr<AttendResponse> answer;
  client.AttendAsync(&request, [&](absl::StatusOr<AttendResponse> response) {
    answer = std::move(response);
    done.Notify();
  });
  done.WaitForNotification();
  return answer;
}

TEST(ClientRetryTest, RetriesUnavailableUntilAnAnswer) {
  ScriptedServer server({grpc::StatusCode::UNAVAILABLE, grpc::StatusCode::UNAVAILABLE,
                         grpc::StatusCode::OK});
  auto client = ClientFor(server, [](ClientOptions& o) { o.retry.max_attempts = 4; });
  absl::StatusOr<AttendResponse> response = client->Attend(Request("r1"));
  ASSERT_TRUE(response.ok()) << response.status();
  EXPECT_EQ(response->request_id(), "r1");
  EXPECT_EQ(server.service().calls(), 3);
}

TEST(ClientRetryTest, RetriesLargeRequestsToo) {
  // gRPC commits (stops retrying) a call whose request outgrows its retry
  // buffer, 256 KiB by default; the client raises it.
  ScriptedServer server({grpc::StatusCode::UNAVAILABLE, grpc::StatusCode::OK});
  auto client = ClientFor(server);
  AttendRequest request = Request("large");
  request.mutable_queries()->mutable_data()->Resize(4 << 20, 1.0f);  // 16 MiB
  absl::StatusOr<AttendResponse> response = client->Attend(request);
  ASSERT_TRUE(response.ok()) << response.status();
  EXPECT_EQ(server.service().calls(), 2);
}

TEST(ClientRetryTest, GivesUpAfterMaxAttempts) {
  ScriptedServer server({grpc::StatusCode::UNAVAILABLE});
  auto client = ClientFor(server, [](ClientOptions& o) { o.retry.max_attempts = 3; });
  EXPECT_EQ(client->Attend(Request("r")).status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(server.service().calls(), 3);
}

TEST(ClientRetryTest, OneAttemptMeansNoRetry) {
  ScriptedServer server({grpc::StatusCode::UNAVAILABLE, grpc::StatusCode::OK});
  auto client = ClientFor(server, [](ClientOptions& o) { o.retry.max_attempts = 1; });
  EXPECT_EQ(client->Attend(Request("r")).status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(server.service().calls(), 1);
}

TEST(ClientRetryTest, EveryOtherCodeIsReturnedAfterOneCall) {
  for (grpc::StatusCode code :
       {grpc::StatusCode::INVALID_ARGUMENT, grpc::StatusCode::NOT_FOUND,
        grpc::StatusCode::RESOURCE_EXHAUSTED, grpc::StatusCode::UNAUTHENTICATED,
        grpc::StatusCode::INTERNAL, grpc::StatusCode::DEADLINE_EXCEEDED}) {
    ScriptedServer server({code, grpc::StatusCode::OK});
    auto client = ClientFor(server);
    absl::StatusOr<AttendResponse> response = client->Attend(Request("r"));
    EXPECT_EQ(static_cast<int>(response.status().code()), static_cast<int>(code));
    EXPECT_EQ(response.status().message(), "scripted failure");
    EXPECT_EQ(server.service().calls(), 1) << "code " << code;
  }
}

// An answer cut off on its way (an edge ends the stream without its status
// when the replica behind it dies, and gRPC reports UNKNOWN, which
// attention-server itself never answers) is sent again, up to max_attempts
// tries in all; the scripted UNKNOWN stands for it here.
TEST(ClientRetryTest, CutOffAnswersAreSentAgainUpToMaxAttempts) {
  ScriptedServer answers_third({grpc::StatusCode::UNKNOWN, grpc::StatusCode::UNKNOWN,
                                grpc::StatusCode::OK});
  absl::StatusOr<AttendResponse> response = ClientFor(answers_third)->Attend(Request("r1"));
  ASSERT_TRUE(response.ok()) << response.status();
  EXPECT_EQ(response->request_id(), "r1");
  EXPECT_EQ(answers_third.service().calls(), 3);
  for (int max_attempts : {1, 3}) {
    ScriptedServer never({grpc::StatusCode::UNKNOWN});
    auto client = ClientFor(never, [&](ClientOptions& o) { o.retry.max_attempts = max_attempts; });
    EXPECT_EQ(client->Attend(Request("r")).status().code(), absl::StatusCode::kUnknown);
    EXPECT_EQ(never.service().calls(), max_attempts);
  }
}

TEST(ClientRetryTest, CutOffAnswerIsNotSentAgainPastTheDeadline) {
  ScriptedServer server({grpc::StatusCode::UNKNOWN, grpc::StatusCode::OK});
  // A pause of at least 0.8 s (the first back-off, 1 s, less its jitter)
  // would end past the 0.5 s deadline, so the cut-off answer is reported.
  ClientOptions slow;
  slow.target = server.address();
  slow.timeout = absl::Milliseconds(500);
  slow.retry.initial_backoff = absl::Seconds(1);
  slow.retry.max_backoff = absl::Seconds(1);
  absl::StatusOr<std::unique_ptr<AttentionClient>> patient = AttentionClient::Create(slow);
  ASSERT_TRUE(patient.ok()) << patient.status();
  EXPECT_EQ((*patient)->Attend(Request("r")).status().code(), absl::StatusCode::kUnknown);
  EXPECT_EQ(server.service().calls(), 1);
  EXPECT_TRUE(ClientFor(server)->Attend(Request("r")).ok()) << "the next call is answered";
}

TEST(ClientRetryTest, AsyncCutOffAnswerIsSentAgain) {
  ScriptedServer server({grpc::StatusCode::UNKNOWN, grpc::StatusCode::UNKNOWN,
                         grpc::StatusCode::OK});
  auto client = ClientFor(server);
  const absl::StatusOr<AttendResponse> answer = AttendAsyncAndWait(*client, Request("async"));
  ASSERT_TRUE(answer.ok()) << answer.status();
  EXPECT_EQ(answer->request_id(), "async");
  EXPECT_EQ(server.service().calls(), 3);
}

TEST(ClientRetryTest, DeadlineEndsACallThatGetsNoAnswer) {
  ScriptedServer server({grpc::StatusCode::OK});
  absl::Notification release;
  server.service().HoldCallsUntil(&release);
  auto client = ClientFor(server, [](ClientOptions& o) { o.timeout = absl::Milliseconds(100); });
  EXPECT_EQ(client->Attend(Request("r")).status().code(), absl::StatusCode::kDeadlineExceeded);
  // A per-call timeout overrides the client's.
  EXPECT_EQ(client->Attend(Request("r"), absl::Milliseconds(10)).status().code(),
            absl::StatusCode::kDeadlineExceeded);
  release.Notify();
  // The first call reached the server and was held there; the 10 ms one may
  // expire before it is even sent on a loaded machine, so it need not arrive.
  EXPECT_GE(server.service().calls(), 1);
  EXPECT_LE(server.service().calls(), 2);
}

TEST(ClientRetryTest, TokenIsSentAsBearerAuthorization) {
  ScriptedServer server({grpc::StatusCode::OK});
  auto with_token = ClientFor(server, [](ClientOptions& o) { o.token = "s3cret"; });
  ASSERT_TRUE(with_token->Attend(Request("r")).ok());
  EXPECT_EQ(server.service().authorization(), "Bearer s3cret");

  auto without = ClientFor(server);
  ASSERT_TRUE(without->Attend(Request("r")).ok());
  EXPECT_EQ(server.service().authorization(), "(none)");
}

TEST(ClientRetryTest, AsyncCallDeliversTheAnswerAndRetriesToo) {
  ScriptedServer server({grpc::StatusCode::UNAVAILABLE, grpc::StatusCode::OK});
  auto client = ClientFor(server);
  const absl::StatusOr<AttendResponse> answer = AttendAsyncAndWait(*client, Request("async"));
  ASSERT_TRUE(answer.ok()) << answer.status();
  EXPECT_EQ(answer->request_id(), "async");
  EXPECT_EQ(server.service().calls(), 2);
}

}  // namespace
}  // namespace attention::client
