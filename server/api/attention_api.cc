// attention_api.cc: the attention.v1 handlers and the AttendStream reactor.
#include "server/api/attention_api.h"

#include <string>
#include <utility>

#include "server/api/attention_adapter.h"
#include "server/api/grpc_call.h"
#include "server/repository/views.h"
#include "spdlog/spdlog.h"

namespace attention::server {
namespace {

// The `api` label of attention.v1 requests.
constexpr std::string_view kAttentionApi = "attention";

Dispatcher::Request FromAttend(const v1::AttendRequest& request, int64_t* served_version,
                               bool credentials_checked) {
  return Dispatcher::Request{
      .api = kAttentionApi,
      .model = request.model(),
      .version = request.has_version() ? std::optional<int64_t>(request.version()) : std::nullopt,
      .request_id = request.request_id(),
      .message_bytes = static_cast<int64_t>(request.ByteSizeLong()),
      .served_version = served_version,
      .credentials_checked = credentials_checked};
}

// Submits `request`, whose engine form views it.
void SubmitAttend(Dispatcher& dispatcher, const CallOrigin& origin,
                  const v1::AttendRequest& request, int64_t* served_version,
                  bool credentials_checked, Dispatcher::Done done) {
  dispatcher.Submit(origin, FromAttend(request, served_version, credentials_checked),
                    [&request]() -> absl::StatusOr<AttentionRequest> {
                      return ToAttentionRequest(request);
                    },
                    std::move(done));
}

// One request of an AttendStream and its answer.
struct AttendSlot {
  v1::AttendRequest request;
  v1::AttendResponse response;
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
    SubmitAttend(*dispatcher(), origin(), slot.request, &slot.served_version,
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
    Answered(slot);
  }
};

// What Attend's answer needs besides the messages gRPC owns.
struct AttendState {
  int64_t served_version = 0;
};

}  // namespace

grpc::ServerUnaryReactor* AttentionApi::Attend(grpc::CallbackServerContext* context,
                                               const v1::AttendRequest* request,
                                               v1::AttendResponse* response) {
  auto* reactor = new AdmittedUnaryReactor<AttendState>(dispatcher_, context);
  SubmitAttend(*dispatcher_, reactor->origin, *request, &reactor->state.served_version,
               /*credentials_checked=*/false,
               [reactor, request, response](const absl::Status& status,
                                            const AttentionResult* result) {
                 if (status.ok()) {
                   ToAttendResponse(*result, response);
                   response->set_request_id(request->request_id());
                   response->set_model(request->model());
                   response->set_model_version(reactor->state.served_version);
                 }
                 reactor->Finish(ToGrpcStatus(status));
               });
  return reactor;
}

grpc::ServerBidiReactor<v1::AttendRequest, v1::AttendResponse>* AttentionApi::AttendStream(
    grpc::CallbackServerContext* context) {
  return new AttendStreamReactor(dispatcher_, context);
}

grpc::ServerUnaryReactor* AttentionApi::ListModels(grpc::CallbackServerContext* context,
                                                   const v1::ListModelsRequest* request,
                                                   v1::ListModelsResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  absl::Status status = dispatcher_->access().Check(*context);
  if (status.ok()) {
    ListRegistry(*registry_, request->include_unavailable(), response);
  } else {
    spdlog::warn("ListModels refused: peer={}: {}", context->peer(), std::string(status.message()));
  }
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

}  // namespace attention::server
