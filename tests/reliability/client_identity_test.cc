// client_identity_test.cc: the mutual-TLS identity allow-list,
// --tls-client-allow (docs/api.md, section 6.3). Without it any certificate
// the CA signed gets in; with it, only certificates naming an allowed
// identity (subject alternative name or common name), others get
// PERMISSION_DENIED naming what the certificate holds; health stays open.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>

#include "health.grpc.pb.h"
#include "tests/support/certificates.h"
#include "tests/support/metrics.h"
#include "tests/support/probes.h"
#include "tests/support/requests.h"
#include "tests/support/server_process.h"

namespace attention::testing {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

std::shared_ptr<grpc::Channel> ChannelAs(const TestPki& certificates,
                                         const std::string& address, const std::string& who) {
  grpc::SslCredentialsOptions options;
  options.pem_root_certs = certificates.Pem("ca.crt");
  options.pem_private_key = certificates.Pem(who + ".key");
  options.pem_cert_chain = certificates.Pem(who + ".crt");
  return grpc::CreateChannel(address, grpc::SslCredentials(options));
}

grpc::Status ListModels(const std::shared_ptr<grpc::Channel>& channel) {
  auto stub = v1::AttentionService::NewStub(channel);
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
  v1::ListModelsResponse response;
  return stub->ListModels(&context, v1::ListModelsRequest(), &response);
}

class ClientIdentityTest : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_TRUE(certificates_.ok()) << certificates_.log(); }
  std::vector<std::string> TlsFlags() const {
    return {"--tls-cert", certificates_.Path("server.crt"), "--tls-key",
            certificates_.Path("server.key"), "--tls-client-ca", certificates_.Path("ca.crt")};
  }
  // alice is named by her common name only, bob by a URI name as well.
  TestPki certificates_{{"ca"},
                        {{.name = "server"},
                         {.name = "alice", .hosts = ""},
                         {.name = "bob", .hosts = "URI:spiffe://test/bob"},
                         {.name = "mallory", .hosts = ""}}};
};

TEST_F(ClientIdentityTest, WithoutAnAllowListAnyCertificateOfTheCaGetsIn) {
  auto server = ServerProcess::Start(TlsFlags());
  ASSERT_TRUE(server.ok()) << server.status();
  EXPECT_TRUE(ListModels(ChannelAs(certificates_, (*server)->address(), "mallory")).ok());
  EXPECT_EQ((*server)->Stop(), 0);
}

TEST_F(ClientIdentityTest, OnlyAllowedNamesGetInByCommonNameOrSan) {
  std::vector<std::string> flags = TlsFlags();
  flags.insert(flags.end(), {"--tls-client-allow", "alice, spiffe://test/bob"});
  auto server = ServerProcess::Start(flags);
  ASSERT_TRUE(server.ok()) << server.status();
  const std::string address = (*server)->address();
  EXPECT_TRUE(ListModels(ChannelAs(certificates_, address, "alice")).ok());
  EXPECT_TRUE(ListModels(ChannelAs(certificates_, address, "bob")).ok());

  auto mallory = ChannelAs(certificates_, address, "mallory");
  const grpc::Status refused = ListModels(mallory);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::PERMISSION_DENIED) << refused.error_message();
  EXPECT_THAT(refused.error_message(),
              AllOf(HasSubstr("[mallory]"), HasSubstr("--tls-client-allow")));
  v1::AttendRequest request;
  request.set_model("dot_product");
  for (int64_t s : {1, 1, 1}) request.mutable_queries()->add_shape(s);
  request.mutable_queries()->add_data(1.0f);
  grpc::ClientContext context;
  v1::AttendResponse response;
  EXPECT_EQ(v1::AttentionService::NewStub(mallory)->Attend(&context, request, &response)
                .error_code(),
            grpc::StatusCode::PERMISSION_DENIED);
  // Probes need no identity.
  grpc::ClientContext health_context;
  grpc::health::v1::HealthCheckResponse health;
  EXPECT_TRUE(grpc::health::v1::Health::NewStub(mallory)
                  ->Check(&health_context, grpc::health::v1::HealthCheckRequest(), &health)
                  .ok());
  EXPECT_EQ((*server)->Stop(), 0);
}

TEST_F(ClientIdentityTest, AllowListWithoutMutualTlsIsAStartUpError) {
  std::string output;
  EXPECT_EQ(ServerProcess::RunToExit({"--address", "127.0.0.1:0", "--metrics-address", "",
                                      "--tls-client-allow", "alice"},
                                     {}, &output),
            1);
  EXPECT_THAT(output, HasSubstr("--tls-client-allow needs --tls-client-ca"));
}

}  // namespace
}  // namespace attention::testing
