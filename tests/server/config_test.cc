// config_test.cc: how attention-server is set up. Bad model files are
// skipped with their reason (fatal with --strict); flags come from the command
// line or ATTENTION_* variables, with documented defaults and ranges; logs can
// be JSON; size limits refuse a request before any work. (SIGTERM and the
// drain: tests/reliability/shutdown_test.cc.)
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <memory>
#include <fstream>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_split.h"
#include "core/kernels/cpu_features.h"
#include "nlohmann/json.hpp"
#include "tests/support/metrics.h"
#include "tests/support/requests.h"
#include "tests/support/safetensors_builder.h"
#include "tests/support/server_process.h"

namespace attention::testing {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

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
  EXPECT_THAT(log, HasSubstr("model good (bilinear, d_q=6 d_k=4, precision fp32)"));
}

// A bf16 file is served as bf16 (ListModels, the start-up log), and as fp32
// under ATTENTION_FORCE_FP32, the variable of --force-fp32.
TEST_F(ServerRepositoryTest, Bf16ModelIsReportedAndForcedFp32OnRequest) {
  const std::vector<uint8_t> bytes = testing::BuildFile(
      {testing::F32Tensor("in_proj_weight", {6, 2}, std::vector<float>(12, 0.5f)),
       testing::F32Tensor("out_proj.weight", {2, 2}, {1, 0, 0, 1})},
      {{"kind", "multi_head"}, {"num_heads", "1"}, {"precision", "bf16"}});
  std::ofstream(dir_.path() / "half.safetensors", std::ios::binary)
      << std::string(bytes.begin(), bytes.end());
  for (const bool forced : {false, true}) {
    SCOPED_TRACE(forced ? "ATTENTION_FORCE_FP32=1" : "not forced");
    const std::string expected = forced ? "fp32" : "bf16";
    std::map<std::string, std::string> env;
    if (forced) env["ATTENTION_FORCE_FP32"] = "1";
    auto server = ServerProcess::Start({"--model-repository", dir_.path().string()}, env);
    ASSERT_TRUE(server.ok()) << server.status();
    auto stub = (*server)->Stub();
    grpc::ClientContext context;
    v1::ListModelsResponse response;
    ASSERT_TRUE(stub->ListModels(&context, v1::ListModelsRequest(), &response).ok());
    std::map<std::string, std::string> precisions;
    for (const auto& model : response.models()) precisions[model.name()] = model.precision();
    EXPECT_EQ(precisions["half"], expected);
    EXPECT_EQ(precisions["good"], "fp32");
    stub.reset();
    EXPECT_EQ((*server)->Stop(), 0);
    EXPECT_THAT((*server)->Log(), HasSubstr("E=2, precision " + expected + "), version 1"));
  }
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
        "--tls-client-ca", "--auth-token-file", "--warmup", "--warmup-work-budget"}) {
    EXPECT_THAT(help, HasSubstr(flag));
  }
  EXPECT_THAT(help, HasSubstr("--address TEXT=0.0.0.0:50051"));
  EXPECT_THAT(help, HasSubstr("--metrics-address TEXT=0.0.0.0:9464"));
  EXPECT_THAT(help, HasSubstr("--http-address TEXT=0.0.0.0:8000"));
  EXPECT_THAT(help, HasSubstr("ATTENTION_HTTP_ADDRESS"));
  EXPECT_THAT(help, HasSubstr("ATTENTION_MAX_BATCH_SIZE"));
  EXPECT_THAT(help, HasSubstr("--batching-delay"));
  EXPECT_THAT(help, HasSubstr("ATTENTION_BATCHING_DELAY"));
}

// The kernel path: the CPU's best unless --isa (or ATTENTION_ISA) forces a
// lower one; attention_build_info and the start-up log say which runs.
std::string BuildInfo(const ServerProcess& server) {
  for (absl::string_view line : absl::StrSplit(ScrapeMetrics(server.metrics_address()), '\n')) {
    if (absl::StartsWith(line, "attention_build_info{")) return std::string(line);
  }
  return "";
}

