// auth.cc: bearer-token files and the per-call token check.
#include "server/auth.h"

#include <string_view>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "server/flag_file.h"

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

}  // namespace attention::server
