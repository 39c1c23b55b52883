// inference_api.cc: the Open Inference Protocol RPC handlers and the
// ModelStreamInfer reactor.
#include "server/api/inference/inference_api.h"

#include <memory>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "server/api/grpc/grpc_call.h"
#include "server/api/inference/inference_adapter.h"
#include "server/api/grpc/step_chain.h"

namespace attention::server {
namespace {

// The `api` label of Open Inference Protocol requests over gRPC.
constexpr std::string_view kInferenceApi = "inference";

}  // namespace

grpc::ServerUnaryReactor* InferenceApi::ServerLive(grpc::CallbackServerContext* context,
                                                   const grpc::ByteBuffer* request,
                                                   grpc::ByteBuffer* response) {
  return AnswerAtOnce(context, request, response, operations_, &InferenceOperations::ServerLive);
}

grpc::ServerUnaryReactor* InferenceApi::ServerReady(grpc::CallbackServerContext* context,
                                                    const grpc::ByteBuffer* request,
                                                    grpc::ByteBuffer* response) {
  return AnswerAtOnce(context, request, response, operations_, &InferenceOperations::ServerReady);
}

grpc::ServerUnaryReactor* InferenceApi::ModelReady(grpc::CallbackServerContext* context,
                                                   const grpc::ByteBuffer* request,
                                                   grpc::ByteBuffer* response) {
  return AnswerAtOnce(context, request, response, operations_, &InferenceOperations::ModelReady);
}

grpc::ServerUnaryReactor* InferenceApi::ServerMetadata(grpc::CallbackServerContext* context,
                                                       const grpc::ByteBuffer* request,
                                                       grpc::ByteBuffer* response) {
  return AnswerAtOnce(context, request, response, operations_,
                      &InferenceOperations::ServerMetadata);
}

grpc::ServerUnaryReactor* InferenceApi::ModelMetadata(grpc::CallbackServerContext* context,
                                                      const grpc::ByteBuffer* request,
                                                      grpc::ByteBuffer* response) {
  return AnswerAtOnce(context, request, response, operations_, &InferenceOperations::ModelMetadata);
}

grpc::ServerUnaryReactor* InferenceApi::ModelConfig(grpc::CallbackServerContext* context,
                                                    const grpc::ByteBuffer* request,
                                                    grpc::ByteBuffer* response) {
  return AnswerAtOnce(context, request, response, operations_, &InferenceOperations::ModelConfig);
}

grpc::ServerUnaryReactor* InferenceApi::ModelStatistics(grpc::CallbackServerContext* context,
                                                        const grpc::ByteBuffer* request,
                                                        grpc::ByteBuffer* response) {
  return AnswerAtOnce(context, request, response, operations_,
                      &InferenceOperations::ModelStatistics);
}

grpc::ServerUnaryReactor* InferenceApi::RepositoryIndex(grpc::CallbackServerContext* context,
                                                        const grpc::ByteBuffer* request,
                                                        grpc::ByteBuffer* response) {
  return AnswerAtOnce(context, request, response, operations_,
                      &InferenceOperations::RepositoryIndex);
}

grpc::ServerUnaryReactor* InferenceApi::RepositoryModelLoad(grpc::CallbackServerContext* context,
                                                            const grpc::ByteBuffer* request,
                                                            grpc::ByteBuffer* response) {
  return AnswerAtOnce(context, request, response, operations_,
                      &InferenceOperations::RepositoryModelLoad);
}

grpc::ServerUnaryReactor* InferenceApi::RepositoryModelUnload(grpc::CallbackServerContext* context,
                                                              const grpc::ByteBuffer* request,
                                                              grpc::ByteBuffer* response) {
  return AnswerAtOnce(context, request, response, operations_,
                      &InferenceOperations::RepositoryModelUnload);
}

// What ModelInfer's answer needs besides its messages: the decoded request
// the engine reads.
struct InferState {
  DecodedInferRequest decoded;
  int64_t served_version = 0;
};
using InferReactor =
    WireUnaryReactor<inference::ModelInferRequest, inference::ModelInferResponse, InferState>;

grpc::ServerUnaryReactor* InferenceApi::ModelInfer(grpc::CallbackServerContext* context,
                                                   const grpc::ByteBuffer* request,
                                                   grpc::ByteBuffer* response) {
  auto* reactor = new InferReactor(dispatcher_, context, request, response);
  operations_->Infer(reactor->origin, kInferenceApi, reactor->request, reactor->readable,
                     &reactor->state.decoded, &reactor->state.served_version,
                     /*credentials_checked=*/false,
                     [reactor](const absl::Status& status, const AttentionResult* result) {
                       if (status.ok()) {
                         EncodeInferResponse(reactor->request, reactor->state.decoded, *result,
                                             &reactor->response, reactor->state.served_version);
                       }
                       reactor->Answer(status);
                     });
  return reactor;
}

// One request of a ModelStreamInfer call and its answer.
struct InferSlot {
  grpc::ByteBuffer wire_request;
  inference::ModelInferRequest request;
  DecodedInferRequest decoded;
  inference::ModelStreamInferResponse response;
  grpc::ByteBuffer wire_response;
  int64_t served_version = 0;
  absl::Status readable;  // whether wire_request parsed
  bool chained = false;   // a sequence request, run in the stream's StepChain
  bool answered = false;  // OrderedStream's
};

// One ModelStreamInfer call, run like AttendStream (ordered_stream.h): a
// failed request's answer is its `error_message`.
class InferenceApi::StreamReactor final : public AdmittedStream<InferSlot> {
 public:
  StreamReactor(InferenceApi* service, grpc::CallbackServerContext* context)
      : AdmittedStream(service->dispatcher_, context),
        service_(service),
        link_(std::make_shared<StreamEndLink<StreamReactor>>(this)) {
    Open(kInferenceApi, "ModelStreamInfer");
  }

