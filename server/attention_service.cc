// attention_service.cc: the unary handlers, the path of a request from
// Submit() to its answer, and the per-model batch callback.
#include "server/attention_service.h"

#include <chrono>
#include <exception>
#include <optional>
#include <string_view>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "server/auth.h"
#include "server/batcher.h"
#include "server/proto_adapter.h"
#include "server/repository_views.h"
#include "server/stream_reactor.h"
#include "spdlog/spdlog.h"

namespace attention::server {
namespace {

absl::Time ToAbslTime(std::chrono::system_clock::time_point t) {
  if (t == std::chrono::system_clock::time_point::max()) return absl::InfiniteFuture();
  return absl::FromChrono(t);
}

int64_t Micros(absl::Duration d) { return absl::ToInt64Microseconds(d); }

// A client ends its call at its own deadline, which comes before the
// server's by the time the call took to arrive (the server's is its arrival
// plus the grpc-timeout the client sent). A cancel this close to the
// server's deadline is the deadline's, and is reported as DEADLINE_EXCEEDED.
constexpr absl::Duration kDeadlineSkew = absl::Milliseconds(100);

// The `api` label of attention.v1 requests.
constexpr std::string_view kAttentionApi = "attention";

AttentionService::Incoming FromAttend(const v1::AttendRequest& request,
                                      int64_t* served_version) {
  return AttentionService::Incoming{
      .api = kAttentionApi,
      .model = request.model(),
      .version = request.has_version() ? std::optional<int64_t>(request.version()) : std::nullopt,
      .request_id = request.request_id(),
      .request = ToAttentionRequest(request),
      .message_bytes = static_cast<int64_t>(request.ByteSizeLong()),
      .served_version = served_version};
}

}  // namespace

// One request on its way through a model's batcher.
struct AttentionService::Task {
  absl::Time deadline() const { return deadline_at; }
  bool cancelled() const { return context->IsCancelled(); }
  // Polled by the engine while the request computes (docs/api.md, section 3).
  absl::Status StopReason() const {
    if (absl::Now() >= deadline_at) {
      return absl::DeadlineExceededError("the deadline passed while the request was computed");
    }
    if (cancelled()) return WhyCancelled("computed");
    return absl::OkStatus();
  }
  // Why a cancelled call ended while its request was `stage` ("queued",
  // "computed"): its client's deadline when the cancel came within
  // kDeadlineSkew of the server's, the client's cancel otherwise.
  absl::Status WhyCancelled(const char* stage) const {
    if (deadline_at - absl::Now() <= kDeadlineSkew) {
      return absl::DeadlineExceededError(absl::StrCat(
          "the deadline passed while the request was ", stage,
          " (the client's deadline, just ahead of the server's)"));
    }
    return absl::CancelledError(
        absl::StrCat("the call was cancelled while its request was ", stage));
  }

