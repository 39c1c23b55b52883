// tls_credentials.h: the transport credentials of attention-server.
//
// Plaintext unless --tls-cert and --tls-key are given; with --tls-client-ca
// too, clients must present a certificate that CA signed (mutual TLS). The
// files are reread every kCertificateRefreshSeconds, so that certificates are
// rotated by replacing them (key before certificate, each atomically):
// connections made after a change use the new ones; a key that does not match
// its certificate is not taken. Plaintext credentials take an auth metadata
// processor as TLS ones do (grpc::InsecureServerCredentials() cannot), so
// tokens are checked from a call's metadata before its message is read.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "grpcpp/grpcpp.h"

namespace attention::server {

inline constexpr unsigned int kCertificateRefreshSeconds = 1;

// The PEM files of --tls-cert, --tls-key and --tls-client-ca; empty: not
// given.
struct TlsFiles {
  std::string cert;
  std::string key;
  std::string client_ca;
};

// INVALID_ARGUMENT for an incomplete combination of the TLS flags, NOT_FOUND
// naming the flag of a file that cannot be read.
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> TlsCredentials(const TlsFiles& files);

}  // namespace attention::server
