// stream_reactor.h: one AttendStream call (AttentionService::StreamReactor).
//
// The stream is authenticated and admitted once, when it opens; a refused
// stream ends before reading anything and is counted in
// attention_streams_refused_total. Requests are then read one after another
// and submitted as they come, so several can compute at once (at most
// kMaxStreamInFlight); answers are written one at a time, in request order. A
// bad request gets its error as an answer and the stream goes on.
//
// Every decision is taken under mu_ and acted on after it is released (see
// Progress()), which is what makes the lifetime rule safe: once Finish() is
// decided nothing else touches the reactor, and OnDone() deletes it.
#pragma once

#include <cstddef>
#include <deque>
#include <memory>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "attention.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "server/attention_service.h"

namespace attention::server {

class AttentionService::StreamReactor final
    : public grpc::ServerBidiReactor<v1::AttendRequest, v1::AttendResponse> {
 public:
  // Answers a stream holds at once (computing or waiting to be written); the
  // stream stops reading beyond, so one stream cannot hoard server memory.
  static constexpr size_t kMaxStreamInFlight = 32;

  // Refuses the call at once (UNAUTHENTICATED, or UNAVAILABLE while shutting
  // down) or starts reading. Deletes itself in OnDone().
  StreamReactor(AttentionService* service, grpc::CallbackServerContext* context);

  void OnReadDone(bool ok) override;
  void OnWriteDone(bool ok) override;
  void OnCancel() override;
  void OnDone() override;

 private:
  struct Slot {
    v1::AttendRequest request;
    v1::AttendResponse response;
    bool answered = false;  // guarded by mu_
  };

  // Ends the call before it reads anything; only the constructor calls it.
  void Refuse(const absl::Status& status);
  // Receives the answer of `slot`'s request, from Submit().
  void Answered(Slot& slot, const absl::Status& status, const AttentionResult* result);
  // Starts whatever the state allows: the next write, the next read, or
  // Finish() once every answer is out.
  void Progress();

  AttentionService* const service_;
  grpc::CallbackServerContext* const context_;  // owned by gRPC; alive until OnDone
  bool admitted_ = false;                       // set before anything can call OnDone

  absl::Mutex mu_;
  // Requests read, in order, until their answer is written; the front one is
  // the next to write.
  std::deque<std::unique_ptr<Slot>> slots_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<Slot> incoming_ ABSL_GUARDED_BY(mu_);  // target of the read in flight
  bool reading_ ABSL_GUARDED_BY(mu_) = false;
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool reads_done_ ABSL_GUARDED_BY(mu_) = false;
  bool broken_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace attention::server
