// target.h: turns the user's --target text into a gRPC channel target.
//
// Users write servers as a comma-separated HOST:PORT list. gRPC balances one
// channel over several servers only when its resolver returns several
// addresses, so a list becomes one `ipv4:` (or `ipv6:`) target that names them
// all, and the channel's `round_robin` policy spreads calls over them. Host
// names in a list are resolved once, here. A single entry, or anything that
// already is a gRPC URI (`dns:///`, `ipv4:`, `unix:`), is passed through
// unchanged for gRPC's own resolvers.
//
//   absl::StatusOr<ChannelTarget> t = ParseTarget("localhost:50051,127.0.0.1:50052");
//   // t->uri == "ipv4:127.0.0.1:50051,127.0.0.1:50052", t->server_name == "localhost"
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace attention::client {

struct ChannelTarget {
  // What grpc::CreateCustomChannel gets.
  std::string uri;
  // The host a TLS certificate must name: the first entry's host as the user
  // wrote it. Empty when gRPC derives it from `uri` itself (a single entry).
  std::string server_name;
};

// INVALID_ARGUMENT when an entry is not HOST:PORT, a port is not 1..65535, a
// host does not resolve, or the hosts do not share one address family.
absl::StatusOr<ChannelTarget> ParseTarget(absl::string_view targets);

}  // namespace attention::client
