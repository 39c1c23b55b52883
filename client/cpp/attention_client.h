// attention_client.h: a small typed client for attention.v1.AttentionService.
//
// Wraps the generated stub with what every caller would otherwise repeat:
//   - a deadline on every call (counted across its retries);
//   - TLS (server CA, optional client certificate) and a bearer token, sent as
//     `authorization: Bearer <token>`;
//   - several servers in one channel, balanced by gRPC's own `round_robin`
//     policy (see target.h for how a HOST:PORT list becomes one target);
//   - retries with exponential backoff on UNAVAILABLE only, done by gRPC's
//     retry policy in the channel's service config. UNAVAILABLE means the
//     call did not run (no server, or the server went away), so repeating it
//     is safe; every other code is the server's answer and is returned as is.
//     AttendStream is the exception: a stream is never retried.
//   - Attend and AttendAsync sent again, with a back-off from the same
//     options and within the same attempts and deadline, when an answer was
//     cut off on its way (UNKNOWN: an edge lost the replica sending it;
//     docs/api.md 6.11), which gRPC's retry policy cannot do once the
//     answer's headers arrived.
//
// Use it when you want one answer per call with errors as values, or
// AttendStream() for many requests over one call. Calls are thread-safe; one
// client (one channel) is meant to be shared.
//
//   absl::StatusOr<std::unique_ptr<AttentionClient>> client =
//       AttentionClient::Create({.target = "127.0.0.1:50051,127.0.0.1:50052"});
//   if (!client.ok()) return client.status();
//   absl::StatusOr<attention::v1::AttendResponse> response = (*client)->Attend(request);
#pragma once

#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "attention.grpc.pb.h"
#include "client/cpp/client_options.h"
#include "health.grpc.pb.h"
#include "inference/grpc_service.grpc.pb.h"

namespace attention::client {

class AttentionClient {
 public:
  // Builds the channel; it connects lazily, on the first call. Errors
  // (INVALID_ARGUMENT) name the option and the value at fault; an unreadable
  // TLS file is NOT_FOUND with its path.
  static absl::StatusOr<std::unique_ptr<AttentionClient>> Create(ClientOptions options);

  // Waits for every AttendAsync and InferAsync call to end: a gRPC thread still inside a
  // callback must not outlive the stub and channel it uses.
  ~AttentionClient();
  AttentionClient(const AttentionClient&) = delete;
  AttentionClient& operator=(const AttentionClient&) = delete;

  // One Attend call; blocks until its answer. `timeout` overrides the
  // client's default deadline for this call.
  absl::StatusOr<attention::v1::AttendResponse> Attend(
      const attention::v1::AttendRequest& request);
  absl::StatusOr<attention::v1::AttendResponse> Attend(
      const attention::v1::AttendRequest& request, absl::Duration timeout);

  // Starts an Attend call and returns at once; `done` runs on a gRPC thread
  // when the call ends. `request` is not copied: the caller owns it and keeps
  // it alive until `done` has run. `done` may start further calls.
  using AttendCallback = std::function<void(absl::StatusOr<attention::v1::AttendResponse>)>;
  void AttendAsync(const attention::v1::AttendRequest* request, AttendCallback done);

  // One AttendStream call carrying every request of `requests`, in order;
  // blocks until the call ends. Requests are written while answers are read,
  // so a stream of any length keeps moving (the server stops reading when
  // too many answers are unread). `timeout` (default: the client's) is the
  // deadline of the whole stream, not of each request.
  //
  // Returns one result per request, in order: its AttendResponse, or the
  // error the server answered it with (its AttendError code and message, e.g.
  // INVALID_ARGUMENT, NOT_FOUND, RESOURCE_EXHAUSTED) while the others are
  // answered. The outer status is the call's own: UNAUTHENTICATED,
  // DEADLINE_EXCEEDED, UNAVAILABLE...; answers received before such a failure
  // are dropped. An empty `requests` makes no call and returns no results.
  //
  // A stream is never retried: UNAVAILABLE (no server, or one lost midway)
  // fails the call, and resending is the caller's choice. It runs on a second
  // channel, to the same servers with the same credentials (gRPC shares the
  // connections), that has no retry policy: the gRPC of Debian 12 (1.51),
  // replaying a callback-API stream, lost requests, hung or crashed.
  using StreamResults = std::vector<absl::StatusOr<attention::v1::AttendResponse>>;
  absl::StatusOr<StreamResults> AttendStream(
      std::span<const attention::v1::AttendRequest> requests);
  absl::StatusOr<StreamResults> AttendStream(
      std::span<const attention::v1::AttendRequest> requests, absl::Duration timeout);

