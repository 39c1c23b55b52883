// dispatcher.h: the one request pipeline every API of the server feeds.
//
// An API turns its wire message into a Dispatcher::Request and calls
// Submit(); the dispatcher does the rest, the same way for all of them:
// credentials (access_policy.h; a stream's once, when it opens), admission
// (refused while draining), the model and version in the live registry (the
// request holds that version's weights until it is answered, whatever
// reloads meanwhile), validation (core's Validate(), which names the faulty
// field), --max-queued-bytes, and the model's Batcher. Anything wrong is
// answered inside Submit(), before any work is queued. There is one batcher
// per model name, created when the name is first requested; it keeps the
// versions of a batch apart (one Engine::Run per version), so a reload never
// fails or mixes queued requests. Requests of every API merge into the same
// batches. Each answer is counted, timed and logged in one place (Answer),
// then handed to the request's completion; a computed batch's answers go out
// on the answer threads (answer_pool.h) while its batcher forms the next.
// A batch of one is answered by its batcher thread when the answer threads
// are idle (nothing to overlap it with; AnswerPool::RunOrPost). A plain
// request of at most DispatchOptions::inline_work units that finds its
// batcher idle is computed and answered on the thread that submitted it, in
// the batcher's turn (Batcher::TakeIdleTurn): it would have been a batch of
// one at once, and handing it to the batcher's thread and its answer back
// costs more than its compute.
//
// A session's step (core/sessions/session.h; SubmitStep) takes the same way into its
// model's batcher, where the steps of a batch run as one Engine::RunSteps
// beside its plain requests' Engine::Run. A step of more work than
// DispatchOptions::chunk_work (a prompt's prefill) is computed in pieces, one
// per batch: its batcher carries it into the next batch, first, beside the
// steps and requests queued meanwhile, so they take turns with it rather
// than wait for its whole compute; it is answered once, with every piece's
// rows, after its last.
//
// Shutdown: BeginDrain() turns readiness false while calls are still
// served (load balancers see it before anything is refused);
// StopAccepting() refuses new calls and requests (UNAVAILABLE);
// WaitForIdle() waits for the calls opened before it to be done, answers and
// all; Drain() answers every queued request, its answer sent; the destructor
// drains too.
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
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "core/engine/engine.h"
#include "core/engine/request.h"
#include "core/sessions/session.h"
#include "server/dispatch/answer_pool.h"
#include "server/dispatch/batcher.h"
#include "server/dispatch/call_origin.h"
#include "server/dispatch/dispatch_options.h"
#include "server/observability/metrics.h"
#include "server/observability/refusal_log.h"
#include "server/repository/registry.h"
#include "server/security/access_policy.h"

namespace attention::server {

class Dispatcher {
 public:
  // Failed requests beyond this many a second are not logged one by one; the
  // next line logged says how many were left out (docs/api.md, section 6.2).
  static constexpr int kRefusalLinesPerSecond = 20;

