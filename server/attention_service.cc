// attention_service.cc: RPC handlers, the per-model batch callback and the
// AttendStream reactor.
#include "server/attention_service.h"

#include <chrono>
#include <deque>
#include <exception>
#include <string_view>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "server/batcher.h"
#include "server/proto_adapter.h"
#include "spdlog/spdlog.h"

namespace attention::server {
namespace {

// Answers a stream holds at once (computing or waiting to be written); the
// stream stops reading beyond, so one stream cannot hoard server memory.
constexpr size_t kMaxStreamInFlight = 32;

constexpr std::string_view kBearerPrefix = "Bearer ";

absl::Time ToAbslTime(std::chrono::system_clock::time_point t) {
  if (t == std::chrono::system_clock::time_point::max()) return absl::InfiniteFuture();
  return absl::FromChrono(t);
}

// Compares without stopping at the first difference, so the time taken does
// not tell an attacker how much of a guessed token was right.
bool SameToken(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  unsigned char difference = 0;
  for (size_t i = 0; i < a.size(); ++i) difference |= static_cast<unsigned char>(a[i] ^ b[i]);
  return difference == 0;
}

int64_t Micros(absl::Duration d) { return absl::ToInt64Microseconds(d); }

}  // namespace

// One request on its way through a model's batcher.
struct AttentionService::Task {
  absl::Time deadline() const { return deadline_at; }
  bool cancelled() const { return context->IsCancelled(); }

  grpc::CallbackServerContext* context = nullptr;  // owned by gRPC; alive until done runs
  const v1::AttendRequest* proto = nullptr;        // owned by the caller of Submit
  AttentionRequest request;                        // views into *proto
  ValidatedRequest validated;                      // points at `request`
  ModelQueue* queue = nullptr;                     // null: names no served model
  absl::Time arrived;
  absl::Time enqueued;
  absl::Time deadline_at = absl::InfiniteFuture();
  std::optional<absl::Duration> queued;    // set once the task left the queue
  std::optional<absl::Duration> computed;  // set once the task was computed
  Done done;
};

struct AttentionService::ModelQueue {
  const Model* model;     // owned by the repository
  ModelMetrics* metrics;  // owned by ServerMetrics
  TestGate* gate;         // not owned; nullptr for every model but the test gate's
  std::unique_ptr<Batcher<Task>> batcher;
};

absl::StatusOr<std::unique_ptr<AttentionService>> AttentionService::Create(
    const ModelRepository* repository, Engine* engine, ServerMetrics* metrics,
    ServiceOptions options) {
  std::unique_ptr<AttentionService> service(
      new AttentionService(repository, engine, metrics, std::move(options)));
  const ServiceOptions& o = service->options_;
  for (const auto& model : repository->models()) {
    auto queue = std::make_unique<ModelQueue>();
    queue->model = model.get();
    queue->metrics = metrics->ForModel(model->name);
    queue->gate = model->name == kTestGateModelName ? o.test_gate : nullptr;
    if (queue->metrics == nullptr) {
      return absl::InternalError(absl::StrCat("no metrics for model ", model->name));
    }
    ModelQueue* q = queue.get();
    AttentionService* s = service.get();
    absl::StatusOr<std::unique_ptr<Batcher<Task>>> batcher = Batcher<Task>::Create(
        o.batching,
        [s, q](std::vector<std::unique_ptr<Task>> batch) { s->ProcessBatch(*q, std::move(batch)); },
        [s, q](std::unique_ptr<Task> task, absl::Status why) {
          s->DropTask(*q, std::move(task), why);
        });
    if (!batcher.ok()) return batcher.status();
    queue->batcher = *std::move(batcher);
    service->queues_.push_back(std::move(queue));
  }
  return service;
}

AttentionService::AttentionService(const ModelRepository* repository, Engine* engine,
                                   ServerMetrics* metrics, ServiceOptions options)
    : repository_(repository), engine_(engine), metrics_(metrics), options_(std::move(options)) {}

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
  for (auto& queue : queues_) queue->batcher->Drain();
}

absl::Status AttentionService::Authenticate(const grpc::CallbackServerContext& context) const {
  if (options_.auth_tokens.empty()) return absl::OkStatus();
  const auto [begin, end] = context.client_metadata().equal_range("authorization");
  for (auto it = begin; it != end; ++it) {
    const std::string_view value(it->second.data(), it->second.size());
    if (value.substr(0, kBearerPrefix.size()) != kBearerPrefix) continue;
    const std::string_view token = value.substr(kBearerPrefix.size());
    bool known = false;
    for (const std::string& accepted : options_.auth_tokens) known |= SameToken(token, accepted);
    if (known) return absl::OkStatus();
  }
  return absl::UnauthenticatedError(
      "missing or unknown credentials: send the metadata 'authorization: Bearer <token>' with a "
      "token the server accepts");
}

