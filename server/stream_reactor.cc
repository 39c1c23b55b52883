// stream_reactor.cc: the AttendStream reactor (see stream_reactor.h).
#include "server/stream_reactor.h"

#include <string>

#include "server/auth.h"
#include "server/proto_adapter.h"
#include "spdlog/spdlog.h"

namespace attention::server {

AttentionService::StreamReactor::StreamReactor(AttentionService* service,
                                               grpc::CallbackServerContext* context)
    : service_(service), context_(context) {
  if (absl::Status auth = service_->Authenticate(*context);
      !auth.ok()) {
    spdlog::warn("AttendStream refused: peer={}: {}", context->peer(), std::string(auth.message()));
    RefuseStream(auth);
    return;
  }
  admitted_ = service_->AdmitCall();
  if (!admitted_) {
    RefuseStream(absl::UnavailableError("the server is shutting down and takes no new streams"));
    return;
  }
  Progress();
}

void AttentionService::StreamReactor::OnDone() {
  if (admitted_) service_->CallDone();
  delete this;
}

void AttentionService::StreamReactor::Submit(AttendSlot& slot) {
  service_->Submit(context_, slot.request,
                   [this, &slot](const absl::Status& status, const AttentionResult* result) {
                     Answer(slot, status, result);
                   },
                   &slot.served_version);
}

void AttentionService::StreamReactor::RefuseStream(const absl::Status& status) {
  service_->metrics_->CountRefusedStream("attention", status.code());
  Refuse(ToGrpcStatus(status));
}

void AttentionService::StreamReactor::Answer(AttendSlot& slot, const absl::Status& status,
                                             const AttentionResult* result) {
  v1::AttendResponse& response = slot.response;
  if (status.ok()) {
    ToAttendResponse(*result, &response);
    response.set_model_version(slot.served_version);
  } else {
    response.mutable_error()->set_code(static_cast<int32_t>(status.code()));
    response.mutable_error()->set_message(std::string(status.message()));
  }
  response.set_request_id(slot.request.request_id());
  response.set_model(slot.request.model());
  Answered(slot);
}

}  // namespace attention::server
