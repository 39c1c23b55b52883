// rest_tls_test.cc: REST over TLS on a real attention-server (docs/api.md,
// sections 6.3 and 10.6): --tls-cert serves REST over TLS as it serves gRPC
// (curl trusting the CA gets its answer, a client trusting another CA
// cannot connect); plaintext and a stalled handshake get no HTTP answer;
// with --tls-client-ca a client certificate is required and verified, and
// --tls-client-allow refuses other identities with gRPC's message; replaced
// certificate files reach new connections (a key without its certificate is
// not taken) while open connections keep theirs; a client that closes its
// TLS connection (close_notify, then its end) cancels its request.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <future>
#include <string>
#include <thread>
#include <vector>

#include "tests/support/certificates.h"
#include "tests/support/files.h"
#include "tests/support/gate.h"
#include "tests/support/http_client.h"
#include "tests/support/metrics.h"
#include "tests/support/probes.h"
#include "tests/support/server_process.h"

namespace attention::testing {
namespace {

using ::testing::HasSubstr;

// docs/api.md's example request (section 10.2) and its answer, to the
// digits every kernel path gives.
constexpr char kInferBody[] =
    R"({"inputs": [{"name": "queries", "datatype": "FP32", "shape": [1, 1, 2], "data": [1, 0]},)"
    R"( {"name": "keys", "datatype": "FP32", "shape": [1, 3, 2], "data": [1, 0, 0, 1, -1, 0]},)"
    R"( {"name": "values", "datatype": "FP32", "shape": [1, 3, 1], "data": [10, 20, 30]}]})";
constexpr char kInferAnswer[] = "[15.64";

struct CurlResult {
  int exit_code = -1;
  std::string output;  // stdout and stderr
};

// curl with `args`, as an operator would run it.
CurlResult Curl(const std::string& args) {
  CurlResult result;
  FILE* pipe = popen(("curl --silent --show-error --max-time 20 " + args + " 2>&1").c_str(), "r");
  if (pipe == nullptr) return result;
  char chunk[4096];
  while (const size_t n = fread(chunk, 1, sizeof(chunk), pipe)) result.output.append(chunk, n);
  const int status = pclose(pipe);
  result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return result;
}

class RestTlsTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    // alice is named by her common name only, bob by a URI name as well;
    // mallory is signed by the CA but not allowed; the intruder's CA is
    // another one.
    pki_ = new TestPki({"ca", "rogue"}, {{.name = "server"},
                                         {.name = "rotated"},
                                         {.name = "alice", .hosts = ""},
                                         {.name = "bob", .hosts = "URI:spiffe://test/bob"},
                                         {.name = "mallory", .hosts = ""},
                                         {.name = "intruder", .ca = "rogue", .hosts = ""}});
  }
  static void TearDownTestSuite() {
    delete pki_;
    pki_ = nullptr;
  }
  void SetUp() override { ASSERT_TRUE(pki_->ok()) << pki_->log(); }

  static std::string Path(const std::string& file) { return pki_->Path(file); }

  // TLS trusting `ca`, presenting the certificate `client` when set.
  static HttpTls Tls(const std::string& ca = "ca", const std::string& client = "") {
    HttpTls tls;
    tls.ca_pem = pki_->Pem(ca + ".crt");
    if (!client.empty()) {
      tls.cert_pem = pki_->Pem(client + ".crt");
      tls.key_pem = pki_->Pem(client + ".key");
    }
    return tls;
  }

  // A server whose TLS files are `cert`.crt and .key, plus `flags`.
  static std::unique_ptr<ServerProcess> Start(const std::string& cert,
                                              std::vector<std::string> flags = {}) {
    flags.insert(flags.end(), {"--tls-cert", Path(cert + ".crt"), "--tls-key", Path(cert + ".key")});
    auto server = ServerProcess::Start(flags);
    EXPECT_TRUE(server.ok()) << server.status();
    if (!server.ok()) return nullptr;
    EXPECT_FALSE((*server)->http_address().empty()) << "no REST port with --tls-cert";
    return *std::move(server);
  }

  static TestPki* pki_;
};

TestPki* RestTlsTest::pki_ = nullptr;

