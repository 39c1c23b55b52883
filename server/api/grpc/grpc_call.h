// grpc_call.h: what every gRPC API of the server shares around a call: its
// CallOrigin for the dispatcher, the unary reactor that holds the call's
// messages and keeps the call open (drain waits for it) until gRPC is done
// with it, and a stream's opening.
//
// Written once here so that each API holds only its wire adaptation.
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"
#include "server/api/attention/attention_adapter.h"
#include "server/api/grpc/ordered_stream.h"
#include "server/api/grpc/wire_message.h"
#include "server/dispatch/call_origin.h"
#include "server/dispatch/dispatcher.h"
#include "server/security/access_policy.h"
#include "server/sessions/session_table.h"

namespace attention::server {

// A gRPC call as the dispatcher and the APIs' operations see it.
class GrpcCallOrigin final : public CallOrigin {
 public:
  // Where the server's traceparent goes. A call that begins once the server
  // stopped accepting is refused, and its refusal goes out as one frame, the
  // status alone ("trailers-only"), so that a proxy relays all of it or
  // nothing: with initial metadata it is two frames, and an edge whose
  // connection to this server closes between them (the process ends right
  // after its drain) ends the client's stream with neither status nor error
  // (the client sees UNKNOWN: 1 call of 3,846 in 5 SIGTERMs through the
  // edge, in CI).
  // kWhenAnswered: neither yet; the call's reactor says where once it knows
  // its answer (EchoTraceparent).
  enum class Echo { kInInitialMetadata, kInTrailingMetadata, kWhenAnswered };
  static Echo EchoFor(const Dispatcher& dispatcher) {
    return dispatcher.accepting() ? Echo::kInInitialMetadata : Echo::kInTrailingMetadata;
  }

  // `context` is owned by gRPC and alive until the call's OnDone. Takes the
  // call's traceparent, and echoes the server's where `echo` says (initial
  // metadata: sent with the first answer, always after this).
  explicit GrpcCallOrigin(grpc::CallbackServerContext* context,
                          Echo echo = Echo::kInInitialMetadata)
      : context_(context) {
    const auto& metadata = context->client_metadata();
    const auto traceparent = metadata.find(kTraceparentKey);
    if (traceparent != metadata.end()) {
      SetTraceparent(std::string_view(traceparent->second.data(), traceparent->second.size()));
    }
    if (echo != Echo::kWhenAnswered) EchoTraceparent(echo);
  }

  // Once, before the call's Finish; `echo` is not kWhenAnswered.
  void EchoTraceparent(Echo echo) const {
    if (echo == Echo::kInInitialMetadata) {
      context_->AddInitialMetadata(kTraceparentKey, trace().Traceparent());
    } else {
      context_->AddTrailingMetadata(kTraceparentKey, trace().Traceparent());
    }
  }

  absl::Time deadline() const override {
    const std::chrono::system_clock::time_point t = context_->deadline();
    if (t == std::chrono::system_clock::time_point::max()) return absl::InfiniteFuture();
    return absl::FromChrono(t);
  }
  bool cancelled() const override { return context_->IsCancelled(); }
  std::string peer() const override { return context_->peer(); }
  absl::Status Authenticate(const AccessPolicy& access) const override {
    return access.Check(*context_);
  }

 private:
  static constexpr char kTraceparentKey[] = "traceparent";

  grpc::CallbackServerContext* const context_;
};

// A unary call whose request the dispatcher computes: it parses the request
// (`readable` says whether its bytes parsed), holds it and the response
// until gRPC is done with the call, and counts the call open in the
// dispatcher from its handler until OnDone, when gRPC has sent the answer
// and the status: shutdown waits for that. `State` is what the answer needs
// besides the two messages. Deletes itself in OnDone.
template <typename Request, typename Response, typename State>
class WireUnaryReactor final : public grpc::ServerUnaryReactor {
 public:
  // Not open only while shutting down, and then Submit() refuses the request.
  WireUnaryReactor(Dispatcher* dispatcher, grpc::CallbackServerContext* context,
                   const grpc::ByteBuffer* wire_request, grpc::ByteBuffer* wire_response)
      : origin(context, GrpcCallOrigin::Echo::kWhenAnswered),
        readable(ParseWire(wire_request, &request)),
        dispatcher_(dispatcher),
        wire_response_(wire_response),
        open_(dispatcher->OpenCall("requests").ok()) {}