TEST(ServerConfigTest, KernelPathIsTheCpusBestUnlessForcedLower) {
  const std::string best(IsaName(DetectedIsa()));
  auto detected = ServerProcess::Start({}, {{"ATTENTION_ISA", ""}});
  ASSERT_TRUE(detected.ok()) << detected.status();
  EXPECT_THAT(BuildInfo(**detected), HasSubstr("isa=\"" + best + "\""));
  EXPECT_THAT(BuildInfo(**detected), HasSubstr("detected_isa=\"" + best + "\""));
  EXPECT_THAT(BuildInfo(**detected), ::testing::EndsWith("} 1"));
  EXPECT_EQ((*detected)->Stop(), 0);
  EXPECT_THAT((*detected)->Log(), HasSubstr("kernel path " + best));

  // The flag wins over the environment.
  auto forced = ServerProcess::Start({"--isa", "portable"}, {{"ATTENTION_ISA", best}});
  ASSERT_TRUE(forced.ok()) << forced.status();
  EXPECT_THAT(BuildInfo(**forced), HasSubstr("isa=\"portable\""));
  EXPECT_THAT(BuildInfo(**forced), HasSubstr("detected_isa=\"" + best + "\""));
  std::unique_ptr<v1::AttentionService::Stub> stub = (*forced)->Stub();
  const v1::AttendRequest request = SelfAttentionRequest(2, 70, 16, 5);
  grpc::ClientContext context;
  v1::AttendResponse response;
  ASSERT_TRUE(stub->Attend(&context, request, &response).ok());
  EXPECT_EQ(CheckAnswer(request, response), "");
  EXPECT_EQ((*forced)->Stop(), 0);
}

TEST(ServerConfigTest, UnknownKernelPathStopsTheServer) {
  std::string output;
  EXPECT_EQ(ServerProcess::RunToExit({"--isa", "sse9", "--address", "127.0.0.1:0",
                                      "--metrics-address", ""},
                                     {}, &output),
            1);
  EXPECT_THAT(output,
              HasSubstr("expected one of avx512_bf16, avx512, avx2, portable, got \"sse9\""));
}

TEST(ServerConfigTest, KernelPathTheCpuLacksStopsTheServer) {
  if (DetectedIsa() == Isa::kAvx512Bf16) {
    GTEST_SKIP() << "this host runs every path, so none can be refused";
  }
  std::string output;
  EXPECT_EQ(ServerProcess::RunToExit({"--address", "127.0.0.1:0", "--metrics-address", ""},
                                     {{"ATTENTION_ISA", "avx512_bf16"}}, &output),
            1);
  EXPECT_THAT(output, HasSubstr("avx512_bf16"));
}

TEST(ServerConfigTest, OutOfRangeFlagIsRefused) {
  std::string output;
  EXPECT_NE(ServerProcess::RunToExit({"--max-batch-size", "0"}, {}, &output), 0);
  EXPECT_THAT(output, HasSubstr("--max-batch-size"));
}

TEST(ServerConfigTest, UnknownKvCacheDtypeStopsTheServerNamingTheFlag) {
  for (const char* value : {"fp16", "bf16", ""}) {
    std::string output;
    EXPECT_NE(ServerProcess::RunToExit({"--kv-cache-dtype", value}, {}, &output), 0);
    EXPECT_THAT(output, HasSubstr("--kv-cache-dtype is \"" + std::string(value) +
                                  "\", expected float32, bfloat16 or float16"));
  }
  std::string output;
  EXPECT_NE(ServerProcess::RunToExit({}, {{"ATTENTION_KV_CACHE_DTYPE", "half"}}, &output), 0);
  EXPECT_THAT(output, HasSubstr("--kv-cache-dtype is \"half\""));
}

TEST(ServerConfigTest, SessionPreemptionTakesOnOrOff) {
  std::string output;
  EXPECT_NE(ServerProcess::RunToExit({"--session-preemption", "maybe"}, {}, &output), 0);
  EXPECT_THAT(output, HasSubstr("--session-preemption"));
  output.clear();
  EXPECT_NE(ServerProcess::RunToExit({}, {{"ATTENTION_SESSION_PREEMPTION", "yes"}}, &output), 0);
  EXPECT_THAT(output, HasSubstr("--session-preemption"));
  std::string help;
  ASSERT_EQ(ServerProcess::RunToExit({"--help"}, {}, &help), 0);
  EXPECT_THAT(help, HasSubstr("ATTENTION_SESSION_PREEMPTION"));
}

