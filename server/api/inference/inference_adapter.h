// inference_adapter.h: Open Inference Protocol messages <-> engine types.
//
// The KServe v2 / Triton counterpart of attention_adapter.h. A ModelInferRequest
// carries its tensors as bytes (raw_input_contents) or typed lists, in FP32,
// FP16 or BF16, so unlike AttendRequest it cannot be viewed in place: the
// inputs are decoded into float32 copies that the engine request views.
// Every fault the protocol itself can have (unknown or repeated input,
// datatype, shape versus byte count, parameter type, unknown output) is an
// INVALID_ARGUMENT naming the tensor or parameter; what the attention
// request then means is checked by core's Validate(), as for Attend.
// Names, datatypes and shapes are those of docs/api.md ("Open Inference
// Protocol").
//
//   DecodedInferRequest decoded;
//   if (absl::Status s = DecodeInferRequest(proto, &decoded); !s.ok()) ...
//   Validate(model, decoded.request, limits) ... Engine::Run ...
//   EncodeInferResponse(proto, decoded, result, &response);
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "core/engine/engine.h"
#include "core/model/model.h"
#include "core/engine/request.h"
#include "core/sessions/session.h"
#include "core/tensor.h"
#include "inference/grpc_service.pb.h"

namespace attention::server {

// Tensor and parameter names of the protocol binding, a declaration per role.
inline constexpr char kQueriesInput[] = "queries", kKeysInput[] = "keys", kValuesInput[] = "values",
                      kValidLensInput[] = "valid_lens", kPositionIdsInput[] = "position_ids";
inline constexpr char kOutputOutput[] = "output", kWeightsOutput[] = "attention_weights";
inline constexpr char kCausalParameter[] = "causal", kScaleParameter[] = "scale",
                      kReturnWeightsParameter[] = "return_attention_weights",
                      kSlidingWindowParameter[] = "sliding_window", kSoftcapParameter[] = "softcap";

// Whether the binding reads parameter `name` as a double_param, so that
// REST reads a JSON integer given for it as a number like any other.
bool IsFloatParameter(absl::string_view name);
// Triton's sequence parameters (docs/api.md, "Sequences").
inline constexpr char kSequenceIdParameter[] = "sequence_id",
                      kSequenceStartParameter[] = "sequence_start",
                      kSequenceEndParameter[] = "sequence_end",
                      kSessionMemoryParameter[] = "session_memory";

// A request's place in a sequence.
struct SequenceParameters {
  std::variant<int64_t, std::string> id;
  bool start = false;
  bool end = false;
  // session_memory "self" or "cross" (sequence_start only); absent: cross
  // when the request carries keys, else self.
  std::optional<SessionMemory> memory;
};

// The request's sequence: nullopt when it names none (no sequence_id, or 0
// or "", which Triton reads as none). INVALID_ARGUMENT naming the parameter
// when one has the wrong type, session_memory is neither "self" nor
// "cross" or comes without sequence_start, or sequence_start or
// sequence_end come without a sequence_id.
absl::StatusOr<std::optional<SequenceParameters>> ReadSequenceParameters(
    const inference::ModelInferRequest& proto);

// A decoded ModelInferRequest. `request` views the tensors held here, so the
// object stays where it was decoded (no copies, no moves).
struct DecodedInferRequest {
  DecodedInferRequest() = default;
  DecodedInferRequest(const DecodedInferRequest&) = delete;
  DecodedInferRequest& operator=(const DecodedInferRequest&) = delete;

  Tensor queries;
  std::optional<Tensor> keys;
  std::optional<Tensor> values;
  std::vector<int32_t> valid_lens;
  std::vector<int64_t> position_ids;  // INT32 inputs widened
  AttentionRequest request;
  // The outputs the response carries, in this order.
  bool returns_output = true;
  bool returns_weights = false;
};

// product(shape) of `input`: INVALID_ARGUMENT naming it when a size is
// negative or the product exceeds what any message could hold (so later
// byte counts cannot overflow).
absl::StatusOr<int64_t> ElementCount(const inference::ModelInferRequest::InferInputTensor& input);

// Fills `decoded` (which must be freshly constructed) from `proto`.
absl::Status DecodeInferRequest(const inference::ModelInferRequest& proto,
                                DecodedInferRequest* decoded);

// The answer to `proto`, computed by `version` of its model: id and model
// echoed, the outputs `decoded` asked for, as FP32 in raw_output_contents.
void EncodeInferResponse(const inference::ModelInferRequest& proto,
                         const DecodedInferRequest& decoded, const AttentionResult& result,
                         inference::ModelInferResponse* response, int64_t version = 1);

// "" -> nullopt (the newest ready version), "3" -> 3; NOT_FOUND naming
// `model_version` for anything but a positive decimal.
absl::StatusOr<std::optional<int64_t>> ParseModelVersion(std::string_view text);

// What ModelMetadata and ModelConfig report for `model`: its inputs and
// outputs with -1 for every size a request chooses; `versions`: the ready
// versions of the model.
inference::ModelMetadataResponse ToModelMetadata(const Model& model,
                                                 const std::vector<int64_t>& versions = {1});
inference::ModelConfig ToModelConfig(const Model& model);

}  // namespace attention::server
