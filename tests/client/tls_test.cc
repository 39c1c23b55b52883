// client_tls_test.cc: the AttentionClient's security options against a real
// attention-server: TLS with a private CA (also over a balanced list of
// targets), mutual TLS, and the bearer token. Certificates:
// tests/support/certificates.h.
#include <cstdlib>
#include <fstream>
#include <functional>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "client/cpp/attention_client.h"
#include "tests/support/certificates.h"
#include "tests/support/files.h"
#include "tests/support/server_process.h"

namespace attention::client {
namespace {

using attention::testing::ServerProcess;
using attention::testing::TestPki;
using attention::testing::WriteFile;
using attention::testing::TempDir;
using grpc::health::v1::HealthCheckResponse;

using Edit = std::function<void(ClientOptions&)>;

// A client of `target` with the options `edit` sets.
std::unique_ptr<AttentionClient> Client(const std::string& target, const Edit& edit = {}) {
  ClientOptions options;
  options.target = target;
  options.timeout = absl::Seconds(10);
  options.retry.max_attempts = 2;
  if (edit) edit(options);
  absl::StatusOr<std::unique_ptr<AttentionClient>> client = AttentionClient::Create(options);
  EXPECT_TRUE(client.ok()) << client.status();
  return client.ok() ? *std::move(client) : nullptr;
}

absl::StatusCode ListModelsCode(const std::string& target, const Edit& edit = {}) {
  return Client(target, edit)->ListModels().status().code();
}

// "localhost:PORT" for a server listening on 127.0.0.1:PORT.
std::string Localhost(const ServerProcess& server) {
  return "localhost" + server.address().substr(server.address().find(':'));
}

class ClientTlsTest : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_TRUE(certificates_.ok()) << certificates_.log(); }

  absl::StatusOr<std::unique_ptr<ServerProcess>> StartTlsServer(
      std::vector<std::string> extra_flags = {}) {
    std::vector<std::string> flags = {"--threads", "1", "--tls-cert",
                                      certificates_.Path("server.crt"), "--tls-key",
                                      certificates_.Path("server.key")};
    flags.insert(flags.end(), extra_flags.begin(), extra_flags.end());
    return ServerProcess::Start(flags);
  }

  // A CA, and a server (localhost, 127.0.0.1) and a client certificate it signed.
  TestPki certificates_{{"ca"}, {{.name = "server"}, {.name = "client", .hosts = ""}}};
};

TEST_F(ClientTlsTest, TrustsTheServerThroughTheGivenCa) {
  auto server = StartTlsServer();
  ASSERT_TRUE(server.ok()) << server.status();
  const std::string ca = certificates_.Path("ca.crt");
  EXPECT_EQ(ListModelsCode((*server)->address(), [&](ClientOptions& o) { o.tls_ca_file = ca; }),
            absl::StatusCode::kOk);
  EXPECT_EQ(ListModelsCode(Localhost(**server), [&](ClientOptions& o) { o.tls_ca_file = ca; }),
            absl::StatusCode::kOk);
  // Plaintext to a TLS port, and TLS without the private CA, cannot connect.
  EXPECT_EQ(ListModelsCode((*server)->address()), absl::StatusCode::kUnavailable);
  EXPECT_EQ(ListModelsCode((*server)->address(), [](ClientOptions& o) { o.tls = true; }),
            absl::StatusCode::kUnavailable);
  // A name the certificate does not carry is refused.
  EXPECT_EQ(ListModelsCode((*server)->address(),
                           [&](ClientOptions& o) {
                             o.tls_ca_file = ca;
                             o.tls_server_name = "elsewhere.example";
                           }),
            absl::StatusCode::kUnavailable);
}

TEST_F(ClientTlsTest, BalancedHostListChecksTheFirstHostName) {
  auto first = StartTlsServer();
  auto second = StartTlsServer();
  ASSERT_TRUE(first.ok() && second.ok());
  auto client = Client(Localhost(**first) + "," + Localhost(**second),
                       [&](ClientOptions& o) { o.tls_ca_file = certificates_.Path("ca.crt"); });
  for (int call = 0; call < 4; ++call) {
    EXPECT_EQ(client->ListModels().status().code(), absl::StatusCode::kOk) << "call " << call;
  }
}

TEST_F(ClientTlsTest, MutualTlsNeedsTheClientCertificate) {
  auto server = StartTlsServer({"--tls-client-ca", certificates_.Path("ca.crt")});
  ASSERT_TRUE(server.ok()) << server.status();
  const std::string ca = certificates_.Path("ca.crt");
  EXPECT_EQ(ListModelsCode((*server)->address(),
                           [&](ClientOptions& o) {
                             o.tls_ca_file = ca;
                             o.tls_cert_file = certificates_.Path("client.crt");
                             o.tls_key_file = certificates_.Path("client.key");
                           }),
            absl::StatusCode::kOk);
  EXPECT_EQ(ListModelsCode((*server)->address(), [&](ClientOptions& o) { o.tls_ca_file = ca; }),
            absl::StatusCode::kUnavailable);
}

TEST(ClientTokenTest, BearerTokenIsWhatTheServerChecks) {
  TempDir dir;
  const std::string tokens = (dir.path() / "tokens").string();
  WriteFile(tokens, "# accepted tokens\ns3cret\n");
  auto server = ServerProcess::Start({"--threads", "1", "--auth-token-file", tokens});
  ASSERT_TRUE(server.ok()) << server.status();
  const std::string target = (*server)->address();

  EXPECT_EQ(ListModelsCode(target, [](ClientOptions& o) { o.token = "s3cret"; }), absl::StatusCode::kOk);
  EXPECT_EQ(ListModelsCode(target, [](ClientOptions& o) { o.token = "wrong"; }),
            absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(ListModelsCode(target), absl::StatusCode::kUnauthenticated);

  attention::v1::AttendRequest request;
  request.set_model("dot_product");
  request.mutable_queries()->add_shape(1);
  request.mutable_queries()->add_shape(1);
  request.mutable_queries()->add_shape(1);
  request.mutable_queries()->add_data(1.0f);
  EXPECT_EQ(Client(target)->Attend(request).status().code(),
            absl::StatusCode::kUnauthenticated);
  absl::StatusOr<attention::v1::AttendResponse> answer =
      Client(target, [](ClientOptions& o) { o.token = "s3cret"; })->Attend(request);
  ASSERT_TRUE(answer.ok()) << answer.status();
  // One key with value 1: the output is that value.
  EXPECT_THAT(answer->output().data(), ::testing::ElementsAre(1.0f));

  // Health stays open, for load balancers and HEALTHCHECK.
  absl::StatusOr<HealthCheckResponse::ServingStatus> health = Client(target)->Health();
  ASSERT_TRUE(health.ok()) << health.status();
  EXPECT_EQ(*health, HealthCheckResponse::SERVING);
}

}  // namespace
}  // namespace attention::client
