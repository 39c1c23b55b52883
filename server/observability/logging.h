// logging.h: spdlog set-up for attention-server.
//
// Text lines for people ("2024-05-01 12:00:00.123 [info] listening on ...") or
// one JSON object per line for log collectors
// ({"time":"2024-05-01T12:00:00.123456Z","level":"info","message":"..."}).
// A JSON line also carries the fields a ScopedLogFields set on its thread
// (a request's model, code, trace_id...), as members beside those three.
// Everything goes to stderr.
#pragma once

#include <string_view>

#include "absl/status/status.h"
#include "nlohmann/json_fwd.hpp"

namespace attention::server {

// `level`: trace|debug|info|warn|error|critical|off; `format`: text|json.
// INVALID_ARGUMENT naming the value otherwise.
absl::Status ConfigureLogging(std::string_view level, std::string_view format);

// While alive, the lines this thread logs carry `fields` (a JSON object;
// not owned, alive as long as this) in the JSON format; the text format
// ignores them, its message says what it needs. Fields named time, level or
// message are left out.
class ScopedLogFields {
 public:
  explicit ScopedLogFields(const nlohmann::json& fields);
  ~ScopedLogFields();
  ScopedLogFields(const ScopedLogFields&) = delete;
  ScopedLogFields& operator=(const ScopedLogFields&) = delete;

 private:
  const nlohmann::json* const previous_;
};

}  // namespace attention::server
