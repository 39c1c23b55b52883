// attend_session.cc: the AttendSession reactor.
#include "server/api/attention/attend_session.h"

#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "server/api/attention/attention_adapter.h"
#include "server/api/grpc/grpc_call.h"
#include "server/api/grpc/step_chain.h"

namespace attention::server {
namespace {

// The `api` label of attention.v1 requests.
constexpr std::string_view kAttentionApi = "attention";

// The token rows a step's result answers: B times n_new.
int64_t NewTokens(const AttentionResult& result) {
  return result.output.shape[0] * result.output.shape[1];
}

// One message of an AttendSession stream and its answer.
struct SessionSlot {
  grpc::ByteBuffer wire_request;
  v1::SessionRequest request;
  v1::SessionResponse response;
  grpc::ByteBuffer wire_response;
  Session* stepping = nullptr;  // the session while this slot's step is in flight
  bool answered = false;        // OrderedStream's
};

class AttendSessionReactor final : public AdmittedStream<SessionSlot> {
 public:
  AttendSessionReactor(Dispatcher* dispatcher, SessionTable* sessions,
                       grpc::CallbackServerContext* context)
      : AdmittedStream(dispatcher, context),
        sessions_(sessions),
        context_(context),
        link_(std::make_shared<StreamEndLink<AttendSessionReactor>>(this)) {
    Open(kAttentionApi, "AttendSession");
  }

  void OnDone() override {
    link_->Detach();
    if (session_) {
      sessions_->Close(session_, context_->IsCancelled() ? SessionEnd::kFailed
                                                         : SessionEnd::kClosed);
    }
    AdmittedStream::OnDone();
  }

  using AdmittedStream::End;

 private:
  void Submit(SessionSlot& slot) override {
    chain_.Run([this, &slot] { Handle(slot); });
  }

  void Handle(SessionSlot& slot) {
    if (absl::Status readable = ParseWire(&slot.wire_request, &slot.request); !readable.ok()) {
      return Answer(slot, readable, nullptr);
    }
    switch (slot.request.message_case()) {
      case v1::SessionRequest::kOpen:
        return SubmitOpening(slot);
      case v1::SessionRequest::kStep:
        return Step(slot);
      case v1::SessionRequest::MESSAGE_NOT_SET:
        break;
    }
    Answer(slot, absl::InvalidArgumentError("message: expected `open` or `step`, got neither"),
           nullptr);
  }

  void SubmitOpening(SessionSlot& slot) {
    const v1::SessionOpen& open = slot.request.open();
    dispatcher()->SubmitOpening(
        origin(),
        Dispatcher::Request{
            .api = kAttentionApi,
            .model = open.model(),
            .version = open.has_version() ? std::optional<int64_t>(open.version()) : std::nullopt,
            .request_id = slot.request.request_id(),
            .message_bytes = static_cast<int64_t>(slot.request.ByteSizeLong()),
            .credentials_checked = true,
            .readable = absl::OkStatus()},
        [this, &open](const ServedModel& served) { return OpenSession(open, served); },
        [this, &slot](const absl::Status& status, const AttentionResult*) {
          Answer(slot, status, nullptr);
        });
  }

  absl::Status OpenSession(const v1::SessionOpen& open, const ServedModel& served) {
    if (session_) {
      return absl::FailedPreconditionError(absl::StrCat(
          "open: the stream's session ", SessionTable::Id(session_),
          " is open already; a stream holds one session (open another stream)"));
    }
    absl::StatusOr<SessionTable::Handle> handle = sessions_->Open(
        open.model(), served, ToSessionOpen(open), {},
        EndStreamWithSession(link_, /*at_preemption=*/true));
    if (!handle.ok()) return handle.status();
    session_ = *std::move(handle);
    model_ = open.model();
    return absl::OkStatus();
  }

  void Step(SessionSlot& slot) {
    dispatcher()->SubmitStep(
        origin(),
        Dispatcher::Request{.api = kAttentionApi,
                            .model = model_,
                            .request_id = slot.request.request_id(),
                            .message_bytes = static_cast<int64_t>(slot.request.ByteSizeLong()),
                            .credentials_checked = true,
                            .readable = absl::OkStatus(),
                            .continues_session = true},
        [this, &slot](const absl::StatusOr<ServedModel>&) -> absl::StatusOr<Dispatcher::Step> {
          if (!session_) {
            return absl::FailedPreconditionError(
                "step: no session is open: the stream's first message must be `open`");
          }
          absl::StatusOr<Session*> session = sessions_->BeginStep(session_);
          if (!session.ok()) return session.status();
          slot.stepping = *session;
          return Dispatcher::Step{.session = *session,
                                  .served = SessionTable::Served(session_),
                                  .step = ToSessionStep(slot.request.step())};
        },
        [this, &slot](const absl::Status& status, const AttentionResult* result) {
          Answer(slot, sessions_->NameLimits(status), result);
        });
  }

  void Answer(SessionSlot& slot, const absl::Status& status, const AttentionResult* result) {
    // A step whose session was preempted before the step began (the
    // session idle, or its step waiting for memory) gets no answer: the
    // stream ends UNAVAILABLE in its place (the table ends it), which the
    // clients take for a break, so they replay the session and send the
    // step again.
    if (!status.ok() && slot.request.has_step() && session_ && sessions_->Preempted(session_)) {
      if (slot.stepping != nullptr) {
        sessions_->EndStep(session_, 0);
        slot.stepping = nullptr;
      }
      chain_.Done();
      return Withdrawn(slot);
    }
    v1::SessionResponse& response = slot.response;
    if (status.ok() && result != nullptr) ToSessionResponse(*result, &response);
    if (!status.ok()) {
      response.mutable_error()->set_code(static_cast<int32_t>(status.code()));
      response.mutable_error()->set_message(std::string(status.message()));
    }
    if (session_) {
      response.set_session_id(SessionTable::Id(session_));
      response.set_model(model_);
      response.set_model_version(SessionTable::Served(session_).version);
    }
    response.set_length(session_ ? sessions_->Length(session_) : 0);
    if (slot.stepping != nullptr) {
      sessions_->EndStep(session_, result != nullptr ? NewTokens(*result) : 0);
      slot.stepping = nullptr;
    }
    response.set_request_id(slot.request.request_id());
    WriteWire(response, &slot.wire_response);
    // The next step starts before this answer is marked: once every answer
    // is marked the stream may finish and delete itself.
    chain_.Done();
    Answered(slot);
  }

  SessionTable* const sessions_;         // not owned
  grpc::CallbackServerContext* const context_;
  const std::shared_ptr<StreamEndLink<AttendSessionReactor>> link_;
  StepChain chain_;
  // Set by the opening; read by the steps after it (the chain orders them).
  SessionTable::Handle session_;
  std::string model_;
};

}  // namespace

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* NewAttendSession(
    Dispatcher* dispatcher, SessionTable* sessions, grpc::CallbackServerContext* context) {
  return new AttendSessionReactor(dispatcher, sessions, context);
}

}  // namespace attention::server