void AttentionService::Submit(grpc::CallbackServerContext* context,
                              const v1::AttendRequest& request, Done done) {
  auto task = std::make_unique<Task>();
  task->arrived = absl::Now();
  task->context = context;
  task->proto = &request;
  task->deadline_at = ToAbslTime(context->deadline());
  task->done = std::move(done);
  metrics_->inflight().Increment();

  if (absl::Status auth = Authenticate(*context); !auth.ok()) return Answer(*task, auth, nullptr);
  if (!accepting_.load()) {
    return Answer(*task,
                  absl::UnavailableError("the server is shutting down and takes no new requests"),
                  nullptr);
  }
  for (auto& queue : queues_) {
    if (queue->model->name == request.model()) task->queue = queue.get();
  }
  if (task->queue == nullptr) {
    return Answer(*task,
                  absl::NotFoundError(absl::StrCat("model: no model named '", request.model(),
                                                   "' is served (ListModels lists them)")),
                  nullptr);
  }
  task->request = ToAttentionRequest(request);
  absl::StatusOr<AttentionDims> dims =
      Validate(*task->queue->model, task->request, options_.limits);
  if (!dims.ok()) return Answer(*task, dims.status(), nullptr);
  task->validated = ValidatedRequest{&task->request, *dims};

  ModelQueue& queue = *task->queue;
  task->enqueued = absl::Now();
  queue.metrics->queue_depth->Increment();
  if (absl::Status scheduled = queue.batcher->Schedule(&task); !scheduled.ok()) {
    queue.metrics->queue_depth->Decrement();
    Answer(*task, scheduled, nullptr);
  }
}

void AttentionService::ProcessBatch(ModelQueue& queue, std::vector<std::unique_ptr<Task>> batch) {
  const absl::Time start = absl::Now();
  std::vector<ValidatedRequest> requests;
  requests.reserve(batch.size());
  for (auto& task : batch) {
    queue.metrics->queue_depth->Decrement();
    task->queued = start - task->enqueued;
    requests.push_back(task->validated);
  }
  queue.metrics->batch_size->Observe(static_cast<double>(batch.size()));

  std::vector<AttentionResult> results(batch.size());
  absl::Status status;
  try {
    if (queue.gate != nullptr) queue.gate->Pass();
    engine_->Run(*queue.model, requests, results);
  } catch (const std::exception& e) {
    status = absl::InternalError(absl::StrCat("the engine failed: ", e.what()));
  }
  const absl::Duration computed = absl::Now() - start;
  for (size_t i = 0; i < batch.size(); ++i) {
    batch[i]->computed = computed;
    Answer(*batch[i], status, status.ok() ? &results[i] : nullptr);
  }
}

void AttentionService::DropTask(ModelQueue& queue, std::unique_ptr<Task> task,
                                const absl::Status& why) {
  queue.metrics->queue_depth->Decrement();
  task->queued = absl::Now() - task->enqueued;
  Answer(*task, why, nullptr);
}

void AttentionService::Answer(Task& task, const absl::Status& status,
                              const AttentionResult* result) {
  // Before the count, so a scrape that sees the request counted also sees it
  // no longer in flight.
  metrics_->inflight().Decrement();
  const absl::Duration total = absl::Now() - task.arrived;
  const std::string_view model =
      task.queue != nullptr ? std::string_view(task.queue->model->name) : std::string_view();
  metrics_->CountRequest(model, status.code());
  if (task.queue != nullptr) {
    ModelMetrics& m = *task.queue->metrics;
    m.request_duration->Observe(Seconds(total));
    if (task.queued) m.queue_duration->Observe(Seconds(*task.queued));
    if (task.computed) m.compute_duration->Observe(Seconds(*task.computed));
  }
  const int64_t queued_us = task.queued ? Micros(*task.queued) : 0;
  const int64_t computed_us = task.computed ? Micros(*task.computed) : 0;
  if (!status.ok()) {
    spdlog::warn("request failed: model='{}' request_id='{}' peer={} code={} after {} us: {}",
                 task.proto->model(), task.proto->request_id(), task.context->peer(),
                 absl::StatusCodeToString(status.code()), Micros(total), std::string(status.message()));
  } else if (spdlog::should_log(spdlog::level::debug)) {
    spdlog::debug("request done: model='{}' request_id='{}' peer={} batch_wait={} us compute={} us "
                  "total={} us",
                  model, task.proto->request_id(), task.context->peer(), queued_us, computed_us,
                  Micros(total));
  }
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

 private:
  AttentionService* const service_;
  const bool admitted_;
};

grpc::ServerUnaryReactor* AttentionService::Attend(grpc::CallbackServerContext* context,
                                                   const v1::AttendRequest* request,
                                                   v1::AttendResponse* response) {
  // Not admitted only while shutting down, and then Submit() refuses it.
  grpc::ServerUnaryReactor* reactor = new UnaryReactor(this, AdmitCall());
  Submit(context, *request,
         [reactor, request, response](const absl::Status& status, const AttentionResult* result) {
           if (status.ok()) {
             ToAttendResponse(*result, response);
             response->set_request_id(request->request_id());
             response->set_model(request->model());
           }
           reactor->Finish(ToGrpcStatus(status));
         });
  return reactor;
}

