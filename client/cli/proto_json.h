// proto_json.h: AttendRequest in, any message out, as proto3 JSON (the form
// the conformance cases use: snake_case field names).
#pragma once

#include <string>

#include <google/protobuf/message.h>

#include "absl/status/statusor.h"
#include "attention.pb.h"

namespace attention::client {

// The whole of a file, or of stdin when `path` is "-". NOT_FOUND names the path.
absl::StatusOr<std::string> ReadInput(const std::string& path);

// INVALID_ARGUMENT with the parser's message (which names the field) when
// `json` is not an AttendRequest; unknown fields are errors, not ignored.
absl::StatusOr<attention::v1::AttendRequest> ParseAttendRequest(const std::string& json);

// Proto3 JSON with the .proto field names; `pretty` adds line breaks.
std::string ToJson(const google::protobuf::Message& message, bool pretty);

}  // namespace attention::client