  // One request, as an API hands it over.
  struct Request {
    std::string_view api;  // the `api` label of its metrics and log lines
    std::string_view model;
    // The version asked for (nullopt: the newest ready one), or why the
    // API's version text is not one; checked once the model is found.
    absl::StatusOr<std::optional<int64_t>> version = std::optional<int64_t>();
    std::string_view request_id;
    // Its size on the wire, counted against --max-queued-bytes.
    int64_t message_bytes = 0;
    // Where the version that computed the answer is written before `done`
    // runs with OK; not owned, alive until then. nullptr: not wanted.
    int64_t* served_version = nullptr;
    // Whether the call's credentials were already checked (a stream's, when
    // it opened).
    bool credentials_checked = false;
    // Why the API could not read the message at all (its bytes do not
    // parse); answered before anything else about the request is checked.
    absl::Status readable;
    // A step of a session opened on a call still open (a stream): admitted
    // while draining too, until the grace period ends the sessions.
    bool continues_session = false;
    // A later step of a sequence sent as a unary call (ModelInfer, REST
    // infer): admitted while draining until StopSequenceSteps() (the open
    // sequences ended, or the grace period did).
    bool continues_sequence = false;
  };
  // The request's engine form, viewing storage the API keeps until `done`
  // runs, or why the API's own decoding refused it. Called at most once,
  // inside Submit(), only for a request admitted so far (credentials
  // accepted, server accepting, names in bounds, model found), so refused
  // calls are never decoded; a decoding fault is answered once the model is
  // found, so a request gets the same code through every API.
  using Decode = absl::FunctionRef<absl::StatusOr<AttentionRequest>()>;
  // A session's step, as the API's DecodeStep gives it: the session (busy
  // for this step until `done` runs), the version it is pinned to, and the
  // step, which views storage the API keeps until `done` runs.
  struct Step {
    Session* session = nullptr;
    ServedModel served;
    SessionStep step;
  };
  // Called at most once, inside SubmitStep(), once the step is admitted
  // (credentials, server state, names): `resolved` is the model and version
  // the Request names, or why there is none, for a step that opens its
  // session; a step of an open session keeps the session's version.
  using DecodeStep =
      absl::FunctionRef<absl::StatusOr<Step>(const absl::StatusOr<ServedModel>& resolved)>;
  // Opens a session on the model and version the Request names, once the
  // opening is admitted (credentials, server state, names, model found);
  // the session holds `served` from then on.
  using OpenSession = absl::FunctionRef<absl::Status(const ServedModel& served)>;
  // Receives a request's answer exactly once; `result` is set iff status is
  // OK and valid only during the call.
  using Done = std::function<void(const absl::Status& status, const AttentionResult* result)>;

  // Serves the models of `registry`, which may change while serving.
  // `registry`, `engine` and `metrics` are not owned and must outlive the
  // dispatcher. INVALID_ARGUMENT for out-of-range batching options.
  static absl::StatusOr<std::unique_ptr<Dispatcher>> Create(const ModelRegistry* registry,
                                                            Engine* engine, ServerMetrics* metrics,
                                                            DispatchOptions options);
  ~Dispatcher();

  // Answers `request` through `done`: now (when it is refused), from an
  // answer thread or its batcher's thread once computed, or from the
  // model's batcher thread when it is dropped from the queue. `origin`, the strings `request` views and what
  // `decode` returns must stay alive until `done` runs.
  void Submit(const CallOrigin& origin, Request request, Decode decode, Done done);

  // As Submit(), for a session's step: validated by core's ValidateStep()
  // and computed in its model's batches by Engine::RunSteps().
  void SubmitStep(const CallOrigin& origin, Request request, DecodeStep decode, Done done);

  // As Submit(), for a session's opening (attention.v1's `open`), which the
  // engine computes on the calling thread (cross memory is projected once,
  // within the request limits) and answers with no result: counted, timed
  // and logged as any request of its model.
  void SubmitOpening(const CallOrigin& origin, Request request, OpenSession open, Done done);

  // Runs `work` on the batcher thread of the model `name` (started now if
  // no call named it yet) and returns once it ran: the start-up warm-up, so
  // that what it grows is what the model's first calls use (batcher.h,
  // RunOnThread). UNAVAILABLE once draining.
  absl::Status RunOnBatcherThread(std::string_view name, absl::FunctionRef<void()> work);

  // A call counts as open from OpenCall() (an error once StopAccepting() and
  // StopSequenceSteps() ran: UNAVAILABLE, "takes no new `what`") until
  // CloseCall(), which its API calls when the transport is done with it;
  // drain waits for open calls. Between the two, a unary call is still
  // counted open, and its admission refuses it unless it continues a
  // sequence (Request::continues_sequence).
  absl::Status OpenCall(std::string_view what);
  void CloseCall();
  // A stream's opening: its credentials, then OpenCall(). A refused stream is
  // counted (attention_streams_refused_total, by `api`), and a credentials
  // refusal logged under `method`.
  absl::Status OpenStream(const CallOrigin& origin, std::string_view api, std::string_view method);

