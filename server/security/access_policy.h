// access_policy.h: who may call the server: the mutual-TLS identity
// allow-list (--tls-client-allow) and the accepted bearer tokens
// (--auth-token-file), which SIGHUP may replace while serving.
//
// Every API checks a call's credentials against the one policy the
// dispatcher holds, so a reloaded token file applies to all of them at once.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"

namespace grpc {
class ServerContextBase;
}  // namespace grpc

namespace attention::server {

class AccessPolicy {
 public:
  // Empty lists accept any client certificate the CA signed, and any call
  // with or without a token.
  AccessPolicy(std::vector<std::string> allowed_client_identities, std::vector<std::string> tokens);

  // The credentials check of a gRPC call: CheckClientIdentity() of its
  // client certificate's names, then CheckBearerToken() against the tokens
  // accepted now (auth.h).
  absl::Status Check(const grpc::ServerContextBase& context) const;

  // The same check of an HTTP call: CheckClientIdentity() of
  // `client_certificate_names` (its TLS peer's, as HttpRequest carries them;
  // empty without a client certificate), then CheckBearerHeader() of its
  // Authorization header (nullptr: none).
  absl::Status CheckHttp(const std::vector<std::string>& client_certificate_names,
                         const std::string* authorization) const;

  // The bearer tokens accepted now.
  std::shared_ptr<const std::vector<std::string>> tokens() const;
  // Calls checked from now on need one of `tokens` (a reloaded
  // --auth-token-file; non-empty when the server started with tokens).
  void ReplaceTokens(std::vector<std::string> tokens);

 private:
  const std::vector<std::string> allowed_client_identities_;
  mutable absl::Mutex mu_;
  std::shared_ptr<const std::vector<std::string>> tokens_ ABSL_GUARDED_BY(mu_);
};

}  // namespace attention::server
