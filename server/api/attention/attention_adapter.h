// attention_adapter.h: the one place where wire messages meet engine types.
//
// Requests are not copied: the engine request views the repeated fields of the
// proto, so the proto must outlive every use of the view (gRPC keeps a call's
// request alive until the call is finished, which is after the computation).
// Validation is core's attention::Validate(); the adapter only says which
// optional parts of the message are present.
//
//   const AttendRequest& proto = ...;
//   AttentionRequest request = ToAttentionRequest(proto);   // views into proto
//   absl::StatusOr<AttentionDims> dims = Validate(model, request, limits);
//   ...
//   ToAttendResponse(std::move(result), &response);
//   reactor->Finish(ToGrpcStatus(status));
#pragma once

#include "absl/status/status.h"
#include "attention.pb.h"
#include "core/engine/engine.h"
#include "core/model/model.h"
#include "core/engine/request.h"
#include "core/sessions/session.h"
#include "grpcpp/support/status.h"

namespace attention::server {

// Views into `proto`. An absent `keys` or `values` message becomes
// std::nullopt (the self-attention shorthand); `scale`, `sliding_window` and
// `softcap` keep their presence; `position_ids` is viewed as it is.
AttentionRequest ToAttentionRequest(const v1::AttendRequest& proto);

// A session's opening and steps, viewing `proto` likewise. The opening's
// `batch` 0 means 1; a step's absent `keys` or `values` stays std::nullopt.
SessionOpen ToSessionOpen(const v1::SessionOpen& proto);
SessionStep ToSessionStep(const v1::SessionStep& proto);

// Fills `output` (and `attention_weights` when it is non-empty).
void ToAttendResponse(const AttentionResult& result, v1::AttendResponse* response);
void ToSessionResponse(const AttentionResult& result, v1::SessionResponse* response);

// Same code, same message. gRPC and absl share the canonical code numbering.
grpc::Status ToGrpcStatus(const absl::Status& status);

// What ListModels reports for `model`.
v1::ModelInfo ToModelInfo(const Model& model);

}  // namespace attention::server
