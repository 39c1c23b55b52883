// dispatcher.cc: a request's way from Submit() into its model's batcher, the
// queues, and the count of open calls that drain waits for. What happens
// once a batch forms is in execution.cc.
#include "server/dispatch/dispatcher.h"

#include <algorithm>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "server/observability/request_names.h"
#include "server/dispatch/task.h"
#include "spdlog/spdlog.h"

namespace attention::server {
namespace {

// Sending answers is cheap next to computing them: half the cores, at most 4.
int AnswerThreads() {
  return std::clamp(static_cast<int>(std::thread::hardware_concurrency()) / 2, 1, 4);
}

}  // namespace

absl::StatusOr<std::unique_ptr<Dispatcher>> Dispatcher::Create(const ModelRegistry* registry,
                                                               Engine* engine,
                                                               ServerMetrics* metrics,
                                                               DispatchOptions options) {
  std::unique_ptr<Dispatcher> dispatcher(
      new Dispatcher(registry, engine, metrics, std::move(options)));
  // Bad batching options fail here, at start-up, rather than on a first request.
  for (const auto& [name, entry] : *registry->snapshot()) {
    if (absl::StatusOr<ModelQueue*> queue = dispatcher->QueueFor(name); !queue.ok()) {
      return queue.status();
    }
  }
  return dispatcher;
}

Dispatcher::Dispatcher(const ModelRegistry* registry, Engine* engine, ServerMetrics* metrics,
                       DispatchOptions options)
    : registry_(registry),
      engine_(engine),
      metrics_(metrics),
      options_(std::move(options)),
      access_(options_.allowed_client_identities, options_.auth_tokens),
      answers_(AnswerThreads()) {}

Dispatcher::~Dispatcher() { Drain(); }

absl::StatusOr<Dispatcher::ModelQueue*> Dispatcher::QueueFor(std::string_view name) {
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
      [this, q](std::vector<std::unique_ptr<Task>> batch) {
        return ProcessBatch(*q, std::move(batch));
      },
      [this, q](std::unique_ptr<Task> task, absl::Status why) {
        DropTask(*q, std::move(task), why);
      },
      absl::StrCat("batch:", queue->name));
  if (!batcher.ok()) return batcher.status();
  queue->batcher = *std::move(batcher);
  queues_.emplace(queue->name, std::move(queue));
  return q;
}

absl::Status Dispatcher::RunOnBatcherThread(std::string_view name,
                                            absl::FunctionRef<void()> work) {
  absl::StatusOr<ModelQueue*> queue = QueueFor(name);
  if (!queue.ok()) return queue.status();
  return (*queue)->batcher->RunOnThread(work);
}

absl::Status Dispatcher::OpenCall(std::string_view what) {
  return OpenCallOf(what, /*stream=*/false);
}

absl::Status Dispatcher::OpenCallOf(std::string_view what, bool stream) {
  absl::MutexLock lock(&calls_mu_);
  // Once draining no stream opens, even while unary calls are still counted
  // open for the steps of open sequences.
  if (!accepting_.load() && (stream || !sequence_steps_.load())) {
    return absl::UnavailableError(absl::StrCat("the server is shutting down and takes no new ",
                                               absl::string_view(what.data(), what.size())));
  }
  ++open_calls_;
  return absl::OkStatus();
}

void Dispatcher::CloseCall() {
  absl::MutexLock lock(&calls_mu_);
  --open_calls_;
}

absl::Status Dispatcher::OpenStream(const CallOrigin& origin, std::string_view api,
                                    std::string_view method) {
  absl::Status status = origin.Authenticate(access_);
  if (!status.ok()) {
    spdlog::warn("{} refused: peer={}: {}", method, origin.peer(), std::string(status.message()));
  } else {
    status = OpenCallOf("streams", /*stream=*/true);
  }
  if (!status.ok()) metrics_->CountRefusedStream(api, status.code());
  return status;
}

void Dispatcher::StopAccepting() {
  absl::MutexLock lock(&calls_mu_);
  accepting_.store(false);
}

