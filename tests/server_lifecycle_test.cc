// server_lifecycle_test.cc: attention-server from start to exit. SIGTERM
// under load loses no accepted request and exits 0; health turns NOT_SERVING;
// bad model files are skipped with their reason (fatal with --strict);
// flags come from the command line or ATTENTION_* variables; logs can be JSON.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <signal.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_split.h"
#include "health.grpc.pb.h"
#include "nlohmann/json.hpp"
#include "tests/server_test_util.h"

namespace attention::testing {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

v1::AttendRequest LoadRequest(int id) {
  v1::AttendRequest request;
  request.set_model("dot_product");
  request.set_request_id(std::to_string(id));
  const int n = 64, d = 32;
  v1::Tensor* queries = request.mutable_queries();
  for (int64_t s : {2, n, d}) queries->add_shape(s);
  for (int i = 0; i < 2 * n * d; ++i) queries->add_data(static_cast<float>((i + id) % 7) * 0.1f);
  return request;
}

// The server logs every request that reached the service (debug level for
// answers, warning for failures), so the test can tell accepted requests from
// calls that gRPC refused in transit while the listener closed (those never
// reach the service and count as not accepted).
TEST(ServerLifecycleTest, SigtermUnderLoadAnswersEveryAcceptedRequestAndExitsZero) {
  auto server = ServerProcess::Start(
      {"--max-batch-size", "4", "--shutdown-grace-seconds", "30", "--log-level", "debug"});
  ASSERT_TRUE(server.ok()) << server.status();
  constexpr int kClients = 16, kMaxCallsPerClient = 400;

  std::atomic<int> answered{0};
  std::mutex mu;
  std::map<std::string, std::string> client_codes;  // request_id -> code the client got
  std::vector<std::string> wrong;                   // OK answers that are not the request's
  std::vector<std::thread> clients;
  for (int c = 0; c < kClients; ++c) {
    clients.emplace_back([&, c] {
      auto stub = (*server)->Stub();
      for (int i = 0; i < kMaxCallsPerClient; ++i) {
        const v1::AttendRequest request = LoadRequest(c * kMaxCallsPerClient + i);
        grpc::ClientContext context;
        v1::AttendResponse response;
        const grpc::Status status = stub->Attend(&context, request, &response);
        std::lock_guard<std::mutex> lock(mu);
        client_codes[request.request_id()] = CodeName(status.error_code());
        if (!status.ok()) return;  // refused: the server is going away
        ++answered;
        if (response.request_id() != request.request_id() ||
            response.output().data_size() != request.queries().data_size()) {
          wrong.push_back(request.request_id());
        }
      }
    });
  }
  while (answered.load() < 100) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  (*server)->Signal(SIGTERM);
  for (auto& client : clients) client.join();
  EXPECT_EQ((*server)->Wait(), 0) << (*server)->Log();
  EXPECT_THAT(wrong, ::testing::IsEmpty());

  // request_id -> code, for every request that reached the service.
  std::map<std::string, std::string> server_codes;
  const std::string log = (*server)->Log();
  for (absl::string_view line : absl::StrSplit(log, '\n')) {
    const size_t id_at = line.find("request_id='");
    if (id_at == absl::string_view::npos) continue;
    absl::string_view id = line.substr(id_at + 12);
    id = id.substr(0, id.find('\''));
    if (line.find("request done") != absl::string_view::npos) {
      server_codes[std::string(id)] = "OK";
    } else if (const size_t code_at = line.find(" code="); code_at != absl::string_view::npos) {
      absl::string_view code = line.substr(code_at + 6);
      server_codes[std::string(id)] = std::string(code.substr(0, code.find(' ')));
    }
  }
  int ok = 0;
  for (const auto& [id, code] : client_codes) {
    auto accepted = server_codes.find(id);
    if (code == "OK") {
      ++ok;
      EXPECT_TRUE(accepted != server_codes.end()) << id << " answered but not logged";
    } else if (accepted != server_codes.end()) {
      // Reached the service: only a clean refusal is allowed, never a loss.
      EXPECT_EQ(accepted->second, "UNAVAILABLE") << id;
      EXPECT_EQ(code, "UNAVAILABLE") << id;
    } else {
      EXPECT_TRUE(code == "UNAVAILABLE" || code == "CANCELLED") << id << ": " << code;
    }
  }
  for (const auto& [id, code] : server_codes) {
    if (code == "OK") {
      EXPECT_EQ(client_codes[id], "OK") << "request " << id << " was computed, its answer lost";
    }
  }
  EXPECT_GE(ok, 100);
  EXPECT_THAT(log, HasSubstr("SIGTERM received"));
  EXPECT_THAT(log, HasSubstr("stopped"));
}

TEST(ServerLifecycleTest, HealthTurnsNotServingOnSigterm) {
  auto server = ServerProcess::Start({"--shutdown-grace-seconds", "2"});
  ASSERT_TRUE(server.ok()) << server.status();
  auto health = grpc::health::v1::Health::NewStub((*server)->Channel());
  grpc::ClientContext context;
  grpc::health::v1::HealthCheckRequest request;
  auto watch = health->Watch(&context, request);
  grpc::health::v1::HealthCheckResponse response;
  ASSERT_TRUE(watch->Read(&response));
  EXPECT_EQ(response.status(), grpc::health::v1::HealthCheckResponse::SERVING);

  (*server)->Signal(SIGTERM);
  ASSERT_TRUE(watch->Read(&response));
  EXPECT_EQ(response.status(), grpc::health::v1::HealthCheckResponse::NOT_SERVING);
  context.TryCancel();
  watch->Finish();
  EXPECT_EQ((*server)->Wait(), 0) << (*server)->Log();
}

// The kernel hands a signal sent to the process to any thread that does not
// block it, and threads that libraries start before main() (OpenBLAS's) block
// nothing: the server must drain whichever thread receives SIGTERM. Sending
// it to every thread reaches those too.
TEST(ServerLifecycleTest, SigtermToAnyThreadDrainsAndExitsZero) {
  auto server = ServerProcess::Start({"--shutdown-grace-seconds", "5"});
  ASSERT_TRUE(server.ok()) << server.status();
  const pid_t pid = (*server)->pid();
  std::vector<pid_t> threads;
  for (const auto& entry :
       std::filesystem::directory_iterator("/proc/" + std::to_string(pid) + "/task")) {
    threads.push_back(std::stoi(entry.path().filename().string()));
  }
  ASSERT_GT(threads.size(), 1u);
  for (pid_t thread : threads) syscall(SYS_tgkill, pid, thread, SIGTERM);
  EXPECT_EQ((*server)->Wait(), 0) << (*server)->Log();
  EXPECT_THAT((*server)->Log(), HasSubstr("SIGTERM received"));
}

class ServerRepositoryTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::filesystem::copy_file(ConformanceDir() / "models" / "bilinear_small.safetensors",
                               dir_.path() / "good.safetensors");
    std::ofstream(dir_.path() / "broken.safetensors") << "not a safetensors file";
    std::ofstream(dir_.path() / "notes.txt") << "ignored: not a model file";
  }
  TempDir dir_;
};

