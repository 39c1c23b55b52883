// security_test.cc: who gets in, and what the ports give away.
//
// Complements server_security_test (right and rogue CA, client certificates
// from the right and a rogue CA, tokens): certificates that are expired, not
// yet valid or for another host are refused on either side; with mutual TLS
// and tokens together both are required; the metrics port serves metrics
// and nothing else (no gRPC, no tokens, no request data); the image runs as
// a non-root user. Certificates are signed here with `openssl ca`, which
// can back-date them.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <fstream>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_split.h"
#include "tests/fault_util.h"
#include "tests/server_test_util.h"

namespace attention::testing {
namespace {

constexpr char kToken[] = "s3cret-token-7f1c";
constexpr char kRequestId[] = "request-id-that-must-not-leak";

std::string Read(const std::filesystem::path& path) {
  std::ifstream in(path);
  std::ostringstream contents;
  contents << in.rdbuf();
  return contents.str();
}

// The certificates: one CA signs servers and clients valid now, expired,
// not yet valid, and for another host name.
constexpr char kMakeCerts[] = R"(set -e
key="-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes"
openssl req -x509 $key -keyout ca.key -out ca.crt -days 2 -subj /CN=test-ca 2>/dev/null
printf 'subjectAltName=DNS:localhost,IP:127.0.0.1\n' > local.ext
printf 'subjectAltName=DNS:other.example\n' > other.ext
printf 'basicConstraints=CA:FALSE\n' > client.ext
printf '[ca]\ndefault_ca=signer\n[signer]\ndatabase=index.txt\nnew_certs_dir=.\nserial=serial\n'\
'default_md=sha256\npolicy=anything\nunique_subject=no\n[anything]\ncommonName=supplied\n' > ca.cnf
: > index.txt
echo 01 > serial
sign() {  # name extfile startdate enddate
  openssl req $key -keyout $1.key -out $1.csr -subj /CN=$1 2>/dev/null
  openssl ca -batch -config ca.cnf -cert ca.crt -keyfile ca.key -in $1.csr -out $1.crt \
    -extfile $2 -startdate $3 -enddate $4 2>/dev/null
}
sign server local.ext 20200101000000Z 20991231000000Z
sign expired_server local.ext 20200101000000Z 20200102000000Z
sign future_server local.ext 20990101000000Z 20991231000000Z
sign other_host_server other.ext 20200101000000Z 20991231000000Z
sign client client.ext 20200101000000Z 20991231000000Z
sign expired_client client.ext 20200101000000Z 20200102000000Z
sign future_client client.ext 20990101000000Z 20991231000000Z
)";

class SecurityTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new TempDir();
    std::ofstream(dir_->path() / "make-certs.sh") << kMakeCerts;
    std::ofstream(dir_->path() / "tokens") << kToken << "\n";
    certs_ok_ = std::system(("cd '" + dir_->path().string() + "' && bash make-certs.sh").c_str()) == 0;
  }
  static void TearDownTestSuite() {
    delete dir_;
    dir_ = nullptr;
  }
  void SetUp() override { ASSERT_TRUE(certs_ok_) << "openssl could not make the certificates"; }

  static std::string Path(const std::string& name) { return (dir_->path() / name).string(); }

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

  // The code of one Attend over TLS trusting the test CA, presenting
  // `client` (a certificate name) when set, and `token` when set.
  static grpc::StatusCode Attend(const ServerProcess& server, const std::string& client = "",
                                 const std::string& token = "") {
    grpc::SslCredentialsOptions options;
    options.pem_root_certs = Read(Path("ca.crt"));
    if (!client.empty()) {
      options.pem_private_key = Read(Path(client + ".key"));
      options.pem_cert_chain = Read(Path(client + ".crt"));
    }
    grpc::ChannelArguments args;
    args.SetSslTargetNameOverride("localhost");
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    auto stub = v1::AttentionService::NewStub(
        grpc::CreateCustomChannel(server.address(), grpc::SslCredentials(options), args));
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
    if (!token.empty()) context.AddMetadata("authorization", "Bearer " + token);
    const v1::AttendRequest request = DotProductRequest(1, 2, 2, 0);
    v1::AttendResponse response;
    const grpc::Status status = stub->Attend(&context, request, &response);
    if (status.ok()) {
      EXPECT_EQ(CheckAnswer(request, response), "");
    }
    return status.error_code();
  }

  static TempDir* dir_;
  static bool certs_ok_;
};

TempDir* SecurityTest::dir_ = nullptr;
bool SecurityTest::certs_ok_ = false;

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
    v1::AttendRequest request = DotProductRequest(1, 2, 2, 0);
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
  EXPECT_NE(stub->Attend(&context, DotProductRequest(1, 2, 2, 0), &response).error_code(),
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
