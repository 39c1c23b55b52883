// server_security_test.cc: TLS, mutual TLS and bearer tokens accept the right
// peers and refuse the rest. Certificates are made here with openssl: a CA
// that signs the server and a client, and a rogue CA that signs another client.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>

#include "health.grpc.pb.h"
#include "tests/server_test_util.h"

namespace attention::testing {
namespace {

std::string Read(const std::filesystem::path& path) {
  std::ifstream in(path);
  std::ostringstream contents;
  contents << in.rdbuf();
  return contents.str();
}

v1::AttendRequest TinyRequest() {
  v1::AttendRequest request;
  request.set_model("dot_product");
  for (int64_t s : {1, 1, 2}) request.mutable_queries()->add_shape(s);
  for (float v : {0.5f, -0.5f}) request.mutable_queries()->add_data(v);
  return request;
}

grpc::StatusCode Attend(const std::shared_ptr<grpc::Channel>& channel,
                        const std::string& authorization = "") {
  auto stub = v1::AttentionService::NewStub(channel);
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
  if (!authorization.empty()) context.AddMetadata("authorization", authorization);
  v1::AttendResponse response;
  return stub->Attend(&context, TinyRequest(), &response).error_code();
}

class ServerSecurityTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new TempDir();
    const std::string d = dir_->path().string();
    // EC keys: quick to make. The server certificate names localhost and 127.0.0.1.
    const std::string key = "-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes";
    const std::string script =
        "set -e; cd '" + d + "'\n" +
        "printf 'subjectAltName=DNS:localhost,IP:127.0.0.1\\n' > server.ext\n" +
        "for ca in ca rogue; do openssl req -x509 " + key + " -keyout $ca.key -out $ca.crt " +
        "-days 1 -subj /CN=$ca 2>/dev/null; done\n" +
        "sign() { openssl req " + key + " -keyout $1.key -out $1.csr -subj /CN=$1 2>/dev/null; " +
        "openssl x509 -req -in $1.csr -CA $2.crt -CAkey $2.key -CAcreateserial -out $1.crt " +
        "-days 1 $3 2>/dev/null; }\n" +
        "sign server ca '-extfile server.ext'\nsign client ca ''\nsign intruder rogue ''\n";
    std::ofstream(dir_->path() / "make-certs.sh") << script;
    certs_ok_ = std::system(("bash '" + d + "/make-certs.sh'").c_str()) == 0;
  }
  static void TearDownTestSuite() {
    delete dir_;
    dir_ = nullptr;
  }
  void SetUp() override { ASSERT_TRUE(certs_ok_) << "openssl could not make the certificates"; }

  static std::string Path(const std::string& name) { return (dir_->path() / name).string(); }

  // A TLS channel that trusts `ca` and, when `client` is set, presents that
  // certificate.
  static std::shared_ptr<grpc::Channel> TlsChannel(const ServerProcess& server,
                                                   const std::string& ca,
                                                   const std::string& client = "") {
    grpc::SslCredentialsOptions options;
    options.pem_root_certs = Read(Path(ca + ".crt"));
    if (!client.empty()) {
      options.pem_private_key = Read(Path(client + ".key"));
      options.pem_cert_chain = Read(Path(client + ".crt"));
    }
    grpc::ChannelArguments args;
    args.SetSslTargetNameOverride("localhost");
    return grpc::CreateCustomChannel(server.address(), grpc::SslCredentials(options), args);
  }

  static TempDir* dir_;
  static bool certs_ok_;
};

TempDir* ServerSecurityTest::dir_ = nullptr;
bool ServerSecurityTest::certs_ok_ = false;

TEST_F(ServerSecurityTest, TlsAcceptsClientsTrustingItsCaAndRefusesTheRest) {
  auto server = ServerProcess::Start({"--tls-cert", Path("server.crt"), "--tls-key",
                                      Path("server.key")});
  ASSERT_TRUE(server.ok()) << server.status();
  EXPECT_EQ(Attend(TlsChannel(**server, "ca")), grpc::StatusCode::OK);
  EXPECT_EQ(Attend(TlsChannel(**server, "rogue")), grpc::StatusCode::UNAVAILABLE)
      << "a client that does not trust the server's CA must not connect";
  EXPECT_EQ(Attend((*server)->Channel()), grpc::StatusCode::UNAVAILABLE)
      << "plaintext must not reach a TLS server";
  EXPECT_EQ((*server)->Stop(), 0);
  EXPECT_THAT((*server)->Log(), ::testing::HasSubstr("(TLS)"));
}

