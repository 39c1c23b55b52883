// client_stream_test.cc: AttentionClient::AttendStream. Against the real
// attention-server: answers equal unary Attend's, a bad request is answered
// with its error in place, a long stream keeps moving, the token and the
// deadline apply to the whole call; `attention-client attend --stream`
// (RunAttendStream). Against a scripted service in this process (the real
// server cannot fail a stream on demand): a stream is never retried, odd
// error codes, and answers that do not match the requests.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <span>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include <google/protobuf/util/json_util.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <grpcpp/grpcpp.h>
#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "attention.grpc.pb.h"
#include "client/cpp/attention_client.h"
#include "client/cli/commands.h"
#include "client/cli/proto_json.h"
#include "tests/support/files.h"
#include "tests/support/requests.h"
#include "tests/support/server_process.h"

namespace attention::client {
namespace {

using attention::testing::ConformanceDir;
using attention::testing::CrossAttentionRequest;
using attention::testing::ReadJson;
using attention::testing::RequestFromJson;
using attention::testing::ServerProcess;
using attention::testing::TempDir;
using attention::v1::AttendRequest;
using attention::v1::AttendResponse;
using ::testing::HasSubstr;

// Concurrent requests may be batched; a batched answer may differ this much.
constexpr float kBatchTolerance = 1e-5f;

std::unique_ptr<AttentionClient> Client(const std::string& target,
                                        const std::string& token = "") {
  ClientOptions options;
  options.target = target;
  options.timeout = absl::Seconds(60);
  options.token = token;
  // Short backoff: the scripted tests count attempts, not time.
  options.retry.initial_backoff = absl::Milliseconds(1);
  options.retry.max_backoff = absl::Milliseconds(5);
  absl::StatusOr<std::unique_ptr<AttentionClient>> client = AttentionClient::Create(options);
  EXPECT_TRUE(client.ok()) << client.status();
  return client.ok() ? *std::move(client) : nullptr;
}

// The request of every conformance case: every kind of model, with and
// without masks, weights and self-attention.
std::vector<AttendRequest> ConformanceRequests() {
  std::vector<std::filesystem::path> paths;
  for (const auto& entry : std::filesystem::directory_iterator(ConformanceDir() / "cases")) {
    paths.push_back(entry.path());
  }
  std::sort(paths.begin(), paths.end());
  std::vector<AttendRequest> requests;
  for (const std::filesystem::path& path : paths) {
    absl::StatusOr<AttendRequest> request = RequestFromJson(ReadJson(path)["request"]);
    EXPECT_TRUE(request.ok()) << path << ": " << request.status();
    if (!request.ok()) continue;
    request->set_request_id(path.stem().string());
    requests.push_back(*std::move(request));
  }
  return requests;
}

void ExpectNear(const v1::Tensor& actual, const v1::Tensor& expected, const std::string& what) {
  EXPECT_THAT(actual.shape(), ::testing::ElementsAreArray(expected.shape())) << what;
  ASSERT_EQ(actual.data_size(), expected.data_size()) << what;
  for (int i = 0; i < actual.data_size(); ++i) {
    ASSERT_NEAR(actual.data(i), expected.data(i), kBatchTolerance) << what << " [" << i << "]";
  }
}

// `streamed` is the answer `unary` got alone: same tensors, id and model.
void ExpectSameAnswer(const absl::StatusOr<AttendResponse>& streamed,
                      const absl::StatusOr<AttendResponse>& unary, const std::string& what) {
  ASSERT_TRUE(unary.ok()) << what << ": " << unary.status();
  ASSERT_TRUE(streamed.ok()) << what << ": " << streamed.status();
  EXPECT_EQ(streamed->request_id(), unary->request_id()) << what;
  EXPECT_EQ(streamed->model(), unary->model()) << what;
  ExpectNear(streamed->output(), unary->output(), what + " output");
  ExpectNear(streamed->attention_weights(), unary->attention_weights(), what + " weights");
}

class ClientStreamTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<ServerProcess>> server = ServerProcess::Start(
        {"--threads", "2", "--model-repository", (ConformanceDir() / "models").string()});
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    client_ = Client(server_->address());
  }

  std::unique_ptr<ServerProcess> server_;
  std::unique_ptr<AttentionClient> client_;
};

TEST_F(ClientStreamTest, AnswersEqualUnaryAnswersForEveryKindOfModel) {
  const std::vector<AttendRequest> requests = ConformanceRequests();
  ASSERT_GE(requests.size(), 20u);
  absl::StatusOr<AttentionClient::StreamResults> streamed = client_->AttendStream(requests);
  ASSERT_TRUE(streamed.ok()) << streamed.status();
  ASSERT_EQ(streamed->size(), requests.size());
  for (size_t i = 0; i < requests.size(); ++i) {
    ExpectSameAnswer((*streamed)[i], client_->Attend(requests[i]), requests[i].request_id());
  }
}