  void OnDone() override {
    link_->Detach();
    AdmittedStream::OnDone();
  }

  using AdmittedStream::End;

 private:
  void Submit(InferSlot& slot) override {
    // Credentials were checked once, when the stream opened.
    slot.readable = ParseWire(&slot.wire_request, &slot.request);
    // A sequence's requests each need the one before them done; the
    // stream's sequence requests therefore run one after another.
    slot.chained = slot.readable.ok() && slot.request.parameters().contains(kSequenceIdParameter);
    if (!slot.chained) return Infer(slot);
    chain_.Run([this, &slot] { Infer(slot); });
  }

  void Infer(InferSlot& slot) {
    service_->operations_->Infer(
        origin(), kInferenceApi, slot.request, slot.readable, &slot.decoded, &slot.served_version,
        /*credentials_checked=*/true,
        [this, &slot](const absl::Status& status, const AttentionResult* result) {
          Answer(slot, status, result);
        },
        absl::OkStatus(), EndStreamWithSession(link_, /*at_preemption=*/false));
  }

  void Answer(InferSlot& slot, const absl::Status& status, const AttentionResult* result) {
    inference::ModelInferResponse& answer = *slot.response.mutable_infer_response();
    if (status.ok()) {
      EncodeInferResponse(slot.request, slot.decoded, *result, &answer, slot.served_version);
    } else {
      // The protocol carries no code here, so the message leads with it.
      slot.response.set_error_message(absl::StrCat(absl::StatusCodeToString(status.code()), ": ",
                                                   std::string(status.message())));
      answer.set_model_name(slot.request.model_name());
      answer.set_id(slot.request.id());
    }
    WriteWire(slot.response, &slot.wire_response);
    // Before the answer is marked: once every answer is, the stream may
    // finish and delete itself.
    if (slot.chained) chain_.Done();
    Answered(slot);
  }

  InferenceApi* const service_;
  StepChain chain_;
  // The sequences this stream opens end it at shutdown.
  const std::shared_ptr<StreamEndLink<StreamReactor>> link_;
};

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* InferenceApi::ModelStreamInfer(
    grpc::CallbackServerContext* context) {
  return new StreamReactor(this, context);
}

}  // namespace attention::server
