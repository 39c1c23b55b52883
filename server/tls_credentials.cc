// tls_credentials.cc: plaintext, TLS or mutual TLS, from the --tls-* flags.
#include "server/tls_credentials.h"

#include <string>
#include <utility>

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
  grpc::SslServerCredentialsOptions options(GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
  absl::StatusOr<std::string> key = ReadFlagFile("--tls-key", config.tls_key);
  if (!key.ok()) return key.status();
  absl::StatusOr<std::string> cert = ReadFlagFile("--tls-cert", config.tls_cert);
  if (!cert.ok()) return cert.status();
  options.pem_key_cert_pairs.push_back({*std::move(key), *std::move(cert)});
  if (!config.tls_client_ca.empty()) {
    absl::StatusOr<std::string> ca = ReadFlagFile("--tls-client-ca", config.tls_client_ca);
    if (!ca.ok()) return ca.status();
    options.pem_root_certs = *std::move(ca);
    options.client_certificate_request =
        GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY;
  }
  return grpc::SslServerCredentials(options);
}

}  // namespace attention::server