void Dispatcher::StopSequenceSteps() {
  absl::MutexLock lock(&calls_mu_);
  sequence_steps_.store(false);
}

bool Dispatcher::WaitForIdle(absl::Time deadline) {
  absl::MutexLock lock(&calls_mu_);
  auto idle = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(calls_mu_) { return open_calls_ == 0; };
  return calls_mu_.AwaitWithDeadline(absl::Condition(&idle), deadline);
}

void Dispatcher::Drain() {
  StopAccepting();
  StopSequenceSteps();
  // Drained outside the lock: a batcher thread finishing its batch may be
  // answering a stream, whose next request is submitted at once and may
  // create a queue. Queues live as long as the dispatcher; one created after
  // this copy drains in its destructor.
  std::vector<ModelQueue*> queues;
  {
    absl::ReaderMutexLock lock(&queues_mu_);
    for (auto& [name, queue] : queues_) queues.push_back(queue.get());
  }
  for (ModelQueue* queue : queues) queue->batcher->Drain();
  answers_.Drain();
}

void Dispatcher::Submit(const CallOrigin& origin, Request request, Decode decode, Done done) {
  std::unique_ptr<Task> task = AdmitTask(origin, std::move(request), std::move(done),
                                         [&](Task& admitted) { return Admit(admitted, decode); });
  if (task != nullptr) Schedule(std::move(task));
}

void Dispatcher::SubmitStep(const CallOrigin& origin, Request request, DecodeStep decode,
                            Done done) {
  std::unique_ptr<Task> task =
      AdmitTask(origin, std::move(request), std::move(done), [&](Task& admitted) {
        admitted.is_step = true;
        return AdmitStep(admitted, decode);
      });
  if (task != nullptr) Schedule(std::move(task));
}

void Dispatcher::SubmitOpening(const CallOrigin& origin, Request request, OpenSession open,
                               Done done) {
  std::unique_ptr<Task> task =
      AdmitTask(origin, std::move(request), std::move(done), [&](Task& admitted) {
        absl::Status model = AdmitModel(admitted);
        return model.ok() ? open(admitted.served) : model;
      });
  if (task != nullptr) Answer(*task, absl::OkStatus(), nullptr);
}

std::unique_ptr<Dispatcher::Task> Dispatcher::AdmitTask(
    const CallOrigin& origin, Request request, Done done,
    absl::FunctionRef<absl::Status(Task&)> admit) {
  const bool credentials_checked = request.credentials_checked;
  std::unique_ptr<Task> task = NewTask(origin, std::move(request), std::move(done));
  absl::Status admitted = Authenticate(origin, credentials_checked);
  if (admitted.ok()) admitted = admit(*task);
  if (admitted.ok()) return task;
  Answer(*task, admitted, nullptr);
  return nullptr;
}

absl::Status Dispatcher::Authenticate(const CallOrigin& origin, bool credentials_checked) const {
  return credentials_checked ? absl::OkStatus() : origin.Authenticate(access_);
}

std::unique_ptr<Dispatcher::Task> Dispatcher::NewTask(const CallOrigin& origin, Request request,
                                                      Done done) {
  auto task = std::make_unique<Task>();
  task->arrived = absl::Now();
  task->origin = &origin;
  task->api = request.api;
  task->model_name = request.model;
  task->request_id = request.request_id;
  task->version = std::move(request.version);
  task->readable = std::move(request.readable);
  task->served_version = request.served_version;
  task->message_bytes = request.message_bytes;
  task->continues_session = request.continues_session;
  task->continues_sequence = request.continues_sequence;
  task->deadline_at = origin.deadline();
  task->done = std::move(done);
  metrics_->inflight().Increment();
  return task;
}