TEST_F(RestTlsTest, CurlTrustingTheCaGetsAnswersOverTls) {
  auto server = Start("server");
  ASSERT_NE(server, nullptr);
  const std::string url = "https://" + server->http_address();
  const CurlResult ready =
      Curl("--cacert '" + Path("ca.crt") + "' -w ' %{http_code}' " + url + "/v2/health/ready");
  EXPECT_EQ(ready.exit_code, 0) << ready.output;
  EXPECT_EQ(ready.output, R"({"ready":true} 200)");
  const CurlResult infer = Curl("--cacert '" + Path("ca.crt") + "' -d '" + kInferBody + "' " + url +
                                "/v2/models/dot_product/infer");
  EXPECT_EQ(infer.exit_code, 0) << infer.output;
  EXPECT_THAT(infer.output, HasSubstr(kInferAnswer));
  EXPECT_EQ(server->Stop(), 0);
  EXPECT_THAT(server->Log(), HasSubstr("REST (Open Inference Protocol v2) on https://"));
}

TEST_F(RestTlsTest, AClientTrustingAnotherCaCannotConnect) {
  auto server = Start("server");
  ASSERT_NE(server, nullptr);
  HttpClient stranger(server->http_address(), Tls("rogue"));
  EXPECT_THAT(stranger.error(), HasSubstr("handshake"));
  EXPECT_EQ(stranger.Call("GET", "/v2/health/ready").status, 0);
  const CurlResult curl = Curl("--cacert '" + Path("rogue.crt") + "' https://" +
                               server->http_address() + "/v2/health/ready");
  EXPECT_EQ(curl.exit_code, 60) << "curl's 'peer certificate cannot be authenticated': "
                                << curl.output;
  EXPECT_EQ(server->Stop(), 0);
}

TEST_F(RestTlsTest, PlaintextAndStalledHandshakesGetNoHttpAnswer) {
  auto server = Start("server", {"--http-timeout-seconds", "1"});
  ASSERT_NE(server, nullptr);
  {
    TcpConnection plaintext(server->http_address());
    ASSERT_TRUE(plaintext.Send("GET /v2/health/ready HTTP/1.1\r\nHost: x\r\n\r\n"));
    std::string received;
    const auto start = std::chrono::steady_clock::now();
    EXPECT_TRUE(plaintext.ReadUntilClosed(&received));
    EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(900))
        << "closed at once, not at the timeout";
    EXPECT_THAT(received, ::testing::Not(HasSubstr("HTTP/")));
  }
  EXPECT_EQ(HttpCall(server->http_address(), "GET", "/v2/health/ready").status, 0);
  {
    TcpConnection stalled(server->http_address());
    ASSERT_TRUE(stalled.connected());
    std::string received;
    const auto start = std::chrono::steady_clock::now();
    EXPECT_TRUE(stalled.ReadUntilClosed(&received)) << "a stalled handshake is dropped";
    EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
    EXPECT_EQ(received, "");
  }
  HttpClient good(server->http_address(), Tls());
  EXPECT_EQ(good.Call("GET", "/v2/health/ready").status, 200) << good.error();
  EXPECT_EQ(server->Stop(), 0);
}

TEST_F(RestTlsTest, MutualTlsRequiresAClientCertificateAndChecksItsIdentity) {
  auto server = Start("server", {"--tls-client-ca", Path("ca.crt"), "--tls-client-allow",
                                 "alice, spiffe://test/bob"});
  ASSERT_NE(server, nullptr);
  const std::string address = server->http_address();
  HttpClient anonymous(address, Tls());
  EXPECT_EQ(anonymous.Call("GET", "/v2/health/ready").status, 0)
      << "a client without a certificate is refused";
  HttpClient intruder(address, Tls("ca", "intruder"));
  EXPECT_EQ(intruder.Call("GET", "/v2/health/ready").status, 0)
      << "a certificate of another CA is refused";

  for (const std::string allowed : {"alice", "bob"}) {
    HttpClient client(address, Tls("ca", allowed));
    const HttpResult infer = client.Call("POST", "/v2/models/dot_product/infer", kInferBody);
    EXPECT_EQ(infer.status, 200) << allowed << ": " << infer.body << infer.error;
    EXPECT_THAT(infer.body, HasSubstr(kInferAnswer));
  }

  HttpClient mallory(address, Tls("ca", "mallory"));
  const HttpResult refused = mallory.Call("POST", "/v2/models/dot_product/infer", kInferBody);
  EXPECT_EQ(refused.status, 403) << refused.body << refused.error;
  // gRPC's message for the same certificate (client_identity_test.cc).
  EXPECT_EQ(refused.body,
            R"({"error":"the client certificate's identity is not allowed: it names [mallory], )"
            R"(none of them in --tls-client-allow"})");
  EXPECT_EQ(mallory.Call("GET", "/v2/models/dot_product").status, 403);
  EXPECT_EQ(mallory.Call("GET", "/v2/health/ready").status, 200) << "health stays open";
  EXPECT_EQ(server->Stop(), 0);
  EXPECT_THAT(server->Log(), HasSubstr("REST (Open Inference Protocol v2) on https://"));
}

