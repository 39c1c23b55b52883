// logging.h: spdlog set-up for attention-server.
//
// Text lines for people ("2024-05-01 12:00:00.123 [info] listening on ...") or
// one JSON object per line for log collectors
// ({"time":"2024-05-01T12:00:00.123456Z","level":"info","message":"..."}).
// Everything goes to stderr.
#pragma once

#include <string_view>

#include "absl/status/status.h"

namespace attention::server {

// `level`: trace|debug|info|warn|error|critical|off; `format`: text|json.
// INVALID_ARGUMENT naming the value otherwise.
absl::Status ConfigureLogging(std::string_view level, std::string_view format);

}  // namespace attention::server
