// attention_api.cc: the attention.v1 handlers and the AttendStream reactor.
#include "server/api/attention/attention_api.h"

#include <string>
#include <utility>

#include "server/api/attention/attend_session.h"
#include "server/api/attention/attention_adapter.h"
#include "server/api/grpc/grpc_call.h"
#include "server/api/inference/repository_views.h"
#include "spdlog/spdlog.h"

namespace attention::server {
namespace {

// The `api` label of attention.v1 requests.
constexpr std::string_view kAttentionApi = "attention";

// Submits `request`, whose engine form views it; `readable` says whether its
// bytes parsed.
void SubmitAttend(Dispatcher& dispatcher, const CallOrigin& origin,
                  const v1::AttendRequest& request, absl::Status readable, int64_t* served_version,
                  bool credentials_checked, Dispatcher::Done done) {
  dispatcher.Submit(
      origin,
      Dispatcher::Request{.api = kAttentionApi,
                          .model = request.model(),
                          .version = request.has_version()
                                         ? std::optional<int64_t>(request.version())
                                         : std::nullopt,
                          .request_id = request.request_id(),
                          .message_bytes = static_cast<int64_t>(request.ByteSizeLong()),
                          .served_version = served_version,
                          .credentials_checked = credentials_checked,
                          .readable = std::move(readable)},
      [&request]() -> absl::StatusOr<AttentionRequest> { return ToAttentionRequest(request); },
      std::move(done));
}

// One request of an AttendStream and its answer.
struct AttendSlot {
  grpc::ByteBuffer wire_request;
  v1::AttendRequest request;
  v1::AttendResponse response;
  grpc::ByteBuffer wire_response;
  int64_t served_version = 0;  // the model version that answered
  bool answered = false;       // OrderedStream's
};

// One AttendStream call: a failed request's answer is its `error`.
class AttendStreamReactor final : public AdmittedStream<AttendSlot> {
 public:
  AttendStreamReactor(Dispatcher* dispatcher, grpc::CallbackServerContext* context)
      : AdmittedStream(dispatcher, context) {
    Open(kAttentionApi, "AttendStream");
  }

 private:
  void Submit(AttendSlot& slot) override {
    absl::Status readable = ParseWire(&slot.wire_request, &slot.request);
    SubmitAttend(*dispatcher(), origin(), slot.request, std::move(readable), &slot.served_version,
                 /*credentials_checked=*/true,
                 [this, &slot](const absl::Status& status, const AttentionResult* result) {
                   Answer(slot, status, result);
                 });
  }

  void Answer(AttendSlot& slot, const absl::Status& status, const AttentionResult* result) {
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
    WriteWire(response, &slot.wire_response);
    Answered(slot);
  }
};

// What Attend's answer needs besides its messages.
struct AttendState {
  int64_t served_version = 0;
};
using AttendReactor = WireUnaryReactor<v1::AttendRequest, v1::AttendResponse, AttendState>;

}  // namespace

grpc::ServerUnaryReactor* AttentionApi::Attend(grpc::CallbackServerContext* context,
                                               const grpc::ByteBuffer* request,
                                               grpc::ByteBuffer* response) {
  auto* reactor = new AttendReactor(dispatcher_, context, request, response);
  SubmitAttend(*dispatcher_, reactor->origin, reactor->request, reactor->readable,
               &reactor->state.served_version, /*credentials_checked=*/false,
               [reactor](const absl::Status& status, const AttentionResult* result) {
                 if (status.ok()) {
                   v1::AttendResponse& response = reactor->response;
                   ToAttendResponse(*result, &response);
                   response.set_request_id(reactor->request.request_id());
                   response.set_model(reactor->request.model());
                   response.set_model_version(reactor->state.served_version);
                 }
                 reactor->Answer(status);
               });
  return reactor;
}

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* AttentionApi::AttendStream(
    grpc::CallbackServerContext* context) {
  return new AttendStreamReactor(dispatcher_, context);
}

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* AttentionApi::AttendSession(
    grpc::CallbackServerContext* context) {
  return NewAttendSession(dispatcher_, sessions_, context);
}

grpc::ServerUnaryReactor* AttentionApi::ListModels(grpc::CallbackServerContext* context,
                                                   const grpc::ByteBuffer* request,
                                                   grpc::ByteBuffer* response) {
  return AnswerAtOnce(context, request, response, this, &AttentionApi::List);
}

absl::Status AttentionApi::List(const CallOrigin& origin, const v1::ListModelsRequest& request,
                                v1::ListModelsResponse* response) const {
  absl::Status status = origin.Authenticate(dispatcher_->access());
  if (status.ok()) {
    ListRegistry(*registry_, request.include_unavailable(), response);
  } else {
    spdlog::warn("ListModels refused: peer={}: {}", origin.peer(), std::string(status.message()));
  }
  return status;
}

}  // namespace attention::server