  // An AttendSession stream (docs/api.md section 11) on `context`, which the
  // caller keeps until the stream is finished; with the token, no deadline.
  // Session (session.h) wraps it, and survives losing its server.
  std::unique_ptr<grpc::ClientReaderWriter<attention::v1::SessionRequest,
                                           attention::v1::SessionResponse>>
  AttendSession(grpc::ClientContext& context);

  // Waits until `deadline` for the streams' channel to connect (it tries
  // to); false if it did not. For a session reopening through a target that
  // is restarting.
  bool WaitForStreamConnection(absl::Time deadline);

  // The deadline each call gets (ClientOptions::timeout).
  absl::Duration timeout() const { return options_.timeout; }

  absl::StatusOr<attention::v1::ListModelsResponse> ListModels();

  // grpc.health.v1.Health/Check for `service` ("" = the whole server).
  absl::StatusOr<grpc::health::v1::HealthCheckResponse::ServingStatus> Health(
      const std::string& service = "");

  // The Open Inference Protocol's repository extension (docs/api.md,
  // section 9.1): every model version with its state, and explicit loading
  // and unloading (servers started with --model-control explicit).
  absl::StatusOr<inference::RepositoryIndexResponse> RepositoryIndex();
  absl::Status LoadModel(const std::string& model);
  absl::Status UnloadModel(const std::string& model);

  // Starts an Open Inference Protocol ModelInfer call (docs/api.md section 9)
  // with the same deadline and token, and returns at once; `done` as for
  // AttendAsync. `request` must outlive the call. A request of a sequence
  // (a `sequence_id` parameter) also carries the header
  // `attention-sequence-id` (docs/api.md section 11.3), which an edge hashes
  // to send every step of the sequence to the replica holding it.
  using InferCallback = std::function<void(absl::StatusOr<inference::ModelInferResponse>)>;
  void InferAsync(const inference::ModelInferRequest* request, InferCallback done);

  // The channel, for callers that need another stub on the same connections.
  const std::shared_ptr<grpc::Channel>& channel() const { return channel_; }

 private:
  AttentionClient(ClientOptions options, std::shared_ptr<grpc::Channel> channel,
                  std::shared_ptr<grpc::Channel> stream_channel);

  // Deadline and credentials every call carries.
  void Prepare(grpc::ClientContext& context, absl::Duration timeout) const;
  void Prepare(grpc::ClientContext& context, absl::Time deadline) const;
  static absl::Time DeadlineAfter(absl::Duration timeout);

  // Whether an *Async call whose answer was cut off is sent again (Attend:
  // attention_client.cc, CutOffResends) or reported (ModelInfer, whose
  // sequences' steps are not sent twice).
  enum class CutOffs { kSendAgain, kReport };
  // What an *Async call keeps alive until it ends (attention_client.cc).
  template <typename Response>
  struct AsyncCall;
  // Counts an *Async call until it ends: `start(context, response, finished)`
  // starts it on a stub (again, on a new context, for each send), and
  // `finished` hands its outcome to `done`.
  template <typename Response, typename Start>
  void StartAsync(std::function<void(absl::StatusOr<Response>)> done, Start start,
                  CutOffs cut_offs);
  template <typename Response, typename Start>
  void SendAsync(AsyncCall<Response>* call, Start start, absl::Time deadline);

  const ClientOptions options_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<attention::v1::AttentionService::Stub> stub_;
  std::unique_ptr<grpc::health::v1::Health::Stub> health_stub_;
  std::unique_ptr<inference::GRPCInferenceService::Stub> inference_stub_;
  // AttendStream's: connects on the first stream, without retries.
  std::shared_ptr<grpc::Channel> stream_channel_;
  std::unique_ptr<attention::v1::AttentionService::Stub> stream_stub_;

  absl::Mutex async_mu_;
  int async_calls_ ABSL_GUARDED_BY(async_mu_) = 0;  // *Async calls not yet ended
};

// gRPC's status as an absl::Status: the codes are the same numbers.
absl::Status ToAbslStatus(const grpc::Status& status);

}  // namespace attention::client