  // The credentials every call is checked against; ReplaceTokens() reloads.
  AccessPolicy& access() { return access_; }
  const AccessPolicy& access() const { return access_; }
  // False once StopAccepting() ran.
  bool accepting() const { return accepting_.load(); }
  // What readiness checks answer (ServerReady, REST /v2/health/ready):
  // past the start-up warm-up, which RunServer marks, and not draining.
  bool ready() const { return warmed_up_.load() && !draining_.load() && accepting(); }
  void SetWarmedUp(bool warmed_up) { warmed_up_.store(warmed_up); }
  // Readiness is false from now on; calls are still accepted until
  // StopAccepting().
  void BeginDrain() { draining_.store(true); }

  // Every call and every request from now on is refused with UNAVAILABLE,
  // but the later steps of sequences sent as unary calls, until
  // StopSequenceSteps() (a stream opened from now on is refused).
  void StopAccepting();
  // Those steps are refused too.
  void StopSequenceSteps();
  // Waits until every call opened before StopAccepting() is closed (its
  // transport has sent the last answer and the status), or until
  // `deadline`; false on the deadline.
  bool WaitForIdle(absl::Time deadline);
  // Answers every queued request, then stops the batchers and the answer
  // threads. Idempotent.
  void Drain();

 private:
  struct Task;
  struct ModelQueue;

  Dispatcher(const ModelRegistry* registry, Engine* engine, ServerMetrics* metrics,
             DispatchOptions options);