TEST_F(ServerSecurityTest, MutualTlsAcceptsOnlyClientsSignedByTheClientCa) {
  auto server = ServerProcess::Start({"--tls-cert", Path("server.crt"), "--tls-key",
                                      Path("server.key"), "--tls-client-ca", Path("ca.crt")});
  ASSERT_TRUE(server.ok()) << server.status();
  EXPECT_EQ(Attend(TlsChannel(**server, "ca", "client")), grpc::StatusCode::OK);
  EXPECT_EQ(Attend(TlsChannel(**server, "ca")), grpc::StatusCode::UNAVAILABLE)
      << "a client without a certificate must be refused";
  EXPECT_EQ(Attend(TlsChannel(**server, "ca", "intruder")), grpc::StatusCode::UNAVAILABLE)
      << "a certificate from another CA must be refused";
  EXPECT_EQ((*server)->Stop(), 0);
  EXPECT_THAT((*server)->Log(), ::testing::HasSubstr("(mutual TLS)"));
}

TEST_F(ServerSecurityTest, TokensAreRequiredExceptForHealth) {
  std::ofstream(Path("tokens")) << "# operators\nfirst-token\n\n  second-token  \n";
  auto server = ServerProcess::Start({"--auth-token-file", Path("tokens")});
  ASSERT_TRUE(server.ok()) << server.status();
  const auto channel = (*server)->Channel();
  EXPECT_EQ(Attend(channel, "Bearer first-token"), grpc::StatusCode::OK);
  EXPECT_EQ(Attend(channel, "Bearer second-token"), grpc::StatusCode::OK);
  EXPECT_EQ(Attend(channel), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(Attend(channel, "Bearer first-toke"), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(Attend(channel, "Bearer # operators"), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(Attend(channel, "Basic first-token"), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(Attend(channel, "first-token"), grpc::StatusCode::UNAUTHENTICATED);

  auto stub = v1::AttentionService::NewStub(channel);
  {
    grpc::ClientContext context;
    v1::ListModelsResponse response;
    EXPECT_EQ(stub->ListModels(&context, v1::ListModelsRequest(), &response).error_code(),
              grpc::StatusCode::UNAUTHENTICATED);
  }
  {
    grpc::ClientContext context;
    auto stream = stub->AttendStream(&context);
    stream->Write(TinyRequest());
    stream->WritesDone();
    v1::AttendResponse response;
    while (stream->Read(&response)) {
    }
    EXPECT_EQ(stream->Finish().error_code(), grpc::StatusCode::UNAUTHENTICATED);
    EXPECT_EQ(MetricValue(ScrapeMetrics((*server)->metrics_address()),
                          "attention_streams_refused_total", {{"code", "UNAUTHENTICATED"}}),
              1);
  }
  {
    grpc::ClientContext context;
    context.AddMetadata("authorization", "Bearer second-token");
    auto stream = stub->AttendStream(&context);
    ASSERT_TRUE(stream->Write(TinyRequest()));
    stream->WritesDone();
    v1::AttendResponse response;
    ASSERT_TRUE(stream->Read(&response));
    EXPECT_FALSE(response.has_error()) << response.error().message();
    EXPECT_TRUE(stream->Finish().ok());
  }
  {
    auto health = grpc::health::v1::Health::NewStub(channel);
    grpc::ClientContext context;
    grpc::health::v1::HealthCheckResponse response;
    ASSERT_TRUE(health->Check(&context, grpc::health::v1::HealthCheckRequest(), &response).ok());
    EXPECT_EQ(response.status(), grpc::health::v1::HealthCheckResponse::SERVING);
  }
  EXPECT_EQ((*server)->Stop(), 0);
  const std::string log = (*server)->Log();
  EXPECT_THAT(log, ::testing::HasSubstr("UNAUTHENTICATED"));
  EXPECT_THAT(log, ::testing::Not(::testing::HasSubstr("first-token")))
      << "tokens must never be logged";
}

TEST_F(ServerSecurityTest, IncompleteTlsFlagsStopTheServer) {
  std::string output;
  EXPECT_NE(ServerProcess::RunToExit({"--address", "127.0.0.1:0", "--metrics-address", "",
                                      "--tls-cert", Path("server.crt")},
                                     {}, &output),
            0);
  EXPECT_THAT(output, ::testing::HasSubstr("--tls-key"));
  EXPECT_NE(ServerProcess::RunToExit({"--address", "127.0.0.1:0", "--metrics-address", "",
                                      "--auth-token-file", Path("no-such-file")},
                                     {}, &output),
            0);
  EXPECT_THAT(output, ::testing::HasSubstr("--auth-token-file"));
}

}  // namespace
}  // namespace attention::testing
