// security_test.cc: who gets in, and what the ports give away.
//
// TLS, mutual TLS and bearer tokens accept the right peers and refuse the
// rest: a client must trust the server's CA, a client certificate must come
// from the client CA (not a rogue one), certificates that are expired, not yet
// valid or for another host are refused on either side, and with mutual TLS
// and tokens together both are required. The metrics port serves metrics and
// nothing else (no gRPC, no tokens, no request data); the image runs as a
// non-root user. Certificates: tests/support/certificates.h.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <fstream>
#include <regex>
#include <string>
#include <vector>

#include "absl/strings/str_split.h"
#include "health.grpc.pb.h"
#include "tests/support/certificates.h"
#include "tests/support/files.h"
#include "tests/support/metrics.h"
#include "tests/support/probes.h"
#include "tests/support/requests.h"
#include "tests/support/server_process.h"

namespace attention::testing {
namespace {

constexpr char kToken[] = "s3cret-token-7f1c";
constexpr char kRequestId[] = "request-id-that-must-not-leak";

class SecurityTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    // One CA signs servers and clients valid now, expired, not yet valid and
    // for another host name; a rogue CA signs an intruder's client certificate.
    pki_ = new TestPki({"ca", "rogue"},
                       {{.name = "server"},
                        {.name = "expired_server", .not_after = "20200102000000Z"},
                        {.name = "future_server", .not_before = "20990101000000Z"},
                        {.name = "other_host_server", .hosts = "DNS:other.example"},
                        {.name = "client", .hosts = ""},
                        {.name = "expired_client", .hosts = "", .not_after = "20200102000000Z"},
                        {.name = "future_client", .hosts = "", .not_before = "20990101000000Z"},
                        {.name = "intruder", .ca = "rogue", .hosts = ""}});
    WriteFile(pki_->Path("tokens"), std::string(kToken) + "\n");
  }
  static void TearDownTestSuite() {
    delete pki_;
    pki_ = nullptr;
  }
  void SetUp() override { ASSERT_TRUE(pki_->ok()) << pki_->log(); }

  static std::string Path(const std::string& name) { return pki_->Path(name); }

  // A TLS channel that trusts `ca` and, when `client` is set, presents that
  // certificate.
  static std::shared_ptr<grpc::Channel> TlsChannel(const ServerProcess& server,
                                                   const std::string& ca = "ca",
                                                   const std::string& client = "") {
    grpc::SslCredentialsOptions options;
    options.pem_root_certs = pki_->Pem(ca + ".crt");
    if (!client.empty()) {
      options.pem_private_key = pki_->Pem(client + ".key");
      options.pem_cert_chain = pki_->Pem(client + ".crt");
    }
    grpc::ChannelArguments args;
    args.SetSslTargetNameOverride("localhost");
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    return grpc::CreateCustomChannel(server.address(), grpc::SslCredentials(options), args);
  }

  static std::unique_ptr<ServerProcess> StartTls(const std::string& cert, bool mutual = false,
                                                 bool tokens = false) {
    std::vector<std::string> flags = {"--tls-cert", Path(cert + ".crt"), "--tls-key",
                                      Path(cert + ".key")};
    if (mutual) flags.insert(flags.end(), {"--tls-client-ca", Path("ca.crt")});
    if (tokens) flags.insert(flags.end(), {"--auth-token-file", Path("tokens")});
    auto server = ServerProcess::Start(flags);
    EXPECT_TRUE(server.ok()) << server.status();
    return server.ok() ? *std::move(server) : nullptr;
  }

  // The code of one Attend on `channel`, sending `authorization` when set; an
  // answer must be the right one.
  static grpc::StatusCode Attend(const std::shared_ptr<grpc::Channel>& channel,
                                 const std::string& authorization = "") {
    auto stub = v1::AttentionService::NewStub(channel);
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
    if (!authorization.empty()) context.AddMetadata("authorization", authorization);
    const v1::AttendRequest request = SelfAttentionRequest(1, 2, 2, 0);
    v1::AttendResponse response;
    const grpc::Status status = stub->Attend(&context, request, &response);
    if (status.ok()) {
      EXPECT_EQ(CheckAnswer(request, response), "");
    }
    return status.error_code();
  }

  // The code of one Attend over TLS trusting the test CA, presenting
  // `client` (a certificate name) when set, and `token` when set.
  static grpc::StatusCode Attend(const ServerProcess& server, const std::string& client = "",
                                 const std::string& token = "") {
    return Attend(TlsChannel(server, "ca", client), token.empty() ? "" : "Bearer " + token);
  }