TEST_F(ClientStreamTest, BadRequestsGetTheirErrorInPlaceAndTheOthersAreAnswered) {
  std::vector<AttendRequest> requests;
  for (int i = 0; i < 5; ++i) {
    requests.push_back(CrossAttentionRequest(2, 3, 4, i));
    requests.back().set_request_id(absl::StrCat("r", i));
  }
  requests[1].set_model("no_such_model");
  requests[3].mutable_keys()->mutable_data()->RemoveLast();  // 11 values for shape (1, 3, 4)

  absl::StatusOr<AttentionClient::StreamResults> streamed = client_->AttendStream(requests);
  ASSERT_TRUE(streamed.ok()) << streamed.status();
  ASSERT_EQ(streamed->size(), requests.size());
  EXPECT_EQ((*streamed)[1].status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT((*streamed)[1].status().message(), HasSubstr("no_such_model"));
  EXPECT_EQ((*streamed)[3].status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT((*streamed)[3].status().message(), HasSubstr("keys"));
  for (int i : {0, 2, 4}) {
    ExpectSameAnswer((*streamed)[i], client_->Attend(requests[i]), requests[i].request_id());
  }
}

TEST_F(ClientStreamTest, LongStreamCompletes) {
  // Far more requests (16 MB) and answers (29 MB) than the server keeps
  // unwritten (32 answers) and than HTTP/2's windows hold: a client that
  // wrote every request before reading stalls here until the deadline (tried:
  // DEADLINE_EXCEEDED; at a tenth of these sizes it slipped through).
  constexpr int kDistinct = 4;
  constexpr int kRequests = 400;
  std::vector<AttendRequest> distinct;
  for (int i = 0; i < kDistinct; ++i) distinct.push_back(CrossAttentionRequest(64, 256, 32, i));
  std::vector<AttendRequest> requests;
  for (int i = 0; i < kRequests; ++i) {
    requests.push_back(distinct[i % kDistinct]);
    requests.back().set_request_id(absl::StrCat("r", i));
  }

  absl::StatusOr<AttentionClient::StreamResults> streamed =
      client_->AttendStream(requests, absl::Seconds(120));
  ASSERT_TRUE(streamed.ok()) << streamed.status();
  ASSERT_EQ(streamed->size(), requests.size());
  std::vector<absl::StatusOr<AttendResponse>> unary;
  for (const AttendRequest& request : distinct) unary.push_back(client_->Attend(request));
  for (int i = 0; i < kRequests; ++i) {
    absl::StatusOr<AttendResponse> expected = unary[i % kDistinct];
    if (expected.ok()) expected->set_request_id(absl::StrCat("r", i));
    ExpectSameAnswer((*streamed)[i], expected, absl::StrCat("request ", i));
    if (::testing::Test::HasFatalFailure()) return;
  }
}

TEST_F(ClientStreamTest, EmptySpanGivesNoResults) {
  absl::StatusOr<AttentionClient::StreamResults> streamed =
      client_->AttendStream(std::span<const AttendRequest>());
  ASSERT_TRUE(streamed.ok()) << streamed.status();
  EXPECT_TRUE(streamed->empty());
}

TEST_F(ClientStreamTest, PassedDeadlineFailsTheCall) {
  const std::vector<AttendRequest> requests = {CrossAttentionRequest(2, 3, 4, 0)};
  EXPECT_EQ(client_->AttendStream(requests, absl::Nanoseconds(1)).status().code(),
            absl::StatusCode::kDeadlineExceeded);
}

// What a CLI command printed and returned.
struct CommandRun {
  int exit_code = -1;
  std::vector<std::string> lines;  // stdout
  std::string errors;              // stderr
};

CommandRun RunCommand(const std::function<int()>& command) {
  std::ostringstream out, err;
  std::streambuf* const cout_buffer = std::cout.rdbuf(out.rdbuf());
  std::streambuf* const cerr_buffer = std::cerr.rdbuf(err.rdbuf());
  CommandRun run;
  run.exit_code = command();
  std::cout.rdbuf(cout_buffer);
  std::cerr.rdbuf(cerr_buffer);
  std::istringstream printed(out.str());
  for (std::string line; std::getline(printed, line);) run.lines.push_back(line);
  run.errors = err.str();
  return run;
}

AttendResponse ParseResponse(const std::string& json) {
  AttendResponse response;
  EXPECT_TRUE(google::protobuf::util::JsonStringToMessage(json, &response).ok()) << json;
  return response;
}

TEST_F(ClientStreamTest, CliSendsJsonLinesAndPrintsOneAnswerPerLine) {
  std::vector<AttendRequest> requests;
  for (int i = 0; i < 3; ++i) {
    requests.push_back(CrossAttentionRequest(2, 3, 4, i));
    requests.back().set_request_id(absl::StrCat("r", i));
  }
  requests[1].set_model("no_such_model");
  TempDir dir;
  const std::string path = (dir.path() / "requests.jsonl").string();
  {
    std::ofstream file(path);
    for (const AttendRequest& request : requests) file << ToJson(request, false) << "\n\n";
  }

  CommandRun run = RunCommand([&] { return RunAttendStream(*client_, path); });
  EXPECT_EQ(run.exit_code, kExitFailed);
  EXPECT_THAT(run.errors, HasSubstr("1 of 3 requests failed"));
  ASSERT_EQ(run.lines.size(), 3u);
  for (int i : {0, 2}) {
    ExpectSameAnswer(ParseResponse(run.lines[i]), client_->Attend(requests[i]),
                     absl::StrCat("line ", i));
  }
  const AttendResponse failed = ParseResponse(run.lines[1]);
  EXPECT_EQ(failed.error().code(), static_cast<int>(absl::StatusCode::kNotFound));
  EXPECT_THAT(failed.error().message(), HasSubstr("no_such_model"));
  EXPECT_EQ(failed.request_id(), "r1");
  EXPECT_EQ(failed.model(), "no_such_model");
  EXPECT_EQ(failed.output().data_size(), 0);

  requests.erase(requests.begin() + 1);
  {
    std::ofstream file(path);
    for (const AttendRequest& request : requests) file << ToJson(request, false) << "\n";
  }
  run = RunCommand([&] { return RunAttendStream(*client_, path); });
  EXPECT_EQ(run.exit_code, kExitOk) << run.errors;
  EXPECT_EQ(run.lines.size(), 2u);
}

TEST_F(ClientStreamTest, CliNamesTheLineThatIsNotARequest) {
  TempDir dir;
  const std::string path = (dir.path() / "requests.jsonl").string();
  std::ofstream(path) << ToJson(CrossAttentionRequest(2, 3, 4, 0), false) << "\n{\"model\": 7}\n";
  const CommandRun run = RunCommand([&] { return RunAttendStream(*client_, path); });
  EXPECT_EQ(run.exit_code, kExitBadInput);
  EXPECT_THAT(run.errors, HasSubstr("line 2"));
  EXPECT_TRUE(run.lines.empty());

  std::ofstream(path) << "\n  \n";
  EXPECT_EQ(RunCommand([&] { return RunAttendStream(*client_, path); }).exit_code,
            kExitBadInput);
}

TEST(ClientStreamTokenTest, MissingOrWrongTokenFailsTheWholeCall) {
  TempDir dir;
  const std::string tokens = (dir.path() / "tokens").string();
  std::ofstream(tokens) << "s3cret\n";
  auto server = ServerProcess::Start({"--threads", "1", "--auth-token-file", tokens});
  ASSERT_TRUE(server.ok()) << server.status();
  const std::vector<AttendRequest> requests = {CrossAttentionRequest(2, 3, 4, 0),
                                               CrossAttentionRequest(2, 3, 4, 1)};

  EXPECT_EQ(Client((*server)->address())->AttendStream(requests).status().code(),
            absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(Client((*server)->address(), "wrong")->AttendStream(requests).status().code(),
            absl::StatusCode::kUnauthenticated);
  absl::StatusOr<AttentionClient::StreamResults> streamed =
      Client((*server)->address(), "s3cret")->AttendStream(requests);
  ASSERT_TRUE(streamed.ok()) << streamed.status();
  ASSERT_EQ(streamed->size(), 2u);
  EXPECT_TRUE((*streamed)[0].ok() && (*streamed)[1].ok());
}

// What the scripted service does with the n-th AttendStream call.
enum class Script {
  kFailAtOnce,             // UNAVAILABLE before reading anything
  kAnswerOneThenFail,      // answers the first request, then UNAVAILABLE
  kAnswerAll,              // answers every request (see ScriptedAnswer)
  kAnswerNone,             // reads every request, answers none, ends OK
  kAnswerEveryOneTwice,    // two answers per request
};

// The answer to `request`: its request_id echoed; a model named
// "error:<code>" gets an AttendError with that code.
AttendResponse ScriptedAnswer(const AttendRequest& request) {
  AttendResponse response;
  response.set_request_id(request.request_id());
  if (request.model().starts_with("error:")) {
    response.mutable_error()->set_code(std::stoi(request.model().substr(6)));
    response.mutable_error()->set_message("scripted error");
  }
  return response;
}

// Follows the n-th script for the n-th call (the last one repeats).
class ScriptedStreamService final : public attention::v1::AttentionService::Service {
 public:
  explicit ScriptedStreamService(std::vector<Script> scripts) : scripts_(std::move(scripts)) {}

  grpc::Status AttendStream(
      grpc::ServerContext*,
      grpc::ServerReaderWriter<AttendResponse, AttendRequest>* stream) override {
    const Script script = scripts_[std::min<size_t>(calls_++, scripts_.size() - 1)];
    const grpc::Status unavailable(grpc::StatusCode::UNAVAILABLE, "scripted failure");
    if (script == Script::kFailAtOnce) return unavailable;
    AttendRequest request;
    while (stream->Read(&request)) {
      if (script == Script::kAnswerNone) continue;
      stream->Write(ScriptedAnswer(request));
      if (script == Script::kAnswerOneThenFail) return unavailable;
      if (script == Script::kAnswerEveryOneTwice) stream->Write(ScriptedAnswer(request));
    }
    return grpc::Status::OK;
  }

  int calls() const { return calls_; }

 private:
  const std::vector<Script> scripts_;
  std::atomic<int> calls_{0};
};

class ScriptedServer {
 public:
  explicit ScriptedServer(std::vector<Script> scripts) : service_(std::move(scripts)) {
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port_);
    builder.RegisterService(&service_);
    server_ = builder.BuildAndStart();
  }
  ~ScriptedServer() { server_->Shutdown(); }

  std::string address() const { return "127.0.0.1:" + std::to_string(port_); }
  int calls() const { return service_.calls(); }

 private:
  ScriptedStreamService service_;
  int port_ = 0;
  std::unique_ptr<grpc::Server> server_;
};

std::vector<AttendRequest> IdRequests(const std::vector<std::string>& models) {
  std::vector<AttendRequest> requests(models.size());
  for (size_t i = 0; i < models.size(); ++i) {
    requests[i].set_model(models[i]);
    requests[i].set_request_id(absl::StrCat("r", i));
  }
  return requests;
}

// Streams run on a channel without a retry policy (see attention_client.h):
// retried, a stream like these lost requests, hung or crashed the client.
TEST(ClientStreamRetryTest, UnavailableBeforeAnyAnswerIsNotRetried) {
  ScriptedServer server({Script::kFailAtOnce, Script::kAnswerAll});
  EXPECT_EQ(Client(server.address())->AttendStream(IdRequests({"m", "m", "m"})).status().code(),
            absl::StatusCode::kUnavailable);
  EXPECT_EQ(server.calls(), 1);
}

TEST(ClientStreamRetryTest, UnavailableAfterAnAnswerIsNotRetried) {
  ScriptedServer server({Script::kAnswerOneThenFail, Script::kAnswerAll});
  absl::StatusOr<AttentionClient::StreamResults> streamed =
      Client(server.address())->AttendStream(IdRequests({"m", "m", "m"}));
  EXPECT_EQ(streamed.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(server.calls(), 1);
}

TEST(ClientStreamRetryTest, AnswerErrorCodesBecomeStatuses) {
  ScriptedServer server({Script::kAnswerAll});
  absl::StatusOr<AttentionClient::StreamResults> streamed =
      Client(server.address())
          ->AttendStream(IdRequests({"error:5", "m", "error:0", "error:99", "error:16"}));
  ASSERT_TRUE(streamed.ok()) << streamed.status();
  ASSERT_EQ(streamed->size(), 5u);
  EXPECT_EQ((*streamed)[0].status(), absl::NotFoundError("scripted error"));
  EXPECT_TRUE((*streamed)[1].ok());
  // Not an error code: still an error, naming what came.
  EXPECT_EQ((*streamed)[2].status().code(), absl::StatusCode::kUnknown);
  EXPECT_THAT((*streamed)[2].status().message(), HasSubstr("code 0"));
  EXPECT_EQ((*streamed)[3].status().code(), absl::StatusCode::kUnknown);
  EXPECT_THAT((*streamed)[3].status().message(), HasSubstr("code 99"));
  EXPECT_EQ((*streamed)[4].status().code(), absl::StatusCode::kUnauthenticated);
}

TEST(ClientStreamRetryTest, AnswerCountOtherThanRequestCountIsInternal) {
  ScriptedServer none({Script::kAnswerNone});
  absl::StatusOr<AttentionClient::StreamResults> streamed =
      Client(none.address())->AttendStream(IdRequests({"m", "m", "m"}));
  EXPECT_EQ(streamed.status().code(), absl::StatusCode::kInternal);
  EXPECT_THAT(streamed.status().message(), HasSubstr("answered 0 of 3"));

  ScriptedServer twice({Script::kAnswerEveryOneTwice});
  streamed = Client(twice.address())->AttendStream(IdRequests({"m", "m", "m"}));
  EXPECT_EQ(streamed.status().code(), absl::StatusCode::kInternal);
  EXPECT_THAT(streamed.status().message(), HasSubstr("answered 6 of 3"));
}

}  // namespace
}  // namespace attention::client
