// token_reload_test.cc: SIGHUP rereads --auth-token-file while the server
// serves (docs/api.md, section 6.3). Tokens are rotated under load (old and
// new accepted together, clients switch, then the old one is dropped)
// without one failed call; a reload that finds no token keeps the tokens in
// use. Before, SIGHUP's default action ended the server.
#include <signal.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>

#include "tests/support/files.h"
#include "tests/support/metrics.h"
#include "tests/support/probes.h"
#include "tests/support/requests.h"
#include "tests/support/server_process.h"

namespace attention::testing {
namespace {

using ::testing::HasSubstr;

grpc::StatusCode Call(v1::AttentionService::Stub& stub, const std::string& token) {
  v1::AttendRequest request;
  request.set_model("dot_product");
  for (int64_t s : {1, 2, 2}) request.mutable_queries()->add_shape(s);
  request.mutable_queries()->mutable_data()->Resize(4, 0.5f);
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  context.AddMetadata("authorization", "Bearer " + token);
  v1::AttendResponse response;
  return stub.Attend(&context, request, &response).error_code();
}

// Polls until a call with `token` ends `code`, for up to 10 s.
bool Becomes(v1::AttentionService::Stub& stub, const std::string& token, grpc::StatusCode code) {
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (std::chrono::steady_clock::now() < give_up) {
    if (Call(stub, token) == code) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return false;
}

TEST(TokenReloadTest, SighupRotatesTokensUnderLoadWithoutAFailedCall) {
  TempDir dir;
  const std::filesystem::path tokens = dir.path() / "tokens";
  ReplaceFile(tokens, "alpha\n");
  auto server = ServerProcess::Start({"--auth-token-file", tokens.string()});
  ASSERT_TRUE(server.ok()) << server.status();
  auto stub = (*server)->Stub();
  ASSERT_EQ(Call(*stub, "beta"), grpc::StatusCode::UNAUTHENTICATED);

  std::atomic<bool> use_beta{false};
  std::atomic<bool> stop{false};
  std::atomic<int> calls{0};
  std::atomic<int> failures{0};
  std::thread load([&] {
    while (!stop.load()) {
      if (Call(*stub, use_beta.load() ? "beta" : "alpha") != grpc::StatusCode::OK) ++failures;
      ++calls;
    }
  });

  ReplaceFile(tokens, "alpha\nbeta\n");
  (*server)->Signal(SIGHUP);
  EXPECT_TRUE(Becomes(*stub, "beta", grpc::StatusCode::OK));
  use_beta = true;
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  ReplaceFile(tokens, "beta\n");
  (*server)->Signal(SIGHUP);
  EXPECT_TRUE(Becomes(*stub, "alpha", grpc::StatusCode::UNAUTHENTICATED));

  // A file with no token is refused; the tokens in use stay.
  ReplaceFile(tokens, "# emptied by mistake\n");
  (*server)->Signal(SIGHUP);
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  stop = true;
  load.join();
  EXPECT_EQ(Call(*stub, "beta"), grpc::StatusCode::OK);
  EXPECT_GT(calls.load(), 20);
  EXPECT_EQ(failures.load(), 0) << "of " << calls.load() << " calls during the rotation";
  stub.reset();
  EXPECT_EQ((*server)->Stop(), 0) << (*server)->Log();
  const std::string log = (*server)->Log();
  EXPECT_THAT(log, HasSubstr("SIGHUP: --auth-token-file reloaded (2 tokens)"));
  EXPECT_THAT(log, HasSubstr("SIGHUP: --auth-token-file not reloaded, the previous tokens stay"));
  EXPECT_THAT(log, ::testing::Not(HasSubstr("alpha")));
}

}  // namespace
}  // namespace attention::testing
