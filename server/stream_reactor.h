// stream_reactor.h: one AttendStream call (AttentionService::StreamReactor).
//
// The stream is authenticated and admitted once, when it opens; a refused
// stream ends before reading anything and is counted in
// attention_streams_refused_total. Requests are then read, computed and
// answered in order as OrderedStream (ordered_stream.h) does; a bad request
// gets its error as an answer and the stream goes on.
#pragma once

#include "absl/status/status.h"
#include "attention.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "server/attention_service.h"
#include "server/ordered_stream.h"

namespace attention::server {

// One request of an AttendStream and its answer.
struct AttendSlot {
  v1::AttendRequest request;
  v1::AttendResponse response;
  int64_t served_version = 0;  // the model version that answered
  bool answered = false;       // OrderedStream's
};

class AttentionService::StreamReactor final : public OrderedStream<AttendSlot> {
 public:
  // Refuses the call at once (UNAUTHENTICATED, or UNAVAILABLE while shutting
  // down) or starts reading. Deletes itself in OnDone().
  StreamReactor(AttentionService* service, grpc::CallbackServerContext* context);

  void OnDone() override;

 private:
  void Submit(AttendSlot& slot) override;
  // Ends the call before it reads anything, counting the refusal.
  void RefuseStream(const absl::Status& status);
  // Receives the answer of `slot`'s request, from Submit().
  void Answer(AttendSlot& slot, const absl::Status& status, const AttentionResult* result);

  AttentionService* const service_;
  grpc::CallbackServerContext* const context_;  // owned by gRPC; alive until OnDone
  bool admitted_ = false;                       // set before anything can call OnDone
};

}  // namespace attention::server
