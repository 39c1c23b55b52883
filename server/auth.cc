// auth.cc: bearer-token files, the per-call token check and the client
// identity allow-list.
#include "server/auth.h"

#include <string_view>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "server/flag_file.h"
#include "server/request_names.h"

namespace attention::server {
namespace {

constexpr std::string_view kBearerPrefix = "Bearer ";

// Compares without stopping at the first difference, so the time taken does
// not tell an attacker how much of a guessed token was right.
bool SameToken(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  unsigned char difference = 0;
  for (size_t i = 0; i < a.size(); ++i) difference |= static_cast<unsigned char>(a[i] ^ b[i]);
  return difference == 0;
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
    const std::string_view value(it->second.data(), it->second.size());
    if (value.substr(0, kBearerPrefix.size()) != kBearerPrefix) continue;
    const std::string_view token = value.substr(kBearerPrefix.size());
    bool known = false;
    for (const std::string& candidate : accepted) known |= SameToken(token, candidate);
    if (known) return absl::OkStatus();
  }
  return absl::UnauthenticatedError(
      "missing or unknown credentials: send the metadata 'authorization: Bearer <token>' with a "
      "token the server accepts");
}

absl::Status CheckClientIdentity(const grpc::ServerContextBase& context,
                                 const std::vector<std::string>& allowed) {
  if (allowed.empty()) return absl::OkStatus();
  std::vector<std::string> names;
  const std::shared_ptr<const grpc::AuthContext> auth = context.auth_context();
  if (auth != nullptr) {
    for (const char* property : {"x509_subject_alternative_name", "x509_common_name"}) {
      for (const grpc::string_ref& value : auth->FindPropertyValues(property)) {
        names.emplace_back(value.data(), value.size());
      }
    }
  }
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