  grpc::CallbackServerContext* context = nullptr;  // owned by gRPC; alive until done runs
  std::string_view api;                            // these three: owned by the caller
  std::string_view model_name;                     // of Submit, alive until done runs
  std::string_view request_id;
  absl::StatusOr<std::optional<int64_t>> version;  // asked for; nullopt: newest
  absl::Status refused_by_api;                     // the API's decoding failed
  AttentionRequest request;                        // views the caller's storage
  ValidatedRequest validated;                      // points at `request`
  ModelQueue* queue = nullptr;                     // null: names no served model
  ServedModel served;                              // the version that computes it
  int64_t* served_version = nullptr;               // see Incoming
  absl::Time arrived;
  absl::Time enqueued;
  absl::Time deadline_at = absl::InfiniteFuture();
  std::optional<absl::Duration> queued;    // set once the task left the queue
  std::optional<absl::Duration> computed;  // set once the task was computed
  int64_t message_bytes = 0;               // the request's size on the wire
  int64_t held_bytes = 0;                  // counted in held_bytes_ until answered
  Done done;
};

struct AttentionService::ModelQueue {
  std::string name;
  ModelMetrics* metrics;  // owned by ServerMetrics
  TestGate* gate;         // not owned; nullptr for every model but the test gate's
  std::unique_ptr<Batcher<Task>> batcher;
};

absl::StatusOr<std::unique_ptr<AttentionService>> AttentionService::Create(
    const ModelRegistry* registry, Engine* engine, ServerMetrics* metrics,
    ServiceOptions options) {
  std::unique_ptr<AttentionService> service(
      new AttentionService(registry, engine, metrics, std::move(options)));
  // Bad batching options fail here, at start-up, rather than on a first request.
  for (const auto& [name, entry] : *registry->snapshot()) {
    if (absl::StatusOr<ModelQueue*> queue = service->QueueFor(name); !queue.ok()) {
      return queue.status();
    }
  }
  return service;
}

absl::StatusOr<AttentionService::ModelQueue*> AttentionService::QueueFor(std::string_view name) {
  const absl::string_view key(name.data(), name.size());
  {
    absl::ReaderMutexLock lock(&queues_mu_);
    if (auto it = queues_.find(key); it != queues_.end()) return it->second.get();
  }
  absl::MutexLock lock(&queues_mu_);
  if (auto it = queues_.find(key); it != queues_.end()) return it->second.get();
  auto queue = std::make_unique<ModelQueue>();
  queue->name = std::string(name);
  queue->metrics = metrics_->AddModel(name);
  queue->gate = name == kTestGateModelName ? options_.test_gate : nullptr;
  ModelQueue* q = queue.get();
  absl::StatusOr<std::unique_ptr<Batcher<Task>>> batcher = Batcher<Task>::Create(
      options_.batching,
      [this, q](std::vector<std::unique_ptr<Task>> batch) { ProcessBatch(*q, std::move(batch)); },
      [this, q](std::unique_ptr<Task> task, absl::Status why) {
        DropTask(*q, std::move(task), why);
      });
  if (!batcher.ok()) return batcher.status();
  queue->batcher = *std::move(batcher);
  queues_.emplace(queue->name, std::move(queue));
  return q;
}

AttentionService::AttentionService(const ModelRegistry* registry, Engine* engine,
                                   ServerMetrics* metrics, ServiceOptions options)
    : registry_(registry),
      engine_(engine),
      metrics_(metrics),
      options_(std::move(options)),
      auth_tokens_(std::make_shared<const std::vector<std::string>>(options_.auth_tokens)) {}

void AttentionService::ReplaceAuthTokens(std::vector<std::string> tokens) {
  auto replacement = std::make_shared<const std::vector<std::string>>(std::move(tokens));
  absl::MutexLock lock(&tokens_mu_);
  auth_tokens_ = std::move(replacement);
}

std::shared_ptr<const std::vector<std::string>> AttentionService::auth_tokens() const {
  absl::MutexLock lock(&tokens_mu_);
  return auth_tokens_;
}

absl::Status AttentionService::Authenticate(const grpc::ServerContextBase& context) const {
  if (absl::Status identity = CheckClientIdentity(context, options_.allowed_client_identities);
      !identity.ok()) {
    return identity;
  }
  return CheckBearerToken(context, *auth_tokens());
}

AttentionService::~AttentionService() { Drain(); }

void AttentionService::StopAccepting() {
  absl::MutexLock lock(&calls_mu_);
  accepting_.store(false);
}

bool AttentionService::WaitForIdle(absl::Time deadline) {
  absl::MutexLock lock(&calls_mu_);
  auto idle = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(calls_mu_) { return open_calls_ == 0; };
  return calls_mu_.AwaitWithDeadline(absl::Condition(&idle), deadline);
}

bool AttentionService::AdmitCall() {
  absl::MutexLock lock(&calls_mu_);
  if (!accepting_.load()) return false;
  ++open_calls_;
  return true;
}

void AttentionService::CallDone() {
  absl::MutexLock lock(&calls_mu_);
  --open_calls_;
}

void AttentionService::Drain() {
  StopAccepting();
  // Drained outside the lock: a batcher thread finishing its batch may be
  // inside Enqueue() (a stream's next request), about to create a queue.
  // Queues live as long as the service; one created after this copy drains
  // in its destructor.
  std::vector<ModelQueue*> queues;
  {
    absl::ReaderMutexLock lock(&queues_mu_);
    for (auto& [name, queue] : queues_) queues.push_back(queue.get());
  }
  for (ModelQueue* queue : queues) queue->batcher->Drain();
}

void AttentionService::Submit(grpc::CallbackServerContext* context,
                              const v1::AttendRequest& request, Done done,
                              int64_t* served_version) {
  Enqueue(NewTask(context, FromAttend(request, served_version), std::move(done)));
}

void AttentionService::SubmitIncoming(grpc::CallbackServerContext* context, Incoming incoming,
                                      bool credentials_checked, Done done) {
  std::unique_ptr<Task> task = NewTask(context, std::move(incoming), std::move(done));
  if (!credentials_checked) {
    if (absl::Status auth = Authenticate(*context); !auth.ok()) return Answer(*task, auth, nullptr);
  }
  Enqueue(std::move(task));
}

std::unique_ptr<AttentionService::Task> AttentionService::NewTask(
    grpc::CallbackServerContext* context, Incoming incoming, Done done) {
  auto task = std::make_unique<Task>();
  task->arrived = absl::Now();
  task->context = context;
  task->api = incoming.api;
  task->model_name = incoming.model;
  task->request_id = incoming.request_id;
  task->version = std::move(incoming.version);
  task->served_version = incoming.served_version;
  task->message_bytes = incoming.message_bytes;
  if (incoming.request.ok()) {
    task->request = *std::move(incoming.request);
  } else {
    task->refused_by_api = incoming.request.status();
  }
  task->deadline_at = ToAbslTime(context->deadline());
  task->done = std::move(done);
  metrics_->inflight().Increment();
  return task;
}

void AttentionService::Enqueue(std::unique_ptr<Task> task) {
  if (!accepting_.load()) {
    return Answer(*task,
                  absl::UnavailableError("the server is shutting down and takes no new requests"),
                  nullptr);
  }
  for (const auto& [field, value] :
       {std::pair<std::string_view, std::string_view>{"model", task->model_name},
        {"request_id", task->request_id}}) {
    if (absl::Status s = CheckNameLength(field, value); !s.ok()) return Answer(*task, s, nullptr);
  }
  // The name first, so that a bad version of an unknown model is NOT_FOUND
  // for its name.
  absl::StatusOr<ServedModel> served = registry_->Resolve(task->model_name, std::nullopt);
  if (!served.ok()) return Answer(*task, served.status(), nullptr);
  absl::StatusOr<ModelQueue*> queue_found = QueueFor(task->model_name);
  if (!queue_found.ok()) return Answer(*task, queue_found.status(), nullptr);
  task->queue = *queue_found;
  if (!task->version.ok()) return Answer(*task, task->version.status(), nullptr);
  if (task->version->has_value()) served = registry_->Resolve(task->model_name, *task->version);
  if (!served.ok()) return Answer(*task, served.status(), nullptr);
  task->served = *std::move(served);
  if (!task->refused_by_api.ok()) return Answer(*task, task->refused_by_api, nullptr);
  absl::StatusOr<AttentionDims> dims =
      Validate(*task->served.model, task->request, options_.limits);
  if (!dims.ok()) return Answer(*task, dims.status(), nullptr);
  task->validated = ValidatedRequest{&task->request, *dims};

  if (options_.max_queued_bytes > 0) {
    const int64_t bytes = task->message_bytes;
    const int64_t held = held_bytes_.fetch_add(bytes) + bytes;
    task->held_bytes = bytes;
    if (held > options_.max_queued_bytes) {
      return Answer(*task,
                    absl::ResourceExhaustedError(absl::StrCat(
                        "the server holds ", held - bytes, " bytes of requests; this one (", bytes,
                        " bytes) would pass --max-queued-bytes ", options_.max_queued_bytes,
                        "; retry later")),
                    nullptr);
    }
  }
  ModelQueue& queue = *task->queue;
  task->enqueued = absl::Now();
  queue.metrics->queue_depth->Increment();
  if (absl::Status scheduled = queue.batcher->Schedule(&task); !scheduled.ok()) {
    queue.metrics->queue_depth->Decrement();
    Answer(*task, scheduled, nullptr);
  }
}

void AttentionService::ProcessBatch(ModelQueue& queue, std::vector<std::unique_ptr<Task>> batch) {
  // Versions of one model share a queue but never an execution: each run of
  // tasks on the same weights (in arrival order) is computed on its own.
  while (!batch.empty()) {
    const Model* model = batch.front()->served.model.get();
    std::vector<std::unique_ptr<Task>> same, rest;
    for (auto& task : batch) {
      (task->served.model.get() == model ? same : rest).push_back(std::move(task));
    }
    RunBatch(queue, std::move(same));
    batch = std::move(rest);
  }
}

void AttentionService::RunBatch(ModelQueue& queue, std::vector<std::unique_ptr<Task>> batch) {
  const absl::Time start = absl::Now();
  std::vector<ValidatedRequest> requests;
  requests.reserve(batch.size());
  for (auto& task : batch) {
    queue.metrics->queue_depth->Decrement();
    task->queued = start - task->enqueued;
    requests.push_back(task->validated);
    requests.back().stop = [&t = *task] { return t.StopReason(); };
  }
  queue.metrics->batch_size->Observe(static_cast<double>(batch.size()));

  std::vector<AttentionResult> results(batch.size());
  absl::Status status;
  try {
    if (queue.gate != nullptr) queue.gate->Pass();
    engine_->Run(*batch.front()->served.model, requests, results);
  } catch (const std::exception& e) {
    status = absl::InternalError(absl::StrCat("the engine failed: ", e.what()));
  }
  const absl::Duration computed = absl::Now() - start;
  for (size_t i = 0; i < batch.size(); ++i) {
    batch[i]->computed = computed;
    const absl::Status& answer = status.ok() ? results[i].status : status;
    Answer(*batch[i], answer, answer.ok() ? &results[i] : nullptr);
  }
}

void AttentionService::DropTask(ModelQueue& queue, std::unique_ptr<Task> task,
                                const absl::Status& why) {
  queue.metrics->queue_depth->Decrement();
  task->queued = absl::Now() - task->enqueued;
  // The batcher cannot tell a client's deadline from its cancel; the task can.
  Answer(*task, why.code() == absl::StatusCode::kCancelled ? task->WhyCancelled("queued") : why,
         nullptr);
}

void AttentionService::Answer(Task& task, const absl::Status& status,
                              const AttentionResult* result) {
  // Before the count, so a scrape that sees the request counted also sees it
  // no longer in flight.
  metrics_->inflight().Decrement();
  held_bytes_.fetch_sub(task.held_bytes);
  const absl::Duration total = absl::Now() - task.arrived;
  const std::string_view model =
      task.queue != nullptr ? std::string_view(task.queue->name) : std::string_view();
  metrics_->CountRequest(model, status.code());
  metrics_->CountApiRequest(task.api, model, status.code());
  if (task.queue != nullptr) {
    ModelMetrics& m = *task.queue->metrics;
    m.totals->Count(status.ok(), total);
    m.request_duration->Observe(Seconds(total));
    if (task.queued) m.queue_duration->Observe(Seconds(*task.queued));
    if (task.computed) m.compute_duration->Observe(Seconds(*task.computed));
  }
  const int64_t queued_us = task.queued ? Micros(*task.queued) : 0;
  const int64_t computed_us = task.computed ? Micros(*task.computed) : 0;
  int64_t suppressed = 0;
  if (!status.ok() && refusal_log_.Admit(&suppressed)) {
    spdlog::warn("request failed: api={} model='{}' request_id='{}' peer={} code={} after {} us: {}{}",
                 task.api, Printable(task.model_name), Printable(task.request_id),
                 task.context->peer(), absl::StatusCodeToString(status.code()), Micros(total),
                 std::string(status.message()),
                 RefusalLogLimiter::SuppressedNote(suppressed, "failed requests"));
  } else if (status.ok() && spdlog::should_log(spdlog::level::debug)) {
    spdlog::debug("request done: api={} model='{}' request_id='{}' peer={} batch_wait={} us "
                  "compute={} us total={} us",
                  task.api, model, Printable(task.request_id), task.context->peer(), queued_us,
                  computed_us, Micros(total));
  }
  if (status.ok() && task.served_version != nullptr) *task.served_version = task.served.version;
  // The weights go with the answer: the last request on a replaced version
  // frees it.
  task.served = ServedModel{};
  task.done(status, result);
}

// Attend's reactor: the default one's behaviour, plus an OnDone, which is
// when gRPC has sent the answer and the status: shutdown waits for that.
class AttentionService::UnaryReactor final : public grpc::ServerUnaryReactor {
 public:
  UnaryReactor(AttentionService* service, bool admitted)
      : service_(service), admitted_(admitted) {}

