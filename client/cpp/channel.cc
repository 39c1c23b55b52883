// channel.cc: ClientOptions -> grpc::Channel (see channel.h).
#include "client/cpp/channel.h"

#include <fstream>
#include <sstream>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "client/cpp/target.h"

namespace attention::client {
namespace {

// gRPC's JSON duration: decimal seconds with an "s" suffix, never exponent form.
std::string JsonDuration(absl::Duration duration) {
  return absl::StrFormat("%.6fs", absl::ToDoubleSeconds(duration));
}

absl::StatusOr<std::string> ReadPemFile(const std::string& option, const std::string& path) {
  std::ifstream file(path, std::ios::binary);
  if (!file) {
    return absl::NotFoundError(absl::StrCat(option, ": cannot read '", path, "'"));
  }
  std::ostringstream text;
  text << file.rdbuf();
  return text.str();
}

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> Credentials(
    const ClientOptions& options) {
  const bool tls = options.tls || !options.tls_ca_file.empty() ||
                   !options.tls_cert_file.empty() || !options.tls_key_file.empty();
  if (!tls) return grpc::InsecureChannelCredentials();
  if (options.tls_cert_file.empty() != options.tls_key_file.empty()) {
    return absl::InvalidArgumentError(
        "--tls-cert and --tls-key go together: a client certificate needs its key");
  }
  grpc::SslCredentialsOptions ssl;
  if (!options.tls_ca_file.empty()) {
    absl::StatusOr<std::string> ca = ReadPemFile("--tls-ca", options.tls_ca_file);
    if (!ca.ok()) return ca.status();
    ssl.pem_root_certs = *std::move(ca);
  }
  if (!options.tls_cert_file.empty()) {
    absl::StatusOr<std::string> cert = ReadPemFile("--tls-cert", options.tls_cert_file);
    if (!cert.ok()) return cert.status();
    absl::StatusOr<std::string> key = ReadPemFile("--tls-key", options.tls_key_file);
    if (!key.ok()) return key.status();
    ssl.pem_cert_chain = *std::move(cert);
    ssl.pem_private_key = *std::move(key);
  }
  return grpc::SslCredentials(ssl);
}

}  // namespace

absl::StatusOr<std::string> ServiceConfigJson(const RetryOptions& retry) {
  if (retry.max_attempts < 1 || retry.max_attempts > 5) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max attempts must be 1..5 (gRPC's limit); was ", retry.max_attempts));
  }
  const std::string balancing = R"("loadBalancingConfig": [{"round_robin": {}}])";
  if (retry.max_attempts == 1) return absl::StrCat("{", balancing, "}");
  if (retry.initial_backoff <= absl::ZeroDuration() ||
      retry.max_backoff < retry.initial_backoff) {
    return absl::InvalidArgumentError(absl::StrCat(
        "backoff must satisfy 0 < initial <= max; was initial ",
        absl::FormatDuration(retry.initial_backoff), ", max ",
        absl::FormatDuration(retry.max_backoff)));
  }
  if (!(retry.backoff_multiplier > 0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "backoff multiplier must be positive; was ", retry.backoff_multiplier));
  }
  if (retry.max_retried_request_bytes < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max retried request bytes must be >= 0; was ", retry.max_retried_request_bytes));
  }
  return absl::StrFormat(
      R"({%s, "methodConfig": [{"name": [{"service": "attention.v1.AttentionService"},)"
      R"( {"service": "grpc.health.v1.Health"}], "retryPolicy": {"maxAttempts": %d,)"
      R"( "initialBackoff": "%s", "maxBackoff": "%s", "backoffMultiplier": %g,)"
      R"( "retryableStatusCodes": ["UNAVAILABLE"]}}]})",
      balancing, retry.max_attempts, JsonDuration(retry.initial_backoff),
      JsonDuration(retry.max_backoff), retry.backoff_multiplier);
}

absl::StatusOr<std::shared_ptr<grpc::Channel>> CreateChannel(const ClientOptions& options) {
  absl::StatusOr<ChannelTarget> target = ParseTarget(options.target);
  if (!target.ok()) return target.status();
  absl::StatusOr<std::string> service_config = ServiceConfigJson(options.retry);
  if (!service_config.ok()) return service_config.status();
  absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> credentials = Credentials(options);
  if (!credentials.ok()) return credentials.status();

  grpc::ChannelArguments args;
  args.SetServiceConfigJSON(*service_config);
  // Attention weights grow as n_q * n_k: lift gRPC's 4 MB default on answers.
  args.SetMaxReceiveMessageSize(-1);
  args.SetInt(GRPC_ARG_PER_RPC_RETRY_BUFFER_SIZE, options.retry.max_retried_request_bytes);
  const std::string& server_name =
      options.tls_server_name.empty() ? target->server_name : options.tls_server_name;
  if (!server_name.empty()) args.SetSslTargetNameOverride(server_name);
  return grpc::CreateCustomChannel(target->uri, *credentials, args);
}

}  // namespace attention::client
