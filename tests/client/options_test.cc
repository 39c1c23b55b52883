// client_options_test.cc: how ClientOptions become a channel: --target
// parsing into one balanced gRPC target, the service config (round_robin,
// UNAVAILABLE-only retries), and the errors of bad options.
#include <functional>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "client/cpp/attention_client.h"
#include "client/cpp/channel.h"
#include "client/cpp/target.h"

namespace attention::client {
namespace {

using ::testing::HasSubstr;

TEST(ParseTargetTest, SingleEntryGoesToGrpcUnchanged) {
  absl::StatusOr<ChannelTarget> target = ParseTarget("localhost:50051");
  ASSERT_TRUE(target.ok()) << target.status();
  EXPECT_EQ(target->uri, "localhost:50051");
  EXPECT_EQ(target->server_name, "");
}

TEST(ParseTargetTest, GrpcUrisGoUnchanged) {
  for (const char* uri : {"dns:///a:1", "ipv4:127.0.0.1:1,127.0.0.1:2", "unix:/tmp/s.sock"}) {
    absl::StatusOr<ChannelTarget> target = ParseTarget(uri);
    ASSERT_TRUE(target.ok()) << target.status();
    EXPECT_EQ(target->uri, uri);
  }
}

TEST(ParseTargetTest, ListBecomesOneIpv4Target) {
  absl::StatusOr<ChannelTarget> target = ParseTarget("127.0.0.1:1, 127.0.0.2:2,127.0.0.3:3");
  ASSERT_TRUE(target.ok()) << target.status();
  EXPECT_EQ(target->uri, "ipv4:127.0.0.1:1,127.0.0.2:2,127.0.0.3:3");
  EXPECT_EQ(target->server_name, "127.0.0.1");
}

TEST(ParseTargetTest, HostNamesInListAreResolvedAndFirstNamesTheServer) {
  absl::StatusOr<ChannelTarget> target = ParseTarget("localhost:7001,127.0.0.1:7002");
  ASSERT_TRUE(target.ok()) << target.status();
  EXPECT_EQ(target->uri, "ipv4:127.0.0.1:7001,127.0.0.1:7002");
  EXPECT_EQ(target->server_name, "localhost");
}

TEST(ParseTargetTest, Ipv6ListBecomesOneIpv6Target) {
  absl::StatusOr<ChannelTarget> target = ParseTarget("[::1]:1,[::1]:2");
  ASSERT_TRUE(target.ok()) << target.status();
  EXPECT_EQ(target->uri, "ipv6:[::1]:1,[::1]:2");
  EXPECT_EQ(target->server_name, "::1");
}

TEST(ParseTargetTest, MixedFamiliesAreRejected) {
  absl::StatusOr<ChannelTarget> target = ParseTarget("127.0.0.1:1,[::1]:2");
  EXPECT_EQ(target.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(target.status().message(), HasSubstr("address family"));
}

TEST(ParseTargetTest, BadEntriesAreNamed) {
  struct Case {
    const char* targets;
    const char* message;
  };
  for (const Case& c : {Case{"127.0.0.1:1,127.0.0.1", "'127.0.0.1': expected HOST:PORT"},
                        Case{"127.0.0.1:1,:2", "':2': expected HOST:PORT"},
                        Case{"127.0.0.1:1,127.0.0.1:0", "port must be 1..65535, got '0'"},
                        Case{"127.0.0.1:1,127.0.0.1:99999", "got '99999'"},
                        Case{"127.0.0.1:1,[::1]2", "expected [IPV6]:PORT"},
                        Case{"127.0.0.1:1,no-such-host.invalid:2", "does not resolve"},
                        Case{"  ", "--target is empty"}}) {
    absl::StatusOr<ChannelTarget> target = ParseTarget(c.targets);
    EXPECT_EQ(target.status().code(), absl::StatusCode::kInvalidArgument) << c.targets;
    EXPECT_THAT(target.status().message(), HasSubstr(c.message)) << c.targets;
  }
}

TEST(ServiceConfigTest, RoundRobinAndRetryOnUnavailableOnly) {
  const RetryOptions retry{.max_attempts = 3,
                           .initial_backoff = absl::Milliseconds(20),
                           .max_backoff = absl::Milliseconds(500),
                           .backoff_multiplier = 1.5};
  absl::StatusOr<std::string> text = ServiceConfigJson(retry);
  ASSERT_TRUE(text.ok()) << text.status();
  const nlohmann::json config = nlohmann::json::parse(*text);
  EXPECT_EQ(config["loadBalancingConfig"], nlohmann::json::parse(R"([{"round_robin": {}}])"));
  const nlohmann::json& method = config["methodConfig"].at(0);
  EXPECT_EQ(method["name"], nlohmann::json::parse(
                                R"([{"service": "attention.v1.AttentionService"},
                                    {"service": "grpc.health.v1.Health"}])"));
  const nlohmann::json& policy = method["retryPolicy"];
  EXPECT_EQ(policy["maxAttempts"], retry.max_attempts);
  EXPECT_EQ(policy["initialBackoff"], "0.020000s");
  EXPECT_EQ(policy["maxBackoff"], "0.500000s");
  EXPECT_EQ(policy["backoffMultiplier"], retry.backoff_multiplier);
  EXPECT_EQ(policy["retryableStatusCodes"], nlohmann::json::parse(R"(["UNAVAILABLE"])"));
}

TEST(ServiceConfigTest, OneAttemptHasNoRetryPolicy) {
  absl::StatusOr<std::string> text = ServiceConfigJson({.max_attempts = 1});
  ASSERT_TRUE(text.ok()) << text.status();
  const nlohmann::json config = nlohmann::json::parse(*text);
  EXPECT_TRUE(config.contains("loadBalancingConfig"));
  EXPECT_FALSE(config.contains("methodConfig"));
}

TEST(ServiceConfigTest, BadRetryOptionsAreNamed) {
  struct Case {
    RetryOptions retry;
    const char* message;
  };
  for (const Case& c : {Case{{.max_attempts = 0}, "max attempts must be 1..5 (gRPC's limit); was 0"},
                        Case{{.max_attempts = 6}, "was 6"},
                        Case{{.initial_backoff = absl::ZeroDuration()}, "0 < initial <= max"},
                        Case{{.initial_backoff = absl::Seconds(2), .max_backoff = absl::Seconds(1)},
                             "was initial 2s, max 1s"},
                        Case{{.backoff_multiplier = 0}, "multiplier must be positive; was 0"},
                        Case{{.max_retried_request_bytes = -1},
                             "max retried request bytes must be >= 0; was -1"}}) {
    absl::StatusOr<std::string> text = ServiceConfigJson(c.retry);
    EXPECT_EQ(text.status().code(), absl::StatusCode::kInvalidArgument) << c.message;
    EXPECT_THAT(text.status().message(), HasSubstr(c.message));
  }
}

// Create()'s answer for the default options changed by `edit`.
absl::Status CreateStatus(const std::function<void(ClientOptions&)>& edit) {
  ClientOptions options;
  edit(options);
  return AttentionClient::Create(options).status();
}

TEST(AttentionClientCreateTest, RejectsBadOptionsWithTheirName) {
  EXPECT_THAT(CreateStatus([](ClientOptions& o) { o.timeout = absl::ZeroDuration(); }).message(),
              HasSubstr("timeout must be positive"));
  EXPECT_THAT(CreateStatus([](ClientOptions& o) { o.target = "127.0.0.1:1,x"; }).message(),
              HasSubstr("'x': expected HOST:PORT"));

  const absl::Status missing_ca =
      CreateStatus([](ClientOptions& o) { o.tls_ca_file = "/nonexistent/ca.pem"; });
  EXPECT_EQ(missing_ca.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(missing_ca.message(), HasSubstr("--tls-ca: cannot read '/nonexistent/ca.pem'"));

  const absl::Status cert_without_key =
      CreateStatus([](ClientOptions& o) { o.tls_cert_file = "/nonexistent/cert.pem"; });
  EXPECT_EQ(cert_without_key.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(cert_without_key.message(), HasSubstr("--tls-cert and --tls-key go together"));
}

TEST(AttentionClientCreateTest, ConnectsLazily) {
  // Nothing listens on port 1; creating the client must still succeed.
  ClientOptions options;
  options.target = "127.0.0.1:1";
  absl::StatusOr<std::unique_ptr<AttentionClient>> client = AttentionClient::Create(options);
  ASSERT_TRUE(client.ok()) << client.status();
  EXPECT_NE((*client)->channel()->GetState(/*try_to_connect=*/false), GRPC_CHANNEL_READY);
}

}  // namespace
}  // namespace attention::client