  void OnDone() override {
    if (admitted_) service_->CallDone();
    delete this;
  }

  int64_t served_version = 0;

 private:
  AttentionService* const service_;
  const bool admitted_;
};

grpc::ServerUnaryReactor* AttentionService::Attend(grpc::CallbackServerContext* context,
                                                   const v1::AttendRequest* request,
                                                   v1::AttendResponse* response) {
  // Not admitted only while shutting down, and then Enqueue() refuses it.
  auto* reactor = new UnaryReactor(this, AdmitCall());
  std::unique_ptr<Task> task = NewTask(
      context, FromAttend(*request, &reactor->served_version),
      [reactor, request, response](const absl::Status& status, const AttentionResult* result) {
        if (status.ok()) {
          ToAttendResponse(*result, response);
          response->set_request_id(request->request_id());
          response->set_model(request->model());
          response->set_model_version(reactor->served_version);
        }
        reactor->Finish(ToGrpcStatus(status));
      });
  if (absl::Status auth = Authenticate(*context); !auth.ok()) {
    Answer(*task, auth, nullptr);
  } else {
    Enqueue(std::move(task));
  }
  return reactor;
}

grpc::ServerUnaryReactor* AttentionService::ListModels(grpc::CallbackServerContext* context,
                                                       const v1::ListModelsRequest* request,
                                                       v1::ListModelsResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  absl::Status status = Authenticate(*context);
  if (status.ok()) {
    ListRegistry(*registry_, request->include_unavailable(), response);
  } else {
    spdlog::warn("ListModels refused: peer={}: {}", context->peer(), std::string(status.message()));
  }
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

grpc::ServerBidiReactor<v1::AttendRequest, v1::AttendResponse>* AttentionService::AttendStream(
    grpc::CallbackServerContext* context) {
  return new StreamReactor(this, context);
}

}  // namespace attention::server