TEST_F(ServerRepositoryTest, BadFileIsLoggedWithItsReasonAndSkipped) {
  auto server = ServerProcess::Start({"--model-repository", dir_.path().string()});
  ASSERT_TRUE(server.ok()) << server.status();
  auto stub = (*server)->Stub();
  grpc::ClientContext context;
  v1::ListModelsResponse response;
  ASSERT_TRUE(stub->ListModels(&context, v1::ListModelsRequest(), &response).ok());
  std::set<std::string> names;
  for (const auto& model : response.models()) names.insert(model.name());
  EXPECT_EQ(names, (std::set<std::string>{"dot_product", "distance", "good"}));
  stub.reset();
  EXPECT_EQ((*server)->Stop(), 0);

  const std::string log = (*server)->Log();
  EXPECT_THAT(log, HasSubstr("model skipped"));
  EXPECT_THAT(log, HasSubstr("broken"));
  EXPECT_THAT(log, HasSubstr("model good (bilinear, d_q=6 d_k=4)"));
}

TEST_F(ServerRepositoryTest, StrictMakesABadFileFatal) {
  std::string output;
  const int code = ServerProcess::RunToExit(
      {"--address", "127.0.0.1:0", "--metrics-address", "", "--model-repository",
       dir_.path().string(), "--strict"},
      {}, &output);
  EXPECT_NE(code, 0);
  EXPECT_THAT(output, HasSubstr("broken"));
}

