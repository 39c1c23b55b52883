// channel.h: one gRPC channel to the attention servers, from ClientOptions:
// credentials, the round-robin policy and the UNAVAILABLE-only retry policy.
#pragma once

#include <memory>
#include <string>

#include <grpcpp/grpcpp.h>

#include "absl/status/statusor.h"
#include "client/cpp/client_options.h"

namespace attention::client {

// The channel's service config: `round_robin` over every resolved address,
// and, when retry.max_attempts > 1, a retry policy for UNAVAILABLE on the
// attention and health services. INVALID_ARGUMENT names a bad retry option.
absl::StatusOr<std::string> ServiceConfigJson(const RetryOptions& retry);

// Checks `options` and builds the channel (it connects on first use).
absl::StatusOr<std::shared_ptr<grpc::Channel>> CreateChannel(const ClientOptions& options);

}  // namespace attention::client