TEST_F(RestTlsTest, ReplacedCertificatesReachNewConnectionsAndOpenOnesKeepTheirs) {
  TempDir live;
  const std::filesystem::path cert = live.path() / "cert.pem";
  const std::filesystem::path key = live.path() / "key.pem";
  ReplaceFile(cert, ReadFile(Path("server.crt")));
  ReplaceFile(key, ReadFile(Path("server.key")));
  auto started = ServerProcess::Start({"--tls-cert", cert.string(), "--tls-key", key.string()});
  ASSERT_TRUE(started.ok()) << started.status();
  ServerProcess& server = **started;
  HttpClient before(server.http_address(), Tls());
  ASSERT_EQ(before.Call("GET", "/v2/health/ready").status, 200) << before.error();
  EXPECT_EQ(before.ServerCertificateSubject(), "CN = server");

  // The key first: until its certificate follows, the pair does not match
  // and the previous one stays, looked at again after the refresh second.
  ReplaceFile(key, ReadFile(Path("rotated.key")));
  std::this_thread::sleep_for(std::chrono::milliseconds(1500));
  {
    HttpClient during(server.http_address(), Tls());
    EXPECT_EQ(during.Call("GET", "/v2/health/ready").status, 200) << during.error();
    EXPECT_EQ(during.ServerCertificateSubject(), "CN = server");
  }
  ReplaceFile(cert, ReadFile(Path("rotated.crt")));
  std::string subject;
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(15);
  while (std::chrono::steady_clock::now() < give_up) {
    HttpClient after(server.http_address(), Tls());
    EXPECT_EQ(after.Call("GET", "/v2/health/ready").status, 200) << after.error();
    subject = after.ServerCertificateSubject();
    if (subject == "CN = rotated") break;
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  EXPECT_EQ(subject, "CN = rotated");
  EXPECT_EQ(before.Call("GET", "/v2/health/ready").status, 200)
      << "the connection made before goes on: " << before.error();
  EXPECT_EQ(server.Stop(), 0);
  EXPECT_THAT(server.Log(), HasSubstr("REST TLS: the changed certificate files are not taken"));
  EXPECT_THAT(server.Log(), HasSubstr("REST TLS: the certificate files changed"));
}

TEST_F(RestTlsTest, AClientThatClosesItsTlsConnectionCancelsItsRequest) {
  TestGate gate;
  ASSERT_TRUE(gate.ok());
  auto server = Start("server", gate.Flags({"--max-batch-size", "1"}));
  ASSERT_NE(server, nullptr);
  const std::string address = server->http_address();
  auto held = std::async(std::launch::async, [&] {
    return HttpClient(address, Tls()).Call("POST", "/v2/models/gate/infer", kInferBody);
  });
  EXPECT_EQ(held.wait_for(std::chrono::milliseconds(500)), std::future_status::timeout);
  // curl gives up after a second, queued behind the held request, and
  // closes as TLS clients do: close_notify, then the end of the connection.
  auto leaving = std::async(std::launch::async, [&] {
    return Curl("--cacert '" + Path("ca.crt") + "' -d '" + kInferBody + "' https://" + address +
                "/v2/models/gate/infer --max-time 1");
  });
  EXPECT_NE(WaitForMetricAtLeast(server->metrics_address(), "attention_queue_depth",
                                 {{"model", "gate"}}, 1),
            "");
  EXPECT_EQ(leaving.get().exit_code, 28) << "curl's timeout";
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  ASSERT_TRUE(gate.Release(2));
  EXPECT_EQ(held.get().status, 200);
  const std::string metrics = WaitForMetricAtLeast(
      server->metrics_address(), "attention_api_requests_total", {{"code", "CANCELLED"}}, 1);
  EXPECT_EQ(MetricValue(metrics, "attention_api_requests_total",
                        {{"api", "http"}, {"model", "gate"}, {"code", "CANCELLED"}}),
            1);
  EXPECT_EQ(MetricValue(metrics, "attention_batch_size_sum", {{"model", "gate"}}), 1)
      << "only the held request was computed";
  EXPECT_EQ(server->Stop(), 0) << server->Log();
}

}  // namespace
}  // namespace attention::testing
