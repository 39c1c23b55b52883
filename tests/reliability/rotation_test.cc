// rotation_test.cc: certificates and tokens rotated under load, without a
// restart (docs/api.md, section 6.3). The server's certificate and key files
// are replaced (gRPC's file watcher rereads them within about a second: new
// connections get the new certificate) and the token file is rotated with
// SIGHUP, while clients keep calling over fresh connections; no call fails.
#include <signal.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>

#include "tests/support/certificates.h"
#include "tests/support/files.h"
#include "tests/support/metrics.h"
#include "tests/support/probes.h"
#include "tests/support/requests.h"
#include "tests/support/server_process.h"

namespace attention::testing {
namespace {

// The subject of the certificate the server presents to a new connection.
std::string PresentedSubject(const TestPki& certificates, const std::string& address) {
  const std::string out = certificates.Path("presented.txt");
  const std::string command = "openssl s_client -connect " + address +
                              " -servername localhost </dev/null 2>/dev/null | openssl x509 "
                              "-noout -subject > '" + out + "' 2>/dev/null";
  if (std::system(command.c_str()) != 0) return "";
  std::ifstream in(out);
  std::string subject;
  std::getline(in, subject);
  return subject;
}

grpc::StatusCode CallOnNewConnection(const TestPki& certificates, const std::string& address,
                                     const std::string& token) {
  grpc::SslCredentialsOptions tls;
  tls.pem_root_certs = certificates.Pem("ca.crt");
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);  // a connection of its own
  auto stub = v1::AttentionService::NewStub(
      grpc::CreateCustomChannel(address, grpc::SslCredentials(tls), args));
  v1::AttendRequest request;
  request.set_model("dot_product");
  for (int64_t s : {1, 2, 2}) request.mutable_queries()->add_shape(s);
  request.mutable_queries()->mutable_data()->Resize(4, 0.5f);
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
  context.AddMetadata("authorization", "Bearer " + token);
  v1::AttendResponse response;
  return stub->Attend(&context, request, &response).error_code();
}

TEST(RotationTest, CertificateAndTokensRotateUnderLoadWithoutAFailedCall) {
  // "rotated" is the server's next certificate, from the same CA.
  TestPki certificates({"ca"}, {{.name = "server"}, {.name = "rotated"}});
  ASSERT_TRUE(certificates.ok()) << certificates.log();
  TempDir live;
  const std::filesystem::path cert = live.path() / "cert.pem";
  const std::filesystem::path key = live.path() / "key.pem";
  const std::filesystem::path tokens = live.path() / "tokens";
  ReplaceFile(cert, ReadFile(certificates.Path("server.crt")));
  ReplaceFile(key, ReadFile(certificates.Path("server.key")));
  ReplaceFile(tokens, "old-token\n");
  auto server = ServerProcess::Start({"--tls-cert", cert.string(), "--tls-key", key.string(),
                                      "--auth-token-file", tokens.string()});
  ASSERT_TRUE(server.ok()) << server.status();
  const std::string address = (*server)->address();
  ASSERT_THAT(PresentedSubject(certificates, address), ::testing::HasSubstr("CN = server"));

  std::atomic<bool> new_token{false};
  std::atomic<bool> stop{false};
  std::atomic<int> calls{0};
  std::atomic<int> failures{0};
  std::thread load([&] {
    while (!stop.load()) {
      const std::string token = new_token.load() ? "new-token" : "old-token";
      if (CallOnNewConnection(certificates, address, token) != grpc::StatusCode::OK) ++failures;
      ++calls;
    }
  });

  // The key first: until its certificate follows, the pair does not match
  // and the old pair stays in use.
  ReplaceFile(key, ReadFile(certificates.Path("rotated.key")));
  ReplaceFile(cert, ReadFile(certificates.Path("rotated.crt")));
  ReplaceFile(tokens, "old-token\nnew-token\n");
  (*server)->Signal(SIGHUP);
  std::string subject;
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(15);
  while (std::chrono::steady_clock::now() < give_up) {
    subject = PresentedSubject(certificates, address);
    if (subject.find("CN = rotated") != std::string::npos) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  EXPECT_THAT(subject, ::testing::HasSubstr("CN = rotated"));
  new_token = true;
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  ReplaceFile(tokens, "new-token\n");
  (*server)->Signal(SIGHUP);
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  stop = true;
  load.join();

  EXPECT_EQ(CallOnNewConnection(certificates, address, "old-token"),
            grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(CallOnNewConnection(certificates, address, "new-token"), grpc::StatusCode::OK);
  EXPECT_GT(calls.load(), 10);
  EXPECT_EQ(failures.load(), 0) << "of " << calls.load() << " calls during the rotation";
  std::printf("%d calls on fresh connections during the rotation, %d failed\n", calls.load(),
              failures.load());
  EXPECT_EQ((*server)->Stop(), 0) << (*server)->Log();
}

}  // namespace
}  // namespace attention::testing