grpc::ServerUnaryReactor* AttentionService::ListModels(grpc::CallbackServerContext* context,
                                                       const v1::ListModelsRequest*,
                                                       v1::ListModelsResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  absl::Status status = Authenticate(*context);
  if (status.ok()) {
    for (const auto& model : repository_->models()) {
      *response->add_models() = ToModelInfo(*model);
    }
  } else {
    spdlog::warn("ListModels refused: peer={}: {}", context->peer(), std::string(status.message()));
  }
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

// One AttendStream call. Requests are read one after another and submitted
// as they come, so several can compute at once; answers are written one at a
// time, in request order. Every decision is taken under mu_ and acted on
// after it is released (see Progress()), which is what makes the lifetime
// rule safe: once Finish() is decided nothing else touches the reactor, and
// OnDone() deletes it.
class AttentionService::StreamReactor final
    : public grpc::ServerBidiReactor<v1::AttendRequest, v1::AttendResponse> {
 public:
  StreamReactor(AttentionService* service, grpc::CallbackServerContext* context)
      : service_(service), context_(context) {
    if (absl::Status auth = service_->Authenticate(*context); !auth.ok()) {
      spdlog::warn("AttendStream refused: peer={}: {}", context->peer(), std::string(auth.message()));
      Refuse(auth);
      return;
    }
    admitted_ = service_->AdmitCall();
    if (!admitted_) {
      Refuse(absl::UnavailableError("the server is shutting down and takes no new streams"));
      return;
    }
    Progress();
  }

  void OnReadDone(bool ok) override {
    Slot* slot = nullptr;
    {
      absl::MutexLock lock(&mu_);
      reading_ = false;
      if (!ok) {
        reads_done_ = true;
        incoming_.reset();
      } else {
        slot = incoming_.get();
        slots_.push_back(std::move(incoming_));
      }
    }
    if (slot != nullptr) {
      service_->Submit(context_, slot->request,
                       [this, slot](const absl::Status& status, const AttentionResult* result) {
                         Answered(*slot, status, result);
                       });
    }
    Progress();
  }

  void OnWriteDone(bool ok) override {
    {
      absl::MutexLock lock(&mu_);
      writing_ = false;
      slots_.pop_front();
      if (!ok) broken_ = true;  // the client is gone; answers left are dropped
    }
    Progress();
  }

  void OnCancel() override {
    {
      absl::MutexLock lock(&mu_);
      broken_ = true;
    }
    Progress();
  }

  void OnDone() override {
    if (admitted_) service_->CallDone();
    delete this;
  }

 private:
  // Ends the call before it reads anything; only the constructor calls it.
  void Refuse(const absl::Status& status) {
    {
      absl::MutexLock lock(&mu_);
      finished_ = true;
    }
    service_->metrics_->CountRefusedStream(status.code());
    Finish(ToGrpcStatus(status));
  }

  struct Slot {
    v1::AttendRequest request;
    v1::AttendResponse response;
    bool answered = false;  // guarded by mu_
  };

  void Answered(Slot& slot, const absl::Status& status, const AttentionResult* result) {
    v1::AttendResponse& response = slot.response;
    if (status.ok()) {
      ToAttendResponse(*result, &response);
    } else {
      response.mutable_error()->set_code(static_cast<int32_t>(status.code()));
      response.mutable_error()->set_message(std::string(status.message()));
    }
    response.set_request_id(slot.request.request_id());
    response.set_model(slot.request.model());
    {
      absl::MutexLock lock(&mu_);
      slot.answered = true;
    }
    Progress();
  }

  // Starts whatever the state allows: the next write, the next read, or
  // Finish() once every answer is out.
  void Progress() {
    const v1::AttendResponse* write = nullptr;
    v1::AttendRequest* read = nullptr;
    bool finish = false;
    {
      absl::MutexLock lock(&mu_);
      if (finished_) return;
      if (!writing_) {
        while (broken_ && !slots_.empty() && slots_.front()->answered) slots_.pop_front();
        if (!broken_ && !slots_.empty() && slots_.front()->answered) {
          writing_ = true;
          write = &slots_.front()->response;
        }
      }
      if (!reading_ && !reads_done_ && !broken_ && slots_.size() < kMaxStreamInFlight) {
        reading_ = true;
        incoming_ = std::make_unique<Slot>();
        read = &incoming_->request;
      }
      if (!reading_ && !writing_ && slots_.empty() && (reads_done_ || broken_)) {
        finished_ = true;
        finish = true;
      }
    }
    if (write != nullptr) StartWrite(write);
    if (read != nullptr) StartRead(read);
    if (finish) Finish(grpc::Status::OK);
  }

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

grpc::ServerBidiReactor<v1::AttendRequest, v1::AttendResponse>* AttentionService::AttendStream(
    grpc::CallbackServerContext* context) {
  return new StreamReactor(this, context);
}

}  // namespace attention::server
