// auth.h: bearer-token authentication of calls (--auth-token-file), and the
// mutual-TLS identity allow-list (--tls-client-allow).
//
// A call is accepted when its metadata holds `authorization: Bearer <token>`
// with one of the accepted tokens (docs/api.md). Tokens are never logged.
//
//   auto tokens = ReadTokenFile("/etc/attention/tokens");
//   absl::Status s = CheckBearerToken(*context, *tokens);  // UNAUTHENTICATED or OK
//   s = CheckClientIdentity(ClientCertificateNames(*context), {"client-a", "spiffe://prod/web"});
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/security/auth_metadata_processor.h"

namespace attention::server {

// The tokens of `path`, one per line; blank lines and lines starting with
// '#' are skipped. INVALID_ARGUMENT when it holds none (every call would be
// refused).
absl::StatusOr<std::vector<std::string>> ReadTokenFile(const std::string& path);

// OK when `accepted` is empty (no authentication) or the call sends one of
// them; UNAUTHENTICATED, saying what to send, otherwise.
absl::Status CheckBearerToken(const grpc::ServerContextBase& context,
                              const std::vector<std::string>& accepted);

// The same check for an HTTP call: `authorization` is its Authorization
// header (nullptr: none).
absl::Status CheckBearerHeader(const std::string* authorization,
                               const std::vector<std::string>& accepted);

// gRPC's auth filter runs this on each call's metadata before the message is
// read or parsed: calls to attention.v1.AttentionService without an accepted
// token end UNAUTHENTICATED there, so an unauthenticated client cannot make
// the server parse a large message first. On TLS and plaintext ports alike
// (tls_credentials.h); CheckBearerToken() in the handlers stays as well.
class EarlyTokenCheck final : public grpc::AuthMetadataProcessor {
 public:
  // Told of each call refused here, with its API ("attention" or
  // "inference") and method path, so refusals stay counted and logged
  // although the service never sees them.
  using Refused = std::function<void(std::string_view api, std::string_view path)>;

  // `tokens` returns the tokens accepted now (they may be reloaded).
  EarlyTokenCheck(std::function<std::shared_ptr<const std::vector<std::string>>()> tokens,
                  Refused refused)
      : tokens_(std::move(tokens)), refused_(std::move(refused)) {}

  bool IsBlocking() const override { return false; }
  grpc::Status Process(const InputMetadata& auth_metadata, grpc::AuthContext* context,
                       OutputMetadata* consumed_auth_metadata,
                       OutputMetadata* response_metadata) override;

 private:
  const std::function<std::shared_ptr<const std::vector<std::string>>()> tokens_;
  const Refused refused_;
};

// The names of a gRPC call's client certificate, as gRPC's auth context
// lists them: its subject alternative names, then its common name; empty
// without one. REST's are PeerCertificateNames() (tls_context.h), the same
// names in the same order.
std::vector<std::string> ClientCertificateNames(const grpc::ServerContextBase& context);

// Mutual TLS identity allow-list (--tls-client-allow), for gRPC and REST
// calls alike: OK when `allowed` is empty or one of `names` (the client
// certificate's) is in it; PERMISSION_DENIED naming what the certificate
// holds (escaped) otherwise.
absl::Status CheckClientIdentity(const std::vector<std::string>& names,
                                 const std::vector<std::string>& allowed);

}  // namespace attention::server
