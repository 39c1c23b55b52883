// tls_credentials.cc: plaintext, TLS or mutual TLS, from the --tls-* flags;
// the certificate, key and client CA files are reread when they change.
#include "server/tls_credentials.h"

#include <string>
#include <utility>

#include "grpcpp/security/server_credentials.h"
#include "grpcpp/security/tls_certificate_provider.h"
#include "grpcpp/security/tls_credentials_options.h"
#include "server/flag_file.h"

namespace attention::server {

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> TlsCredentials(
    const ServerConfig& config) {
  if (config.tls_cert.empty() != config.tls_key.empty()) {
    return absl::InvalidArgumentError("--tls-cert and --tls-key must be given together");
  }
  if (config.tls_cert.empty()) {
    if (!config.tls_client_ca.empty()) {
      return absl::InvalidArgumentError("--tls-client-ca needs --tls-cert and --tls-key");
    }
    return grpc::InsecureServerCredentials();
  }
  // Read once here so that a missing or unreadable file stops the start-up
  // with the flag's name; from then on gRPC's file watcher rereads them.
  for (const auto& [flag, path] : {std::pair<const char*, const std::string&>{"--tls-key",
                                                                              config.tls_key},
                                   {"--tls-cert", config.tls_cert},
                                   {"--tls-client-ca", config.tls_client_ca}}) {
    if (path.empty()) continue;
    if (absl::StatusOr<std::string> text = ReadFlagFile(flag, path); !text.ok()) {
      return text.status();
    }
  }
  auto provider = std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(
      config.tls_key, config.tls_cert, config.tls_client_ca, kCertificateRefreshSeconds);
  grpc::experimental::TlsServerCredentialsOptions options(provider);
  options.watch_identity_key_cert_pairs();
  if (config.tls_client_ca.empty()) {
    options.set_cert_request_type(GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
  } else {
    options.watch_root_certs();
    options.set_cert_request_type(GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  }
  return grpc::experimental::TlsServerCredentials(options);
}

}  // namespace attention::server
