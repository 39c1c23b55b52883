// target.cc: --target text -> gRPC target URI (see target.h).
#include "client/cpp/target.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <sys/socket.h>

#include <optional>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"

namespace attention::client {
namespace {

struct HostPort {
  std::string host;  // without the brackets of an IPv6 literal
  std::string port;
};

// The literal addresses one host has in each family (empty: none).
struct HostAddresses {
  std::string ipv4;
  std::string ipv6;
};

bool IsGrpcUri(absl::string_view target) {
  for (absl::string_view scheme : {"dns:", "ipv4:", "ipv6:", "unix:", "unix-abstract:", "vsock:"}) {
    if (absl::StartsWith(target, scheme)) return true;
  }
  return false;
}

absl::StatusOr<HostPort> SplitHostPort(absl::string_view entry) {
  HostPort result;
  absl::string_view port;
  if (absl::StartsWith(entry, "[")) {
    const size_t close = entry.find("]:");
    if (close == absl::string_view::npos) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--target entry '", entry, "': expected [IPV6]:PORT"));
    }
    result.host = std::string(entry.substr(1, close - 1));
    port = entry.substr(close + 2);
  } else {
    const size_t colon = entry.rfind(':');
    if (colon == absl::string_view::npos || colon == 0 ||
        entry.find(':') != colon) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--target entry '", entry, "': expected HOST:PORT"));
    }
    result.host = std::string(entry.substr(0, colon));
    port = entry.substr(colon + 1);
  }
  int port_number = 0;
  if (!absl::SimpleAtoi(port, &port_number) || port_number < 1 ||
      port_number > 65535) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--target entry '", entry, "': port must be 1..65535, got '", port, "'"));
  }
  result.port = std::string(port);
  return result;
}

std::optional<std::string> AddressText(const sockaddr* address) {
  char text[INET6_ADDRSTRLEN] = {};
  const void* raw =
      address->sa_family == AF_INET
          ? static_cast<const void*>(&reinterpret_cast<const sockaddr_in*>(address)->sin_addr)
          : static_cast<const void*>(&reinterpret_cast<const sockaddr_in6*>(address)->sin6_addr);
  if (inet_ntop(address->sa_family, raw, text, sizeof(text)) == nullptr) {
    return std::nullopt;
  }
  return std::string(text);
}

absl::StatusOr<HostAddresses> Resolve(const std::string& host) {
  addrinfo hints = {};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (const int error = getaddrinfo(host.c_str(), nullptr, &hints, &found); error != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--target host '", host, "' does not resolve: ", gai_strerror(error)));
  }
  HostAddresses addresses;
  for (const addrinfo* a = found; a != nullptr; a = a->ai_next) {
    std::string& slot = a->ai_family == AF_INET ? addresses.ipv4 : addresses.ipv6;
    if ((a->ai_family == AF_INET || a->ai_family == AF_INET6) && slot.empty()) {
      slot = AddressText(a->ai_addr).value_or("");
    }
  }
  freeaddrinfo(found);
  return addresses;
}

}  // namespace

absl::StatusOr<ChannelTarget> ParseTarget(absl::string_view targets) {
  targets = absl::StripAsciiWhitespace(targets);
  if (targets.empty()) {
    return absl::InvalidArgumentError("--target is empty: expected HOST:PORT[,HOST:PORT...]");
  }
  if (IsGrpcUri(targets) || !absl::StrContains(targets, ',')) {
    return ChannelTarget{std::string(targets), ""};
  }
  std::vector<HostPort> entries;
  std::vector<HostAddresses> addresses;
  for (absl::string_view entry : absl::StrSplit(targets, ',')) {
    absl::StatusOr<HostPort> host_port = SplitHostPort(absl::StripAsciiWhitespace(entry));
    if (!host_port.ok()) return host_port.status();
    absl::StatusOr<HostAddresses> resolved = Resolve(host_port->host);
    if (!resolved.ok()) return resolved.status();
    entries.push_back(*std::move(host_port));
    addresses.push_back(*std::move(resolved));
  }
  // One resolver URI holds one address family: IPv4 when every host has one.
  bool all_ipv4 = true, all_ipv6 = true;
  for (const HostAddresses& a : addresses) {
    all_ipv4 = all_ipv4 && !a.ipv4.empty();
    all_ipv6 = all_ipv6 && !a.ipv6.empty();
  }
  if (!all_ipv4 && !all_ipv6) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--target '", targets, "': the hosts share no address family (IPv4 or IPv6)"));
  }
  std::vector<std::string> literals;
  for (size_t i = 0; i < entries.size(); ++i) {
    literals.push_back(all_ipv4 ? absl::StrCat(addresses[i].ipv4, ":", entries[i].port)
                                : absl::StrCat("[", addresses[i].ipv6, "]:", entries[i].port));
  }
  return ChannelTarget{absl::StrCat(all_ipv4 ? "ipv4:" : "ipv6:", absl::StrJoin(literals, ",")),
                       entries.front().host};
}

}  // namespace attention::client
