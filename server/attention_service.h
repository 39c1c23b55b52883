// attention_service.h: the attention.v1.AttentionService implementation.
//
// Built on gRPC's callback API: no thread waits on a call. A request is
// authenticated (auth.h; a stream once, when it opens), resolved to its
// model version in the live registry (repository_registry.h; the request
// holds that version's weights until it is answered, whatever reloads
// meanwhile), validated (core's Validate(), which names the faulty field) and
// queued in its model's Batcher, all inside the RPC handler; anything wrong is
// answered there, before any work is queued. There is one batcher per model
// name, created when the name is first requested; it keeps the versions of a
// batch apart (one Engine::Run per version), so a reload never fails or
// mixes queued requests. Each batcher thread runs
// merged batches through Engine::Run and answers every request of the batch:
// Attend finishes its unary reactor, AttendStream hands the answer to its
// stream's reactor (stream_reactor.h), which writes answers in request order
// and keeps going after a bad request.
//
// Shutdown: StopAccepting() refuses new calls and requests (UNAVAILABLE);
// WaitForIdle() waits for the calls accepted before it to be done, answers
// and all; Drain() answers every queued request; the destructor drains too.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "attention.grpc.pb.h"
#include "core/engine.h"
#include "core/request.h"
#include "grpcpp/grpcpp.h"
#include "server/batcher.h"
#include "server/metrics.h"
#include "server/repository_registry.h"
#include "server/request_names.h"
#include "server/test_gate.h"

namespace attention::server {

// Defaults are the binary's: each is defined once, in the struct it belongs
// to (Limits, BatcherOptions).
struct ServiceOptions {
  // Per-request size caps, checked by validation.
  Limits limits;
  // Batching, per model.
  BatcherOptions batching;
  // Most bytes of request messages the server holds at once, from admission
  // to answer, over all models; beyond it RESOURCE_EXHAUSTED. 0: no cap.
  // 2^30 is the documented default of --max-queued-bytes (docs/api.md).
  int64_t max_queued_bytes = int64_t{1} << 30;
  // Mutual TLS: client certificate names (SAN or CN) allowed to call;
  // empty: any certificate the CA signed.
  std::vector<std::string> allowed_client_identities;
  // Accepted bearer tokens; empty: no authentication. Never logged.
  // ReplaceAuthTokens() swaps them while serving.
  std::vector<std::string> auth_tokens;
  // For tests only: holds each batch of the model named kTestGateModelName
  // (test_gate.h). Not owned; must outlive the service. nullptr: no gate.
  TestGate* test_gate = nullptr;
};

class AttentionService final : public v1::AttentionService::CallbackService {
 public:
  // Failed requests beyond this many a second are not logged one by one; the
  // next line logged says how many were left out (docs/api.md, section 6.2).
  static constexpr int kRefusalLinesPerSecond = 20;

  // Serves the models of `registry`, which may change while serving.
  // `registry`, `engine` and `metrics` are not owned and must outlive the
  // service. INVALID_ARGUMENT for out-of-range batching options.
  static absl::StatusOr<std::unique_ptr<AttentionService>> Create(
      const ModelRegistry* registry, Engine* engine, ServerMetrics* metrics,
      ServiceOptions options);
  ~AttentionService() override;

  grpc::ServerUnaryReactor* Attend(grpc::CallbackServerContext* context,
                                   const v1::AttendRequest* request,
                                   v1::AttendResponse* response) override;
  grpc::ServerBidiReactor<v1::AttendRequest, v1::AttendResponse>* AttendStream(
      grpc::CallbackServerContext* context) override;
  grpc::ServerUnaryReactor* ListModels(grpc::CallbackServerContext* context,
                                       const v1::ListModelsRequest* request,
                                       v1::ListModelsResponse* response) override;

  // Receives a request's answer exactly once; `result` is set iff status is OK
  // and valid only during the call.
  using Done = std::function<void(const absl::Status& status, const AttentionResult* result)>;