TEST(ServerConfigTest, OversizedRequestIsInvalidArgumentBeforeAnyWork) {
  auto server = ServerProcess::Start({"--max-request-elements", "1000"});
  ASSERT_TRUE(server.ok()) << server.status();
  {
    auto stub = (*server)->Stub();
    v1::AttendRequest request = SelfAttentionRequest(2, 64, 32, 0);  // 2*64*32 queries alone
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
    EXPECT_EQ(stub->Attend(&context, SelfAttentionRequest(2, 64, 32, 0), &response).error_code(),
              grpc::StatusCode::RESOURCE_EXHAUSTED);
  }
  EXPECT_EQ((*server)->Stop(), 0);
}

// A Unix socket address serves, and the port file names it as given (no
// port to add), so a client can read it from there.
TEST(ServerConfigTest, UnixSocketAddressServesAndIsWrittenAsGiven) {
  TempDir dir;
  const std::string address = "unix:" + (dir.path() / "attention.sock").string();
  auto server = ServerProcess::Start({"--address", address});
  ASSERT_TRUE(server.ok()) << server.status();
  EXPECT_EQ((*server)->address(), address);
  const v1::AttendRequest request = SelfAttentionRequest(1, 2, 2, 0);
  grpc::ClientContext context;
  v1::AttendResponse response;
  const grpc::Status status = (*server)->Stub()->Attend(&context, request, &response);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(CheckAnswer(request, response), "");
  EXPECT_EQ((*server)->Stop(), 0) << (*server)->Log();
}

// The channel's connection is READY after a call; true when it leaves READY
// (the server's GOAWAY) within `wait`.
bool ConnectionEndsWithin(grpc::Channel& channel, std::chrono::seconds wait) {
  return channel.WaitForStateChange(GRPC_CHANNEL_READY, std::chrono::system_clock::now() + wait);
}

// --max-connection-age-seconds makes the server close each connection (GOAWAY)
// after that age, so clients reconnect and a load balancer in front sees new
// connections; without it a connection stays.
// With `flag` 1 the server closes a connection on which nothing is running
// within 20 s (1 s, its jitter and then some), and the client reconnects for
// its next call; without the flag (the control) the connection stays 3 s.
void ExpectConnectionClosedBy(const std::string& flag) {
  for (const bool set : {true, false}) {
    SCOPED_TRACE(set ? flag + " 1" : "without " + flag);
    std::vector<std::string> flags;
    if (set) flags = {flag, "1"};
    auto server = ServerProcess::Start(flags);
    ASSERT_TRUE(server.ok()) << server.status();
    const std::shared_ptr<grpc::Channel> channel = (*server)->Channel();
    auto stub = v1::AttentionService::NewStub(channel);
    const v1::AttendRequest request = SelfAttentionRequest(1, 2, 2, 0);
    for (int call = 0; call < 2; ++call) {
      grpc::ClientContext context;
      v1::AttendResponse response;
      const grpc::Status status = stub->Attend(&context, request, &response);
      ASSERT_TRUE(status.ok()) << "call " << call << ": " << status.error_message();
      EXPECT_EQ(CheckAnswer(request, response), "");
      ASSERT_EQ(channel->GetState(false), GRPC_CHANNEL_READY);
      if (call == 0) {
        EXPECT_EQ(ConnectionEndsWithin(*channel, std::chrono::seconds(set ? 20 : 3)), set);
      }
    }
    stub.reset();
    EXPECT_EQ((*server)->Stop(), 0) << (*server)->Log();
  }
}

TEST(ServerConfigTest, MaxConnectionAgeClosesConnectionsAndClientsReconnect) {
  ExpectConnectionClosedBy("--max-connection-age-seconds");
}

TEST(ServerConfigTest, MaxConnectionIdleClosesIdleConnectionsAndClientsReconnect) {
  ExpectConnectionClosedBy("--max-connection-idle-seconds");
}

}  // namespace
}  // namespace attention::testing