void Dispatcher::Schedule(std::unique_ptr<Task> task) {
  if (absl::Status held = HoldBytes(*task); !held.ok()) return Answer(*task, held, nullptr);
  ModelQueue& queue = *task->queue;
  task->enqueued = absl::Now();
  queue.metrics->queue_depth->Increment();
  if (ComputesHere(*task)) {
    if (Batcher<Task>::Turn turn = queue.batcher->TakeIdleTurn()) {
      return ComputeInTurn(queue, std::move(task));
    }
  }
  if (absl::Status scheduled = queue.batcher->Schedule(&task); !scheduled.ok()) {
    queue.metrics->queue_depth->Decrement();
    Answer(*task, scheduled, nullptr);
  }
}

absl::Status Dispatcher::AdmitCall(const Task& task) const {
  if (!accepting_.load() && !task.continues_session &&
      !(task.continues_sequence && sequence_steps_.load())) {
    return absl::UnavailableError("the server is shutting down and takes no new requests");
  }
  if (!task.readable.ok()) return task.readable;
  for (const auto& [field, value] :
       {std::pair<std::string_view, std::string_view>{"model", task.model_name},
        {"request_id", task.request_id}}) {
    if (absl::Status s = CheckNameLength(field, value); !s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::Status Dispatcher::AdmitModel(Task& task) {
  if (absl::Status s = AdmitCall(task); !s.ok()) return s;
  // The name first, so that a bad version of an unknown model is NOT_FOUND
  // for its name.
  absl::StatusOr<ServedModel> served = registry_->Resolve(task.model_name, std::nullopt);
  if (!served.ok()) return served.status();
  absl::StatusOr<ModelQueue*> queue = QueueFor(task.model_name);
  if (!queue.ok()) return queue.status();
  task.queue = *queue;
  if (!task.version.ok()) return task.version.status();
  if (task.version->has_value()) served = registry_->Resolve(task.model_name, *task.version);
  if (!served.ok()) return served.status();
  task.served = *std::move(served);
  return absl::OkStatus();
}

absl::Status Dispatcher::Admit(Task& task, Decode decode) {
  if (absl::Status s = AdmitModel(task); !s.ok()) return s;
  absl::StatusOr<AttentionRequest> request = decode();
  if (!request.ok()) return request.status();
  task.request = *std::move(request);
  absl::StatusOr<AttentionDims> dims = Validate(*task.served.model, task.request, options_.limits);
  if (!dims.ok()) return dims.status();
  task.validated = ValidatedRequest{&task.request, *dims};
  return absl::OkStatus();
}

absl::Status Dispatcher::AdmitStep(Task& task, DecodeStep decode) {
  if (absl::Status s = AdmitCall(task); !s.ok()) return s;
  const absl::StatusOr<ServedModel> resolved =
      task.version.ok() ? registry_->Resolve(task.model_name, *task.version)
                        : absl::StatusOr<ServedModel>(task.version.status());
  absl::StatusOr<Step> step = decode(resolved);
  if (!step.ok()) return step.status();
  // The session exists, so its model's name was served when it opened: its
  // queue and metric series may be made.
  absl::StatusOr<ModelQueue*> queue = QueueFor(task.model_name);
  if (!queue.ok()) return queue.status();
  task.queue = *queue;
  task.served = std::move(step->served);
  task.step = std::move(step->step);
  absl::StatusOr<ValidatedStep> validated =
      ValidateStep(*step->session, task.step, options_.limits);
  if (!validated.ok()) return validated.status();
  task.validated_step = *std::move(validated);
  return absl::OkStatus();
}

absl::Status Dispatcher::HoldBytes(Task& task) {
  if (options_.max_queued_bytes <= 0) return absl::OkStatus();
  const int64_t bytes = task.message_bytes;
  const int64_t held = held_bytes_.fetch_add(bytes) + bytes;
  task.held_bytes = bytes;
  if (held <= options_.max_queued_bytes) return absl::OkStatus();
  return absl::ResourceExhaustedError(absl::StrCat(
      "the server holds ", held - bytes, " bytes of requests; this one (", bytes,
      " bytes) would pass --max-queued-bytes ", options_.max_queued_bytes, "; retry later"));
}

}  // namespace attention::server
