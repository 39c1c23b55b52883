// rest_codec.h: the Open Inference Protocol's REST encoding (JSON, and
// Triton's binary tensor data extension) <-> the protocol's protobuf
// messages, which inference_operations.h serves.
//
// A request body is a JSON object, optionally followed by binary sections
// (its length given by the Inference-Header-Content-Length header). Every
// input becomes raw little-endian bytes in raw_input_contents, whether it
// came as a JSON `data` list (flat or nested; floats as FP32, integers in
// their INT32/INT64 datatype) or as `parameters.binary_data_size` bytes, so
// the protocol adapter (inference_adapter.h) checks shapes, datatypes and
// values exactly as it does for gRPC. Faults of the encoding itself are
// INVALID_ARGUMENT naming the field: JSON syntax (with its offset), types,
// data counts against the shape, binary sizes against the body.
//
// Outputs are FP32 and go back as JSON `data` lists, or as binary sections
// when asked for (`parameters.binary_data` on a requested output, else the
// request's `parameters.binary_data_output`).
#pragma once

#include <cstddef>
#include <optional>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "google/protobuf/message.h"
#include "inference/grpc_service.pb.h"

namespace attention::server {

// The header that gives the JSON part's length when binary sections follow.
inline constexpr char kInferenceHeaderLength[] = "inference-header-content-length";

// Fills `proto` (model name and version excepted: they come from the URL)
// from `body`; `json_length`: the header above, nullopt when absent.
absl::Status ParseRestInferRequest(std::string_view body, std::optional<size_t> json_length,
                                   inference::ModelInferRequest* proto);

// A REST response body: JSON, then the binary sections when there are any
// (`json_length` then says where they start).
struct RestBody {
  std::string bytes;
  std::optional<size_t> json_length;
};

// The answer to `request` as its REST body.
RestBody WriteRestInferResponse(const inference::ModelInferRequest& request,
                                const inference::ModelInferResponse& response);

// `message` as JSON with the protobuf field names, 64-bit integers as
// numbers (as Triton's HTTP API writes them, unlike protobuf's own JSON) and
// enums by name; maps become objects.
std::string ProtoToJson(const google::protobuf::Message& message);

// {"error": "<message>"}.
std::string ErrorJson(std::string_view message);

// The JSON body of a request that has one (or is empty), as an object; the
// value of `field` when it is a bool, `fallback` when it is absent.
absl::StatusOr<bool> ReadBoolField(std::string_view body, const char* field, bool fallback);

}  // namespace attention::server
