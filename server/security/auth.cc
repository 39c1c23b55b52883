// auth.cc: bearer-token files, the per-call token check and the client
// identity allow-list.
#include "server/security/auth.h"

#include <string_view>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "server/security/flag_file.h"
#include "server/observability/request_names.h"

namespace attention::server {
namespace {

constexpr std::string_view kBearerPrefix = "Bearer ";
constexpr std::string_view kAttentionPrefix = "/attention.v1.AttentionService/";
constexpr std::string_view kInferencePrefix = "/inference.GRPCInferenceService/";

// Calls that need a token: every AttentionService call, and every
// GRPCInferenceService call but the probes ServerLive and ServerReady; health
// checks and reflection stay open (docs/api.md, sections 6.3 and 9.5).
bool NeedsToken(std::string_view path) {
  if (path.starts_with(kAttentionPrefix)) return true;
  if (!path.starts_with(kInferencePrefix)) return false;
  const std::string_view method = path.substr(kInferencePrefix.size());
  return method != "ServerLive" && method != "ServerReady";
}

// Compares without stopping at the first difference, so the time taken does
// not tell an attacker how much of a guessed token was right.
bool SameToken(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  unsigned char difference = 0;
  for (size_t i = 0; i < a.size(); ++i) difference |= static_cast<unsigned char>(a[i] ^ b[i]);
  return difference == 0;
}

constexpr char kRefusal[] =
    "missing or unknown credentials: send the metadata 'authorization: Bearer <token>' with a "
    "token the server accepts";

// Whether `value` is "Bearer <token>" with one of `accepted`.
bool AcceptedBearer(std::string_view value, const std::vector<std::string>& accepted) {
  if (value.substr(0, kBearerPrefix.size()) != kBearerPrefix) return false;
  const std::string_view token = value.substr(kBearerPrefix.size());
  bool known = false;
  for (const std::string& candidate : accepted) known |= SameToken(token, candidate);
  return known;
}

}  // namespace

absl::StatusOr<std::vector<std::string>> ReadTokenFile(const std::string& path) {
  absl::StatusOr<std::string> text = ReadFlagFile("--auth-token-file", path);
  if (!text.ok()) return text.status();
  std::vector<std::string> tokens;
  for (absl::string_view line : absl::StrSplit(*text, '\n')) {
    line = absl::StripAsciiWhitespace(line);
    if (line.empty() || line.front() == '#') continue;
    tokens.emplace_back(line);
  }
  if (tokens.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--auth-token-file ", path, " holds no token; every request would be refused"));
  }
  return tokens;
}

absl::Status CheckBearerToken(const grpc::ServerContextBase& context,
                              const std::vector<std::string>& accepted) {
  if (accepted.empty()) return absl::OkStatus();
  const auto [begin, end] = context.client_metadata().equal_range("authorization");
  for (auto it = begin; it != end; ++it) {
    if (AcceptedBearer(std::string_view(it->second.data(), it->second.size()), accepted)) {
      return absl::OkStatus();
    }
  }
  return absl::UnauthenticatedError(kRefusal);
}

absl::Status CheckBearerHeader(const std::string* authorization,
                               const std::vector<std::string>& accepted) {
  if (accepted.empty()) return absl::OkStatus();
  if (authorization != nullptr && AcceptedBearer(*authorization, accepted)) {
    return absl::OkStatus();
  }
  return absl::UnauthenticatedError(
      "missing or unknown credentials: send the header 'Authorization: Bearer <token>' with a "
      "token the server accepts");
}

grpc::Status EarlyTokenCheck::Process(const InputMetadata& auth_metadata, grpc::AuthContext*,
                                      OutputMetadata*, OutputMetadata*) {
  const auto path_entry = auth_metadata.find(":path");
  if (path_entry == auth_metadata.end()) return grpc::Status::OK;
  const std::string_view path(path_entry->second.data(), path_entry->second.size());
  if (!NeedsToken(path)) return grpc::Status::OK;
  const std::shared_ptr<const std::vector<std::string>> accepted = tokens_();
  if (accepted->empty()) return grpc::Status::OK;
  const auto [begin, end] = auth_metadata.equal_range("authorization");
  for (auto it = begin; it != end; ++it) {
    if (AcceptedBearer(std::string_view(it->second.data(), it->second.size()), *accepted)) {
      return grpc::Status::OK;
    }
  }
  if (refused_) refused_(path.starts_with(kAttentionPrefix) ? "attention" : "inference", path);
  return grpc::Status(grpc::StatusCode::UNAUTHENTICATED, kRefusal);
}

std::vector<std::string> ClientCertificateNames(const grpc::ServerContextBase& context) {
  std::vector<std::string> names;
  const std::shared_ptr<const grpc::AuthContext> auth = context.auth_context();
  if (auth == nullptr) return names;
  for (const char* property : {"x509_subject_alternative_name", "x509_common_name"}) {
    for (const grpc::string_ref& value : auth->FindPropertyValues(property)) {
      names.emplace_back(value.data(), value.size());
    }
  }
  return names;
}

absl::Status CheckClientIdentity(const std::vector<std::string>& names,
                                 const std::vector<std::string>& allowed) {
  if (allowed.empty()) return absl::OkStatus();
  for (const std::string& name : names) {
    for (const std::string& candidate : allowed) {
      if (name == candidate) return absl::OkStatus();
    }
  }
  std::vector<std::string> printable;
  for (const std::string& name : names) printable.push_back(Printable(name));
  return absl::PermissionDeniedError(absl::StrCat(
      "the client certificate's identity is not allowed: it names [",
      absl::StrJoin(printable, ", "), "], none of them in --tls-client-allow"));
}

}  // namespace attention::server
