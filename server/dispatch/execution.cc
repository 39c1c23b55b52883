// execution.cc: what the dispatcher does once a model's batcher hands it a
// batch: one engine execution per model version, then one answer per
// request, counted, timed and logged in one place (Answer), on an answer
// thread.
#include <algorithm>
#include <exception>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "nlohmann/json.hpp"
#include "server/dispatch/dispatcher.h"
#include "server/observability/logging.h"
#include "server/observability/request_names.h"
#include "server/dispatch/task.h"
#include "spdlog/spdlog.h"

namespace attention::server {
namespace {

// A batch of at most this many tasks, or of requests each within
// --inline-work, is answered on its batcher thread when the answer pool is
// idle: one answer is a few microseconds, less than handing it to another
// thread costs, and next to such a batch's compute there is nothing to
// overlap.
constexpr size_t kAnswerInlineTasks = 1;

// A step waits at most this long for the session pool to make room (a
// session ending, or one with no step in flight to preempt); then it is
// refused RESOURCE_EXHAUSTED. The bound ends a wait no other step can end:
// every session holding blocks itself waiting for more.
constexpr absl::Duration kLongestBlockWait = absl::Seconds(60);

// A batch of nothing but steps waiting for blocks pauses its batcher thread
// this long before the next, rather than asking the pool again at once.
constexpr absl::Duration kBlockWaitPause = absl::Microseconds(500);

int64_t Micros(absl::Duration d) { return absl::ToInt64Microseconds(d); }

nlohmann::json Millis(const std::optional<absl::Duration>& d) {
  return d ? nlohmann::json(absl::ToDoubleMilliseconds(*d)) : nlohmann::json();
}

// The request's log line fields in the JSON format (docs/api.md 6.10);
// null where the request never got that far. `task` is a Dispatcher::Task,
// a name private to the dispatcher.
nlohmann::json RequestLogFields(const auto& task, std::string_view model,
                                const absl::Status& status, absl::Duration total) {
  const TraceContext& trace = task.origin->trace();
  return {{"api", task.api},
          {"model", model.empty() ? std::string(Printable(task.model_name)) : std::string(model)},
          {"version", task.served.model ? nlohmann::json(task.served.version) : nlohmann::json()},
          {"code", absl::StatusCodeToString(status.code())},
          {"request_id", std::string(Printable(task.request_id))},
          {"trace_id", trace.trace_id},
          {"span_id", trace.span_id},
          {"peer", task.origin->peer()},
          {"queue_ms", Millis(task.queued)},
          {"compute_ms", Millis(task.computed)},
          {"total_ms", absl::ToDoubleMilliseconds(total)}};
}

}  // namespace

std::vector<std::unique_ptr<Dispatcher::Task>> Dispatcher::ProcessBatch(
    ModelQueue& queue, std::vector<std::unique_ptr<Task>> batch) {
  // Versions of one model share a queue but never an execution: each run of
  // tasks on the same weights (in arrival order) is computed on its own.
  std::vector<std::unique_ptr<Task>> unfinished;
  while (!batch.empty()) {
    const Model* model = batch.front()->served.model.get();
    std::vector<std::unique_ptr<Task>> same, rest;
    for (auto& task : batch) {
      (task->served.model.get() == model ? same : rest).push_back(std::move(task));
    }
    for (auto& task : RunBatch(queue, std::move(same), AnswerOn::kAnswerThreads)) {
      unfinished.push_back(std::move(task));
    }
    batch = std::move(rest);
  }
  return unfinished;
}

double Dispatcher::ChunkWork() const {
  const int64_t chunk = options_.chunk_work, limit = options_.limits.max_request_work;
  if (chunk <= 0 || limit <= 0) return static_cast<double>(std::max(chunk, limit));
  return static_cast<double>(std::min(chunk, limit));
}

void Dispatcher::Compute(const Model& model, std::span<const std::unique_ptr<Task>> batch,
                         size_t num_requests, std::span<AttentionResult> results) {
  std::vector<ValidatedRequest> requests;
  std::vector<ValidatedStep> steps;
  requests.reserve(num_requests);
  steps.reserve(batch.size() - num_requests);
  for (const auto& task : batch) {
    StopCheck stop = [&t = *task] { return t.StopReason(); };
    if (task->is_step) {
      // The step's next piece: the rows that fit in ChunkWork().
      task->validated_step.chunk_rows = ChunkRows(task->validated_step, ChunkWork());
      steps.push_back(task->validated_step);
      steps.back().stop = std::move(stop);
    } else {
      requests.push_back(task->validated);
      requests.back().stop = std::move(stop);
    }
  }
  if (!requests.empty()) engine_->Run(model, requests, results.first(num_requests));
  if (!steps.empty()) engine_->RunSteps(steps, results.subspan(num_requests));
}

bool Dispatcher::WithinInlineWork(const Task& task) const {
  return !task.is_step && options_.inline_work > 0 &&
         RequestWork(*task.served.model, task.validated.dims) <=
             static_cast<double>(options_.inline_work);
}

bool Dispatcher::ComputesHere(const Task& task) const {
  return task.queue->gate == nullptr && WithinInlineWork(task);
}

void Dispatcher::ComputeInTurn(ModelQueue& queue, std::unique_ptr<Task> task) {
  // As the batcher checks a queued task before its batch: a request whose
  // client is gone is answered, not computed.
  if (absl::Status why = Batcher<Task>::Unrunnable(*task, task->enqueued, absl::Now());
      !why.ok()) {
    return DropTask(queue, std::move(task), why);
  }
  std::vector<std::unique_ptr<Task>> batch;
  batch.push_back(std::move(task));
  // A plain request is finished in one batch: nothing is carried.
  RunBatch(queue, std::move(batch), AnswerOn::kThisThread);
}

std::vector<std::unique_ptr<Dispatcher::Task>> Dispatcher::RunBatch(
    ModelQueue& queue, std::vector<std::unique_ptr<Task>> batch, AnswerOn answer_on) {
  const absl::Time start = absl::Now();
  for (auto& task : batch) {
    if (task->queued) continue;  // a step's later piece: it left the queue before
    queue.metrics->queue_depth->Decrement();
    task->queued = start - task->enqueued;
  }
  queue.metrics->batch_size->Observe(static_cast<double>(batch.size()));
  // Requests first, then steps, each in arrival order (a carried step first).
  const auto steps_begin = std::stable_partition(batch.begin(), batch.end(),
                                                 [](const auto& task) { return !task->is_step; });
  const auto num_requests = static_cast<size_t>(steps_begin - batch.begin());

  std::vector<AttentionResult> results(batch.size());
  for (size_t i = num_requests; i < batch.size(); ++i) {
    results[i] = std::move(batch[i]->step_result);
  }
  absl::Status status;
  try {
    if (queue.gate != nullptr) queue.gate->Pass();
    Compute(*batch.front()->served.model, batch, num_requests, results);
  } catch (const std::exception& e) {
    status = absl::InternalError(absl::StrCat("the engine failed: ", e.what()));
  }
  const absl::Duration computed = absl::Now() - start;
  for (auto& task : batch) task->computed = task->computed.value_or(absl::ZeroDuration()) + computed;
  std::vector<std::unique_ptr<Task>> unfinished =
      TakeUnfinished(status, batch, num_requests, results);
  if (batch.empty()) return unfinished;
  // Moved, not copied: a copy would share the status's reference-counted
  // message with this thread, and Debian's Abseil (not built for TSan) drops
  // the answer thread's reference where TSan cannot see it.
  const bool small = answer_on == AnswerOn::kAnswerThreads &&
                     (batch.size() <= kAnswerInlineTasks ||
                      std::all_of(batch.begin(), batch.end(),
                                  [this](const auto& t) { return WithinInlineWork(*t); }));
  AnswerPool::Job job = [this, batch = std::move(batch), status = std::move(status),
                         results = std::move(results)]() mutable {
    AnswerBatch(std::move(batch), status, std::move(results));
  };
  if (answer_on == AnswerOn::kThisThread) {
    std::move(job)();
  } else if (small) {
    answers_.RunOrPost(std::move(job));
  } else {
    answers_.Post(std::move(job));
  }
  return unfinished;
}

bool Dispatcher::WaitsForBlocks(Task& task, AttentionResult& result) const {
  if (!options_.steps_wait_for_blocks || task.validated_step.done_rows > 0 ||
      !PoolWasFull(result.status)) {
    return false;
  }
  // A waiting step whose deadline passed or whose call was cancelled is
  // answered so, as a queued one would be; one whose session was ended
  // meanwhile (preempted for the others waiting) is answered why.
  if (absl::Status stop = task.StopReason(); !stop.ok()) {
    result.status = std::move(stop);
    return false;
  }
  if (absl::Status ended = task.validated_step.session->ended(); !ended.ok()) {
    result.status = std::move(ended);
    return false;
  }
  const absl::Time now = absl::Now();
  if (!task.waits_for_blocks_since) task.waits_for_blocks_since = now;
  return now - *task.waits_for_blocks_since < kLongestBlockWait;
}

std::vector<std::unique_ptr<Dispatcher::Task>> Dispatcher::TakeUnfinished(
    const absl::Status& status, std::vector<std::unique_ptr<Task>>& batch, size_t num_requests,
    std::vector<AttentionResult>& results) {
  std::vector<std::unique_ptr<Task>> unfinished;
  size_t kept = num_requests;  // batch[num_requests, kept) are answered now
  size_t waiting = 0;
  for (size_t i = num_requests; i < batch.size(); ++i) {
    ValidatedStep& step = batch[i]->validated_step;
    if (!status.ok()) AbandonStep(step);  // a failed engine may have left pieces
    if (status.ok() && WaitsForBlocks(*batch[i], results[i])) {
      // Nothing of the step began: it begins afresh with a later batch.
      batch[i]->step_result = {};
      unfinished.push_back(std::move(batch[i]));
      ++waiting;
      continue;
    }
    const bool more = status.ok() && results[i].status.ok() &&
                      step.done_rows + step.chunk_rows < step.dims.num_queries;
    if (more) {
      step.done_rows += step.chunk_rows;
      batch[i]->step_result = std::move(results[i]);
      unfinished.push_back(std::move(batch[i]));
      continue;
    }
    if (kept != i) {
      batch[kept] = std::move(batch[i]);
      results[kept] = std::move(results[i]);
    }
    ++kept;
  }
  if (waiting > 0 && waiting == batch.size()) absl::SleepFor(kBlockWaitPause);
  batch.resize(kept);
  results.resize(kept);
  return unfinished;
}

void Dispatcher::AnswerBatch(std::vector<std::unique_ptr<Task>> batch, const absl::Status& status,
                             std::vector<AttentionResult> results) {
  for (size_t i = 0; i < batch.size(); ++i) {
    const absl::Status& answer = status.ok() ? results[i].status : status;
    Answer(*batch[i], answer, answer.ok() ? &results[i] : nullptr);
  }
}

void Dispatcher::DropTask(ModelQueue& queue, std::unique_ptr<Task> task, const absl::Status& why) {
  queue.metrics->queue_depth->Decrement();
  task->queued = absl::Now() - task->enqueued;
  // The batcher cannot tell a client's deadline from its cancel; the task can.
  Answer(*task, why.code() == absl::StatusCode::kCancelled ? task->WhyCancelled("queued") : why,
         nullptr);
}

void Dispatcher::Answer(Task& task, const absl::Status& status, const AttentionResult* result) {
  // Before the count, so a scrape that sees the request counted also sees it
  // no longer in flight.
  metrics_->inflight().Decrement();
  held_bytes_.fetch_sub(task.held_bytes);
  Record(task, status);
  if (status.ok() && task.served_version != nullptr) *task.served_version = task.served.version;
  // The weights go with the answer: the last request on a replaced version
  // frees it.
  task.served = ServedModel{};
  task.done(status, result);
}

void Dispatcher::Record(const Task& task, const absl::Status& status) {
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
  int64_t suppressed = 0;
  if (!status.ok() && refusal_log_.Admit(&suppressed)) {
    const nlohmann::json fields = RequestLogFields(task, model, status, total);
    const ScopedLogFields scope(fields);
    spdlog::warn(
        "request failed: api={} model='{}' request_id='{}' trace_id={} peer={} code={} after {} "
        "us: {}{}",
        task.api, Printable(task.model_name), Printable(task.request_id),
        task.origin->trace().trace_id, task.origin->peer(),
        absl::StatusCodeToString(status.code()), Micros(total), std::string(status.message()),
        RefusalLogLimiter::SuppressedNote(suppressed, "failed requests"));
  } else if (status.ok() && spdlog::should_log(spdlog::level::debug)) {
    const nlohmann::json fields = RequestLogFields(task, model, status, total);
    const ScopedLogFields scope(fields);
    spdlog::debug(
        "request done: api={} model='{}' request_id='{}' trace_id={} peer={} batch_wait={} us "
        "compute={} us total={} us",
        task.api, model, Printable(task.request_id), task.origin->trace().trace_id,
        task.origin->peer(), task.queued ? Micros(*task.queued) : 0,
        task.computed ? Micros(*task.computed) : 0, Micros(total));
  }
}

}  // namespace attention::server
