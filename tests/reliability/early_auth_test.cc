// early_auth_test.cc: with bearer tokens, on a TLS port and on a plaintext
// one, a call without an accepted token is refused from its metadata, before
// gRPC reads and parses its message (docs/api.md, section 6.3). `repeated int64 shape` sent as
// 1-byte varints becomes 8 bytes per entry when parsed: a 20 MB message of
// them is 160 MB of parsed shape, which the server used to build before it
// looked at the token.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <string>

#include "health.grpc.pb.h"
#include "tests/support/certificates.h"
#include "tests/support/metrics.h"
#include "tests/support/probes.h"
#include "tests/support/requests.h"
#include "tests/support/server_process.h"

namespace attention::testing {
namespace {

// Two unauthenticated 20 MB shape lists are refused UNAUTHENTICATED without
// the server parsing them; the right token and health still get through.
void ExpectRefusedBeforeParsing(ServerProcess& server,
                                const std::shared_ptr<grpc::Channel>& channel) {
  auto stub = v1::AttentionService::NewStub(channel);
  v1::AttendRequest huge;
  huge.set_model("dot_product");
  huge.mutable_queries()->mutable_shape()->Resize(20'000'000, 1);
  ASSERT_GT(huge.ByteSizeLong(), 20'000'000u);
  for (const char* token : {"", "wrong-token"}) {
    SCOPED_TRACE(token);
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    if (*token != '\0') context.AddMetadata("authorization", std::string("Bearer ") + token);
    v1::AttendResponse response;
    const grpc::Status refused = stub->Attend(&context, huge, &response);
    EXPECT_EQ(refused.error_code(), grpc::StatusCode::UNAUTHENTICATED) << refused.error_message();
  }
  const int64_t peak = PeakResidentBytes(server.pid());
  std::printf("server peak RSS after two refused 20 MB messages: %lld MiB\n",
              static_cast<long long>(peak >> 20));
  EXPECT_GT(peak, 0);
  if (!kSanitizedBuild) {
    EXPECT_LT(peak, int64_t{100} << 20) << "peak RSS " << (peak >> 20) << " MiB";
  }

  // The right token still gets through, and health needs none.
  v1::AttendRequest small;
  small.set_model("dot_product");
  for (int64_t s : {1, 1, 2}) small.mutable_queries()->add_shape(s);
  small.mutable_queries()->mutable_data()->Resize(2, 1.0f);
  grpc::ClientContext context;
  context.AddMetadata("authorization", "Bearer right-token");
  v1::AttendResponse response;
  EXPECT_TRUE(stub->Attend(&context, small, &response).ok());
  grpc::ClientContext health_context;
  grpc::health::v1::HealthCheckResponse health;
  EXPECT_TRUE(grpc::health::v1::Health::NewStub(channel)
                  ->Check(&health_context, grpc::health::v1::HealthCheckRequest(), &health)
                  .ok());
}

TEST(EarlyAuthTest, UnauthenticatedHugeShapeListIsRefusedBeforeItIsParsed) {
  TestPki certificates({"ca"}, {{.name = "server"}});
  ASSERT_TRUE(certificates.ok()) << certificates.log();
  TempDir dir;
  const std::string tokens = (dir.path() / "tokens").string();
  std::ofstream(tokens) << "right-token\n";
  auto server = ServerProcess::Start({"--tls-cert", certificates.Path("server.crt"), "--tls-key",
                                      certificates.Path("server.key"), "--auth-token-file",
                                      tokens});
  ASSERT_TRUE(server.ok()) << server.status();
  grpc::SslCredentialsOptions tls;
  tls.pem_root_certs = certificates.Pem("ca.crt");
  grpc::ChannelArguments args;
  args.SetMaxSendMessageSize(-1);
  ExpectRefusedBeforeParsing(
      **server, grpc::CreateCustomChannel((*server)->address(), grpc::SslCredentials(tls), args));
  EXPECT_EQ((*server)->Stop(), 0);
}

// The same on a plaintext port: the server's plaintext credentials carry the
// same auth metadata processor (server/tls_credentials.cc).
TEST(EarlyAuthTest, PlaintextPortRefusesBeforeParsingToo) {
  TempDir dir;
  const std::string tokens = (dir.path() / "tokens").string();
  std::ofstream(tokens) << "right-token\n";
  auto server = ServerProcess::Start({"--auth-token-file", tokens});
  ASSERT_TRUE(server.ok()) << server.status();
  grpc::ChannelArguments args;
  args.SetMaxSendMessageSize(-1);
  ExpectRefusedBeforeParsing(**server,
                             grpc::CreateCustomChannel((*server)->address(),
                                                       grpc::InsecureChannelCredentials(), args));
  EXPECT_EQ((*server)->Stop(), 0);
}

}  // namespace
}  // namespace attention::testing