TEST(ServerConfigTest, EnvironmentSetsFlagsAndTheCommandLineWins) {
  auto server = ServerProcess::Start(
      {"--queue-capacity", "77"},
      {{"ATTENTION_MAX_BATCH_SIZE", "3"}, {"ATTENTION_QUEUE_CAPACITY", "99"},
       {"ATTENTION_LOG_FORMAT", "json"}});
  ASSERT_TRUE(server.ok()) << server.status();
  EXPECT_EQ((*server)->Stop(), 0);
  const std::string log = (*server)->Log();
  EXPECT_THAT(log, HasSubstr("--max-batch-size 3 "));
  EXPECT_THAT(log, HasSubstr("--queue-capacity 77"));
  EXPECT_THAT(log, Not(HasSubstr("--queue-capacity 99")));
  // --log-format json (from the environment): every line is one JSON object.
  int lines = 0;
  for (absl::string_view line : absl::StrSplit(log, '\n', absl::SkipEmpty())) {
    const nlohmann::json parsed = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    ASSERT_TRUE(parsed.is_object()) << line;
    EXPECT_TRUE(parsed.contains("time") && parsed.contains("level") && parsed.contains("message"));
    ++lines;
  }
  EXPECT_GT(lines, 3);
}

TEST(ServerConfigTest, HelpDocumentsEveryFlagWithItsDefaultAndVariable) {
  std::string help;
  ASSERT_EQ(ServerProcess::RunToExit({"--help"}, {}, &help), 0);
  for (const char* flag :
       {"--address", "--metrics-address", "--model-repository", "--strict", "--max-batch-size",
        "--max-queue-delay-us", "--queue-capacity", "--max-message-bytes",
        "--max-request-elements", "--threads", "--shutdown-grace-seconds",
        "--max-connection-age-seconds", "--log-level", "--log-format", "--tls-cert", "--tls-key",
        "--tls-client-ca", "--auth-token-file"}) {
    EXPECT_THAT(help, HasSubstr(flag));
  }
  EXPECT_THAT(help, HasSubstr("--address TEXT=0.0.0.0:50051"));
  EXPECT_THAT(help, HasSubstr("--metrics-address TEXT=0.0.0.0:9464"));
  EXPECT_THAT(help, HasSubstr("ATTENTION_MAX_BATCH_SIZE"));
}

TEST(ServerConfigTest, OutOfRangeFlagIsRefused) {
  std::string output;
  EXPECT_NE(ServerProcess::RunToExit({"--max-batch-size", "0"}, {}, &output), 0);
  EXPECT_THAT(output, HasSubstr("--max-batch-size"));
}

TEST(ServerConfigTest, OversizedRequestIsInvalidArgumentBeforeAnyWork) {
  auto server = ServerProcess::Start({"--max-request-elements", "1000"});
  ASSERT_TRUE(server.ok()) << server.status();
  {
    auto stub = (*server)->Stub();
    v1::AttendRequest request = LoadRequest(0);  // 2*64*32 queries alone
    grpc::ClientContext context;
    v1::AttendResponse response;
    const grpc::Status status = stub->Attend(&context, request, &response);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << status.error_message();
    EXPECT_THAT(status.error_message(), HasSubstr("1000"));
  }
  EXPECT_EQ((*server)->Stop(), 0);
}

TEST(ServerConfigTest, MessageAboveMaxMessageBytesIsRefused) {
  auto server = ServerProcess::Start({"--max-message-bytes", "4096"});
  ASSERT_TRUE(server.ok()) << server.status();
  {
    auto stub = (*server)->Stub();
    grpc::ClientContext context;
    v1::AttendResponse response;
    EXPECT_EQ(stub->Attend(&context, LoadRequest(0), &response).error_code(),
              grpc::StatusCode::RESOURCE_EXHAUSTED);
  }
  EXPECT_EQ((*server)->Stop(), 0);
}

}  // namespace
}  // namespace attention::testing
