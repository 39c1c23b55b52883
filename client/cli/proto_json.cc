// proto_json.cc: proto3 JSON reading and printing (see proto_json.h).
#include "client/cli/proto_json.h"

#include <fstream>
#include <iostream>
#include <sstream>

#include <google/protobuf/util/json_util.h>

#include "absl/strings/str_cat.h"

namespace attention::client {

absl::StatusOr<std::string> ReadInput(const std::string& path) {
  std::ostringstream text;
  if (path == "-") {
    text << std::cin.rdbuf();
    return text.str();
  }
  std::ifstream file(path, std::ios::binary);
  if (!file) return absl::NotFoundError(absl::StrCat("cannot read '", path, "'"));
  text << file.rdbuf();
  return text.str();
}

absl::StatusOr<attention::v1::AttendRequest> ParseAttendRequest(const std::string& json) {
  attention::v1::AttendRequest request;
  google::protobuf::util::JsonParseOptions options;
  options.ignore_unknown_fields = false;
  const auto status = google::protobuf::util::JsonStringToMessage(json, &request, options);
  if (!status.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "not an AttendRequest in proto JSON: ", std::string(status.message())));
  }
  return request;
}

std::string ToJson(const google::protobuf::Message& message, bool pretty) {
  google::protobuf::util::JsonPrintOptions options;
  options.preserve_proto_field_names = true;
  options.add_whitespace = pretty;
  std::string json;
  // Printing a valid message to JSON cannot fail (no Any fields to resolve).
  (void)google::protobuf::util::MessageToJsonString(message, &json, options);
  return json;
}

}  // namespace attention::client
