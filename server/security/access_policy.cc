// access_policy.cc: the credentials check every API shares (access_policy.h).
#include "server/security/access_policy.h"

#include <utility>

#include "server/security/auth.h"

namespace attention::server {

AccessPolicy::AccessPolicy(std::vector<std::string> allowed_client_identities,
                           std::vector<std::string> tokens)
    : allowed_client_identities_(std::move(allowed_client_identities)),
      tokens_(std::make_shared<const std::vector<std::string>>(std::move(tokens))) {}

absl::Status AccessPolicy::Check(const grpc::ServerContextBase& context) const {
  if (!allowed_client_identities_.empty()) {
    if (absl::Status identity =
            CheckClientIdentity(ClientCertificateNames(context), allowed_client_identities_);
        !identity.ok()) {
      return identity;
    }
  }
  return CheckBearerToken(context, *tokens());
}

absl::Status AccessPolicy::CheckHttp(const std::vector<std::string>& client_certificate_names,
                                     const std::string* authorization) const {
  if (absl::Status identity =
          CheckClientIdentity(client_certificate_names, allowed_client_identities_);
      !identity.ok()) {
    return identity;
  }
  return CheckBearerHeader(authorization, *tokens());
}

std::shared_ptr<const std::vector<std::string>> AccessPolicy::tokens() const {
  absl::MutexLock lock(&mu_);
  return tokens_;
}

void AccessPolicy::ReplaceTokens(std::vector<std::string> tokens) {
  auto replacement = std::make_shared<const std::vector<std::string>>(std::move(tokens));
  absl::MutexLock lock(&mu_);
  tokens_ = std::move(replacement);
}

}  // namespace attention::server