  // One request of another API served on this port (inference_service.h).
  struct Incoming {
    std::string_view api;  // the `api` label of its metrics and log lines
    std::string_view model;
    // The version asked for (nullopt: the newest ready one), or why the
    // API's version text is not one; checked once the model is found.
    absl::StatusOr<std::optional<int64_t>> version = std::optional<int64_t>();
    std::string_view request_id;
    // The request (viewing storage the caller keeps until `done` runs), or
    // why the API's own decoding refused it; checked once the model is
    // found, so a request gets the code Attend would give it.
    absl::StatusOr<AttentionRequest> request;
    // Its size on the wire, counted against --max-queued-bytes.
    int64_t message_bytes = 0;
    // Where the version that computed the answer is written before `done`
    // runs with OK; not owned, alive until then. nullptr: not wanted.
    int64_t* served_version = nullptr;
  };
  // The entry point of other APIs: answers `incoming` through `done` as
  // Attend answers its request, with the same credentials (unless
  // `credentials_checked`, as for a stream checked when it opened), admission,
  // limits, batching, metrics and logs. The strings `incoming` views must stay
  // alive until `done` runs.
  void SubmitIncoming(grpc::CallbackServerContext* context, Incoming incoming,
                      bool credentials_checked, Done done);
  // A call counts as open from AdmitCall() (false once StopAccepting() ran:
  // the call is not admitted) until its reactor's OnDone calls CallDone(),
  // so drain waits for it.
  bool AdmitCall();
  void CallDone();
  // The credentials check of every call: CheckClientIdentity(), then
  // CheckBearerToken() against the tokens accepted now (auth.h).
  absl::Status Authenticate(const grpc::ServerContextBase& context) const;
  // False once StopAccepting() ran.
  bool accepting() const { return accepting_.load(); }
  // The bearer tokens accepted now.
  std::shared_ptr<const std::vector<std::string>> auth_tokens() const;
  // Calls authenticated from now on need one of `tokens` (a reloaded
  // --auth-token-file; non-empty when the service started with tokens).
  void ReplaceAuthTokens(std::vector<std::string> tokens);

  // Every call and every request from now on is refused with UNAVAILABLE.
  void StopAccepting();
  // Waits until every call accepted before StopAccepting() is done (gRPC has
  // sent its last answer and its status), or until `deadline`; false on the
  // deadline.
  bool WaitForIdle(absl::Time deadline);
  // Answers every queued request, then stops the batchers. Idempotent.
  void Drain();

  // Implementation details follow.

 private:
  struct Task;
  struct ModelQueue;
  class UnaryReactor;
  class StreamReactor;

  AttentionService(const ModelRegistry* registry, Engine* engine, ServerMetrics* metrics,
                   ServiceOptions options);

  // Answers `request`, of a call whose credentials were checked, through
  // `done`: now (when it is refused) or from the model's batcher thread.
  // `request` (and `served_version`, see Incoming) must stay alive until
  // `done` runs.
  void Submit(grpc::CallbackServerContext* context, const v1::AttendRequest& request, Done done,
              int64_t* served_version = nullptr);
  // The batcher of the model `name`, started on first use; an error only
  // for out-of-range batching options.
  absl::StatusOr<ModelQueue*> QueueFor(std::string_view name);
  // A request, counted in flight until Answer().
  std::unique_ptr<Task> NewTask(grpc::CallbackServerContext* context, Incoming incoming,
                                Done done);
  // Answers `task` now when it cannot be computed, or queues it in its
  // model's batcher.
  void Enqueue(std::unique_ptr<Task> task);
  void ProcessBatch(ModelQueue& queue, std::vector<std::unique_ptr<Task>> batch);
  // Computes `tasks`, all of one model version, in one Engine::Run.
  void RunBatch(ModelQueue& queue, std::vector<std::unique_ptr<Task>> tasks);
  void DropTask(ModelQueue& queue, std::unique_ptr<Task> task, const absl::Status& why);
  // Counts, logs and answers `task`.
  void Answer(Task& task, const absl::Status& status, const AttentionResult* result);

  const ModelRegistry* const registry_;  // not owned
  Engine* const engine_;                     // not owned
  ServerMetrics* const metrics_;             // not owned
  const ServiceOptions options_;
  mutable absl::Mutex tokens_mu_;
  std::shared_ptr<const std::vector<std::string>> auth_tokens_ ABSL_GUARDED_BY(tokens_mu_);
  std::atomic<bool> accepting_{true};  // written under calls_mu_
  // Bytes of the requests admitted and not yet answered (max_queued_bytes).
  std::atomic<int64_t> held_bytes_{0};
  absl::Mutex calls_mu_;
  int64_t open_calls_ ABSL_GUARDED_BY(calls_mu_) = 0;  // admitted, OnDone not yet run
  // "request failed" lines: at most kRefusalLinesPerSecond a second.
  RefusalLogLimiter refusal_log_{kRefusalLinesPerSecond};
  // One per model name ever requested. A removed model's batcher stays (idle,
  // its thread asleep): a request may hold its pointer between lookup and
  // Schedule(), and names are bounded by the repository's files.
  absl::Mutex queues_mu_;
  absl::flat_hash_map<std::string, std::unique_ptr<ModelQueue>> queues_
      ABSL_GUARDED_BY(queues_mu_);
};

}  // namespace attention::server