  static TestPki* pki_;
};

TestPki* SecurityTest::pki_ = nullptr;

TEST_F(SecurityTest, TlsAcceptsClientsTrustingItsCaAndRefusesTheRest) {
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

TEST_F(SecurityTest, MutualTlsAcceptsOnlyClientsSignedByTheClientCa) {
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

TEST_F(SecurityTest, TokensAreRequiredExceptForHealth) {
  WriteFile(Path("operator-tokens"), "# operators\nfirst-token\n\n  second-token  \n");
  auto server = ServerProcess::Start({"--auth-token-file", Path("operator-tokens")});
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
    stream->Write(SelfAttentionRequest(1, 1, 2, 0));
    stream->WritesDone();
    v1::AttendResponse response;
    while (stream->Read(&response)) {
    }
    // Refused from its metadata by gRPC's auth filter, before the service
    // sees the stream (docs/api.md, section 6.3).
    EXPECT_EQ(stream->Finish().error_code(), grpc::StatusCode::UNAUTHENTICATED);
  }
  // The five Attend calls, ListModels and the stream: counted and logged
  // although no service saw them.
  EXPECT_EQ(MetricValue(ScrapeMetrics((*server)->metrics_address()),
                        "attention_unauthenticated_calls_total", {{"api", "attention"}}),
            7);
  {
    grpc::ClientContext context;
    context.AddMetadata("authorization", "Bearer second-token");
    auto stream = stub->AttendStream(&context);
    ASSERT_TRUE(stream->Write(SelfAttentionRequest(1, 1, 2, 0)));
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
  EXPECT_THAT(log, ::testing::HasSubstr("bearer tokens required"));
  EXPECT_THAT(log, ::testing::HasSubstr("call refused before its message was read: api=attention "
                                        "method='/attention.v1.AttentionService/AttendStream' "
                                        "code=UNAUTHENTICATED"));
  EXPECT_THAT(log, ::testing::Not(::testing::HasSubstr("first-token")))
      << "tokens must never be logged";
}

TEST_F(SecurityTest, IncompleteTlsFlagsStopTheServer) {
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

TEST_F(SecurityTest, ClientsRefuseServerCertificatesOutOfDateOrForAnotherHost) {
  for (const std::string cert : {"expired_server", "future_server", "other_host_server"}) {
    auto server = StartTls(cert);
    ASSERT_NE(server, nullptr);
    EXPECT_EQ(Attend(*server), grpc::StatusCode::UNAVAILABLE) << cert << " was accepted";
    EXPECT_EQ(server->Stop(), 0);
  }
  auto server = StartTls("server");
  ASSERT_NE(server, nullptr);
  EXPECT_EQ(Attend(*server), grpc::StatusCode::OK) << "the valid server certificate";
  EXPECT_EQ(server->Stop(), 0);
}

TEST_F(SecurityTest, MutualTlsRefusesClientCertificatesOutOfDate) {
  auto server = StartTls("server", /*mutual=*/true);
  ASSERT_NE(server, nullptr);
  EXPECT_EQ(Attend(*server, "expired_client"), grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(Attend(*server, "future_client"), grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(Attend(*server, "client"), grpc::StatusCode::OK);
  EXPECT_EQ(server->Stop(), 0);
}

TEST_F(SecurityTest, MutualTlsAndTokensAreBothRequired) {
  auto server = StartTls("server", /*mutual=*/true, /*tokens=*/true);
  ASSERT_NE(server, nullptr);
  EXPECT_EQ(Attend(*server, "client", kToken), grpc::StatusCode::OK);
  EXPECT_EQ(Attend(*server, "client"), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(Attend(*server, "client", "wrong-token"), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(Attend(*server, "", kToken), grpc::StatusCode::UNAVAILABLE)
      << "a token does not replace the client certificate";
  EXPECT_EQ(Attend(*server, "expired_client", kToken), grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(server->Stop(), 0);
  EXPECT_THAT(server->Log(), ::testing::Not(::testing::HasSubstr(kToken)));
}

// Every line of a Prometheus text exposition: a comment, or a sample of one
// of our metrics (or the exposer's own) with a number.
TEST_F(SecurityTest, MetricsPortServesOnlyMetricsAndNoSecrets) {
  auto server = ServerProcess::Start({"--auth-token-file", Path("tokens")});
  ASSERT_TRUE(server.ok()) << server.status();
  {
    auto stub = (*server)->Stub();
    grpc::ClientContext context;
    context.AddMetadata("authorization", std::string("Bearer ") + kToken);
    v1::AttendRequest request = SelfAttentionRequest(1, 2, 2, 0);
    request.set_request_id(kRequestId);
    v1::AttendResponse response;
    ASSERT_TRUE(stub->Attend(&context, request, &response).ok());
    grpc::ClientContext refused;
    refused.AddMetadata("authorization", "Bearer wrong-token-in-a-label?");
    EXPECT_EQ(stub->Attend(&refused, request, &response).error_code(),
              grpc::StatusCode::UNAUTHENTICATED);
  }

  const HttpReply metrics = HttpRequest((*server)->metrics_address(), "GET", "/metrics");
  ASSERT_EQ(metrics.status, 200);
  const std::regex sample(R"(^(attention_[a-z_]+|exposer_[a-z_]+)(\{[^}]*\})? [-+0-9.eEIinfNa]+$)");
  int samples = 0;
  for (const std::string& line :
       std::vector<std::string>(absl::StrSplit(metrics.body, '\n', absl::SkipEmpty()))) {
    if (line.starts_with("# HELP ") || line.starts_with("# TYPE ")) continue;
    EXPECT_TRUE(std::regex_match(line, sample)) << "not a metric sample: " << line;
    ++samples;
  }
  EXPECT_GT(samples, 10);
  EXPECT_THAT(metrics.body, ::testing::Not(::testing::HasSubstr(kToken)));
  EXPECT_THAT(metrics.body, ::testing::Not(::testing::HasSubstr("wrong-token")));
  EXPECT_THAT(metrics.body, ::testing::Not(::testing::HasSubstr(kRequestId)));
  EXPECT_THAT(metrics.body, ::testing::Not(::testing::HasSubstr(Path(""))));

  // No gRPC service on the metrics port.
  auto stub = v1::AttentionService::NewStub(grpc::CreateChannel(
      (*server)->metrics_address(), grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  v1::AttendResponse response;
  EXPECT_NE(stub->Attend(&context, SelfAttentionRequest(1, 2, 2, 0), &response).error_code(),
            grpc::StatusCode::OK);
  EXPECT_EQ(HealthStatus((*server)->Channel()), "SERVING");
  EXPECT_EQ((*server)->Stop(), 0);
}

// A request the metrics endpoint answers with an HTTP error once overflowed
// civetweb's worker stack and killed attention-server (see
// server/thread_stack_floor.cc): a scanner or a HEAD probe could stop the
// service.
TEST_F(SecurityTest, MetricsPortSurvivesRequestsForAnythingElse) {
  auto server = ServerProcess::Start({});
  ASSERT_TRUE(server.ok()) << server.status();
  for (const auto& [method, path] : std::vector<std::pair<std::string, std::string>>{
           {"GET", "/"}, {"GET", "/favicon.ico"}, {"GET", "/debug/pprof"}, {"HEAD", "/metrics"},
           {"POST", "/metrics"}, {"DELETE", "/metrics"}, {"OPTIONS", "/metrics"}}) {
    const HttpReply reply = HttpRequest((*server)->metrics_address(), method, path);
    EXPECT_NE(reply.status, 200) << method << " " << path << " was served";
    EXPECT_EQ(HttpRequest((*server)->metrics_address(), "GET", "/metrics").status, 200)
        << "after " << method << " " << path;
    ASSERT_EQ(HealthStatus((*server)->Channel()), "SERVING") << "after " << method << " " << path;
  }
  EXPECT_EQ((*server)->Stop(), 0) << (*server)->Log();
}

// The image's final stage sets a numeric, non-zero USER (a name could map to
// root inside the image; Kubernetes' runAsNonRoot can only check a number).
TEST(ContainerTest, ImageRunsAsANonRootUid) {
  std::ifstream dockerfile(std::filesystem::path(ATTENTION_SOURCE_DIR) / "Dockerfile");
  ASSERT_TRUE(dockerfile.good());
  std::string line, user;
  bool final_stage_seen = false;
  while (std::getline(dockerfile, line)) {
    if (line.starts_with("FROM ")) {
      final_stage_seen = true;
      user.clear();  // USER does not carry over between stages
    }
    if (line.starts_with("USER ")) user = line.substr(5);
  }
  ASSERT_TRUE(final_stage_seen);
  ASSERT_FALSE(user.empty()) << "the final stage runs as root";
  const std::string uid = user.substr(0, user.find(':'));
  ASSERT_TRUE(std::all_of(uid.begin(), uid.end(), ::isdigit)) << "USER " << user << " is not numeric";
  EXPECT_NE(std::stol(uid), 0) << "USER 0 is root";
}

}  // namespace
}  // namespace attention::testing