  // Sends `status`, with the response when it is OK. The reactor may be
  // deleted before this returns (InternalInlineable).
  void Answer(const absl::Status& status) {
    // Decided now, not when the call began: the server may have stopped
    // accepting in between, and then this is the refusal of a call it no
    // longer takes, which goes out as one frame.
    const bool refused_at_shutdown =
        !open_ || (status.code() == absl::StatusCode::kUnavailable && !dispatcher_->accepting());
    origin.EchoTraceparent(refused_at_shutdown ? GrpcCallOrigin::Echo::kInTrailingMetadata
                                               : GrpcCallOrigin::Echo::kInInitialMetadata);
    if (status.ok()) WriteWire(response, wire_response_);
    Finish(ToGrpcStatus(status));
  }

  void OnDone() override {
    if (open_) dispatcher_->CloseCall();
    delete this;
  }
  // gRPC runs OnDone where the call ends, instead of handing it to its
  // executor thread: that hand-over (a wake-up, and the call's teardown on
  // another core) was about 2 of a trivial call's 40 us of server CPU. Sound while
  // OnDone stays as short as it is and nothing after Answer() touches the
  // reactor: it may be gone once Finish returns. gRPC's own DefaultReactor
  // says the same of itself; the hook is public but marked internal, and
  // `override` fails the build should a gRPC drop it.
  bool InternalInlineable() override { return true; }

  const GrpcCallOrigin origin;
  Request request;
  const absl::Status readable;  // declared after `request`, which it parses
  Response response;
  State state;

 private:
  Dispatcher* const dispatcher_;
  grpc::ByteBuffer* const wire_response_;  // gRPC's, alive until OnDone
  const bool open_;
};

// A stream call (ordered_stream.h) that is authenticated and counted open
// once, when it opens; a refused stream ends before reading anything.
// Deletes itself in OnDone.
template <typename Slot>
class AdmittedStream : public OrderedStream<Slot> {
 public:
  void OnDone() override {
    if (open_) dispatcher_->CloseCall();
    delete this;
  }

 protected:
  AdmittedStream(Dispatcher* dispatcher, grpc::CallbackServerContext* context)
      : dispatcher_(dispatcher), origin_(context, GrpcCallOrigin::EchoFor(*dispatcher)) {}

  // The last step of the API's constructor (reading may start at once, on
  // another thread): refuses the call (UNAUTHENTICATED, or UNAVAILABLE while
  // shutting down) or starts reading. `api` and `method` name the call in
  // metrics and logs.
  void Open(std::string_view api, std::string_view method) {
    if (absl::Status status = dispatcher_->OpenStream(origin_, api, method); !status.ok()) {
      this->Refuse(ToGrpcStatus(status));
      return;
    }
    open_ = true;
    this->Progress();
  }

  Dispatcher* dispatcher() const { return dispatcher_; }
  const GrpcCallOrigin& origin() const { return origin_; }

 private:
  Dispatcher* const dispatcher_;
  const GrpcCallOrigin origin_;
  bool open_ = false;  // set before anything can call OnDone
};

// What a session opened on a stream does when the server ends it
// (SessionTable::OnEnd): its stream finishes UNAVAILABLE once the answers
// read so far are written, at shutdown and, when `at_preemption`, when the
// session is preempted (an AttendSession stream holds that one session; a
// ModelStreamInfer stream holds many sequences, and a preempted one is told
// at its next request).
template <typename Reactor>
SessionTable::OnEnd EndStreamWithSession(const std::shared_ptr<StreamEndLink<Reactor>>& link,
                                         bool at_preemption) {
  return [weak = std::weak_ptr<StreamEndLink<Reactor>>(link), at_preemption](
             SessionEnd reason, const absl::Status& why) {
    if (reason == SessionEnd::kPreempted && !at_preemption) return;
    if (auto alive = weak.lock()) {
      alive->End(ToGrpcStatus(
          reason == SessionEnd::kShutdown
              ? absl::UnavailableError("the server shut down after its grace period; its "
                                       "sessions' keys and values are gone")
              : why));
    }
  };
}

// A unary call answered inside its handler: parses the request, runs
// (api->*handle)(origin, request, &response), which gives the call's status,
// and finishes with the response when that is OK.
template <typename Api, typename Request, typename Response>
grpc::ServerUnaryReactor* AnswerAtOnce(
    grpc::CallbackServerContext* context, const grpc::ByteBuffer* wire_request,
    grpc::ByteBuffer* wire_response, const Api* api,
    absl::Status (Api::*handle)(const CallOrigin&, const Request&, Response*) const) {
  Request request;
  Response response;
  absl::Status status = ParseWire(wire_request, &request);
  if (status.ok()) status = (api->*handle)(GrpcCallOrigin(context), request, &response);
  if (status.ok()) WriteWire(response, wire_response);
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

}  // namespace attention::server