  // OpenCall() for a unary call or a stream.
  absl::Status OpenCallOf(std::string_view what, bool stream);
  // The batcher of the model `name`, started on first use; an error only
  // for out-of-range batching options.
  absl::StatusOr<ModelQueue*> QueueFor(std::string_view name);
  // A new task of `request`, admitted by its credentials and `admit`; or,
  // answered with why not, nullptr.
  std::unique_ptr<Task> AdmitTask(const CallOrigin& origin, Request request, Done done,
                                  absl::FunctionRef<absl::Status(Task&)> admit);
  // A request, counted in flight until Answer().
  std::unique_ptr<Task> NewTask(const CallOrigin& origin, Request request, Done done);
  // OK when the call's credentials are accepted or were checked before.
  absl::Status Authenticate(const CallOrigin& origin, bool credentials_checked) const;
  // The first reason `task` cannot be queued: the server's state, its names,
  // its model and version, its decoding and validation.
  absl::Status Admit(Task& task, Decode decode);
  // Admit()'s checks up to the model and version, which `task` then holds.
  absl::Status AdmitModel(Task& task);
  // The same for a step.
  absl::Status AdmitStep(Task& task, DecodeStep decode);
  // The checks before the model: the server's state, readability, names.
  absl::Status AdmitCall(const Task& task) const;
  // Queues an admitted task in its model's batcher, or computes it now in
  // the batcher's turn (ComputesHere), or answers it now when
  // --max-queued-bytes or the queue refuse it.
  void Schedule(std::unique_ptr<Task> task);
  // Whether `task` is a plain request within inline_work.
  bool WithinInlineWork(const Task& task) const;
  // WithinInlineWork, on a model without the test gate (which holds
  // batches, and would hold the caller).
  bool ComputesHere(const Task& task) const;
  // Computes and answers `task` on this thread, the batcher's turn held.
  void ComputeInTurn(ModelQueue& queue, std::unique_ptr<Task> task);
  // Counts `task`'s bytes against --max-queued-bytes; RESOURCE_EXHAUSTED
  // beyond it.
  absl::Status HoldBytes(Task& task);
  // Both return the tasks not finished (steps with pieces still to compute),
  // which the batcher carries into its next batch.
  std::vector<std::unique_ptr<Task>> ProcessBatch(ModelQueue& queue,
                                                  std::vector<std::unique_ptr<Task>> batch);
  // Where RunBatch answers: the answer threads, or (a batch of one while
  // they are idle) the thread that computed it; or always that thread.
  enum class AnswerOn { kAnswerThreads, kThisThread };
  // Computes `tasks`, all of one model version, in one Engine::Run (the
  // requests) and one Engine::RunSteps (the steps, or their next pieces),
  // and answers every task finished.
  std::vector<std::unique_ptr<Task>> RunBatch(ModelQueue& queue,
                                              std::vector<std::unique_ptr<Task>> tasks,
                                              AnswerOn answer_on);
  // The engine's part of RunBatch: `results` answers `batch`, whose first
  // `num_requests` tasks are requests and the rest steps.
  void Compute(const Model& model, std::span<const std::unique_ptr<Task>> batch,
               size_t num_requests, std::span<AttentionResult> results);
  // Moves the steps of `batch` (from index `num_requests` on) with pieces
  // still to compute out of `batch` and `results`, each keeping its result
  // so far, and returns them, with the steps that wait for blocks
  // (WaitsForBlocks). With `status` not OK (the engine failed) the steps are
  // answered with it instead, their sessions as before the step.
  std::vector<std::unique_ptr<Task>> TakeUnfinished(const absl::Status& status,
                                                    std::vector<std::unique_ptr<Task>>& batch,
                                                    size_t num_requests,
                                                    std::vector<AttentionResult>& results);
  // Whether a step whose first piece got `result` waits for a later batch:
  // the pool was full, steps_wait_for_blocks is set, and neither its
  // deadline, its call nor kLongestBlockWait has run out (the first two
  // then become `result`'s status).
  bool WaitsForBlocks(Task& task, AttentionResult& result) const;
  // Work units of a session step's next piece: chunk_work, within the
  // request work limit; 0: the whole step.
  double ChunkWork() const;
  // Answers the tasks of a computed batch (on an answer thread): `status`
  // when it is not OK, each task's result otherwise.
  void AnswerBatch(std::vector<std::unique_ptr<Task>> batch, const absl::Status& status,
                   std::vector<AttentionResult> results);
  void DropTask(ModelQueue& queue, std::unique_ptr<Task> task, const absl::Status& why);
  // Counts, logs and answers `task`.
  void Answer(Task& task, const absl::Status& status, const AttentionResult* result);
  // Its metrics and log line.
  void Record(const Task& task, const absl::Status& status);

  const ModelRegistry* const registry_;  // not owned
  Engine* const engine_;                 // not owned
  ServerMetrics* const metrics_;         // not owned
  const DispatchOptions options_;
  AccessPolicy access_;
  std::atomic<bool> accepting_{true};  // written under calls_mu_
  std::atomic<bool> sequence_steps_{true};  // written under calls_mu_
  std::atomic<bool> warmed_up_{true};
  std::atomic<bool> draining_{false};
  // Bytes of the requests admitted and not yet answered (max_queued_bytes).
  std::atomic<int64_t> held_bytes_{0};
  absl::Mutex calls_mu_;
  int64_t open_calls_ ABSL_GUARDED_BY(calls_mu_) = 0;  // opened, not yet closed
  // "request failed" lines: at most kRefusalLinesPerSecond a second.
  RefusalLogLimiter refusal_log_{kRefusalLinesPerSecond};
  // Declared before queues_: a batcher drained by its destructor still
  // answers through it.
  AnswerPool answers_;
  // One per model name ever requested. A removed model's batcher stays (idle,
  // its thread asleep): a request may hold its pointer between lookup and
  // Schedule(), and names are bounded by the repository's files.
  absl::Mutex queues_mu_;
  absl::flat_hash_map<std::string, std::unique_ptr<ModelQueue>> queues_ ABSL_GUARDED_BY(queues_mu_);
};

}  // namespace attention::server
