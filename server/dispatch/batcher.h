// batcher.h: dynamic batching of the tasks of one model.
//
// A Batcher owns a bounded queue and one thread. Callers hand it tasks with
// Schedule(), which never blocks; the thread merges queued tasks into batches
// of up to `max_batch_size` and hands each batch to the ProcessBatch callback,
// in arrival order. While one batch runs the next one fills, so a busy
// batcher runs full batches back to back. When a partial batch runs depends
// on `delay` (BatchingDelay): at once when the thread is free (kWhileBusy,
// the default: tasks wait only behind the batch in flight), or once its
// oldest task has waited `max_queue_delay_us` (kFixed).
//
// Use one Batcher per model when concurrent requests are cheaper to compute
// together than one by one. With max_batch_size = 1 it is a plain bounded FIFO.
//
// A long task may be computed in pieces, one per batch (chunked prefill): the
// ProcessBatch callback returns the tasks it has not finished, and they run
// again, first, in the next batch, beside the tasks queued meanwhile (up to
// max_batch_size of those: carried tasks do not count), without waiting for
// the batch to fill. So a long task holds the thread one piece at a time, not
// for its whole compute. A carried task is never dropped here: its deadline
// and cancellation are the callback's to check between its pieces. When the
// batch before also answered other tasks and none is queued yet, the next
// piece waits up to `piece_wait_us` for one: a decoding session steps again
// as soon as it is answered, and a piece computed without its step holds
// that step for a whole piece.
//
// A caller may also compute a task on its own thread, in a turn
// (TakeIdleTurn): only when the batcher is idle (nothing queued, no batch in
// flight, kWhileBusy), and no batch forms until the turn ends, so turns and
// batches never overlap. A task that would have been a batch of one at once
// then skips the hand-over to the thread and back.
//
// Worst-case queueing latency of a task: the compute time of the batches
// ahead of it (at most queue_capacity / max_batch_size of them), plus
// max_queue_delay_us with kFixed.
//
// Every accepted task is answered exactly once: it is either processed in a
// batch or dropped through the DropTask callback, with DEADLINE_EXCEEDED when
// its deadline passed while it was queued, or CANCELLED when its caller gave
// up. Dropped tasks are never processed. Destroying the batcher drains it:
// every accepted task is answered before the destructor returns.
//
//   auto batcher = Batcher<MyTask>::Create(options, process_batch, drop_task);
//   if (!batcher.ok()) return batcher.status();
//   absl::Status s = (*batcher)->Schedule(&task);  // on OK, task is now null
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "core/thread_name.h"

namespace attention::server {

// The time source of a Batcher; tests substitute a fake one.
class BatcherClock {
 public:
  virtual ~BatcherClock() = default;
  virtual absl::Time Now() = 0;
  // Called with `mu` held: returns once `condition` holds or Now() reaches
  // `deadline`, with `mu` held again.
  virtual void AwaitWithDeadline(absl::Mutex& mu, const absl::Condition& condition,
                                 absl::Time deadline) = 0;
};

// The wall clock (absl::Now()). Process-wide; never destroyed.
BatcherClock* RealBatcherClock();

// When a batch that is not full runs.
enum class BatchingDelay {
  // As soon as the batcher's thread is free: a task that arrives while no
  // batch runs is handed over at once, and the tasks that arrive while one
  // runs form the next batch. There is one execution in flight per batcher,
  // so the wait to fill a batch is what remains of the one in flight.
  kWhileBusy,
  // Once its oldest task has waited max_queue_delay_us, even on an idle
  // batcher (waits for company that a lone caller never brings).
  kFixed,
};

// --batching-delay's spelling of `delay`: "while-busy" or "fixed".
inline const char* BatchingDelayName(BatchingDelay delay) {
  return delay == BatchingDelay::kFixed ? "fixed" : "while-busy";
}

// How a Batcher batches. The defaults are attention-server's documented
// defaults (--max-batch-size, --batching-delay, --max-queue-delay-us,
// --queue-capacity; see
// docs/api.md) and are defined here only: ServerConfig and DispatchOptions
// hold this struct.
struct BatcherOptions {
  // Most tasks merged into one batch; 1 disables batching. Must be >= 1.
  int max_batch_size = 32;
  // When a partial batch runs (--batching-delay).
  BatchingDelay delay = BatchingDelay::kWhileBusy;
  // With kFixed: longest time the oldest queued task waits for its batch to
  // fill before the batch runs anyway. Must be >= 0; 0 runs whatever is
  // queued at once, as kWhileBusy does.
  int64_t max_queue_delay_us = 1000;
  // Most tasks waiting in the queue (tasks in a running batch do not count).
  // Schedule() returns RESOURCE_EXHAUSTED beyond it. Must be >= 1.
  int queue_capacity = 512;
  // How long a carried piece waits for a task when the batch before answered
  // others and none is queued (--piece-wait-us): about a client's round trip
  // on one host, so the steps just answered join the piece's batch. Must be
  // >= 0; 0: pieces never wait.
  int64_t piece_wait_us = 1000;
  // For tests. Not owned; must outlive the batcher. nullptr: RealBatcherClock().
  BatcherClock* clock = nullptr;
};

// Task needs two thread-safe accessors:
//   absl::Time deadline() const;  // absl::InfiniteFuture() when there is none
//   bool cancelled() const;       // the caller no longer wants the answer
template <typename Task>
class Batcher {
 public:
  using Options = BatcherOptions;

  // Computes one batch: the tasks carried from the batch before, then
  // 0..max_batch_size queued tasks in arrival order. Runs on the batcher's
  // thread; the next batch fills meanwhile. Returns the tasks of the batch
  // still unfinished, to carry into the next (none: every task answered).
  using ProcessBatch = std::function<std::vector<std::unique_ptr<Task>>(
      std::vector<std::unique_ptr<Task>> batch)>;
  // Answers a task that will never be processed; `why` is DEADLINE_EXCEEDED or
  // CANCELLED. Runs on the batcher's thread or inside Schedule().
  using DropTask = std::function<void(std::unique_ptr<Task> task, absl::Status why)>;

  // INVALID_ARGUMENT naming the option when one is out of range.
  // `thread_name` names the batcher's thread (core/thread_name.h).
  static absl::StatusOr<std::unique_ptr<Batcher>> Create(Options options,
                                                         ProcessBatch process_batch,
                                                         DropTask drop_task,
                                                         std::string thread_name = "batcher");

  // Drains (see Drain()).
  ~Batcher();
  Batcher(const Batcher&) = delete;
  Batcher& operator=(const Batcher&) = delete;

  // Queues `*task` without blocking. Ownership of `*task` moves to the batcher
  // (and `*task` becomes null) iff the result is OK. Otherwise the caller keeps
  // it: RESOURCE_EXHAUSTED when the queue is full, UNAVAILABLE once draining.
  absl::Status Schedule(std::unique_ptr<Task>* task);

  // Runs `chore` on the batcher's thread, between two batches, and returns
  // once it ran; UNAVAILABLE once draining. What a batch allocates on this
  // thread comes from memory only this thread's work warms (its malloc
  // arena), so work meant to warm a model's first batches runs here.
  absl::Status RunOnThread(absl::FunctionRef<void()> chore);

  // The turn of a caller that computes a task on its own thread instead of
  // queueing it: while one is held, the batcher forms no batch and runs no
  // chore. Ends when destroyed. An empty Turn (false) is no turn.
  class Turn {
   public:
    Turn() = default;
    Turn(Turn&& other) noexcept : batcher_(std::exchange(other.batcher_, nullptr)) {}
    Turn& operator=(Turn&&) = delete;
    ~Turn() {
      if (batcher_ != nullptr) batcher_->EndTurn();
    }
    explicit operator bool() const { return batcher_ != nullptr; }

   private:
    friend class Batcher;
    explicit Turn(Batcher* batcher) : batcher_(batcher) {}
    Batcher* batcher_ = nullptr;
  };

  // A turn when a task computed now would wait for nothing and delay no
  // one: nothing is queued, the thread is waiting for work (no batch or
  // chore in flight), no other turn is held, the delay is kWhileBusy and the
  // batcher is not draining. An empty Turn otherwise: Schedule() the task.
  // Drain() waits for a held turn to end.
  Turn TakeIdleTurn();

  // Why `task`, accepted at `enqueued`, must not run at `now` (its deadline
  // passed, or its caller gave up); OK when it may. What a queued task is
  // dropped for, and what a turn's caller checks before computing.
  static absl::Status Unrunnable(const Task& task, absl::Time enqueued, absl::Time now);

  // Tasks waiting in the queue now.
  int queue_depth() const;
  int queue_capacity() const { return options_.queue_capacity; }

  // Stops taking tasks, answers every accepted one (without waiting for
  // batches to fill), then stops the thread. Idempotent. Must not be called
  // from the callbacks.
  void Drain();

  // Implementation details follow. API users need not read.

 private:
  struct Entry {
    std::unique_ptr<Task> task;
    absl::Time enqueued;
  };
  struct Dropped {
    std::unique_ptr<Task> task;
    absl::Status why;
  };
  // A RunOnThread() call, alive on its caller's stack until `ran`.
  struct Chore {
    absl::FunctionRef<void()> run;
    absl::Notification ran;
  };

  Batcher(Options options, ProcessBatch process_batch, DropTask drop_task,
          std::string thread_name);

  void Loop();
  void EndTurn();
  bool NoTurnHeld() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !turn_held_; }
  bool HasWorkOrDraining() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return !queue_.empty() || !chores_.empty() || draining_;
  }
  // Runs `chores` (taken from chores_ under mu_) and empties it.
  static void RunChores(std::vector<Chore*>& chores);
  // A partial batch's delay ends early: the batch is full, a chore waits
  // (it runs first, then the delay goes on), or the batcher drains.
  bool DelayEnds() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return static_cast<int>(queue_.size()) >= options_.max_batch_size || !chores_.empty() ||
           draining_;
  }
  // Moves every queued task that must not run into `dropped`.
  void PurgeUnrunnable(std::vector<Dropped>* dropped) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void AnswerDropped(std::vector<Dropped> dropped);

  const Options options_;
  BatcherClock* const clock_;  // not owned; see Options::clock
  const ProcessBatch process_batch_;
  const DropTask drop_task_;

  mutable absl::Mutex mu_;
  // Invariant: every entry was accepted and is answered by Loop() exactly once.
  std::deque<Entry> queue_ ABSL_GUARDED_BY(mu_);
  std::vector<Chore*> chores_ ABSL_GUARDED_BY(mu_);
  bool draining_ ABSL_GUARDED_BY(mu_) = false;
  // The thread is past its wait for work: forming or computing a batch, or
  // running chores. No turn is taken while it is.
  bool in_flight_ ABSL_GUARDED_BY(mu_) = false;
  bool turn_held_ ABSL_GUARDED_BY(mu_) = false;

  absl::Mutex join_mu_;  // serialises Drain() callers around the join
  std::thread thread_;   // runs Loop(); joined by Drain(); started last
};

template <typename Task>
absl::StatusOr<std::unique_ptr<Batcher<Task>>> Batcher<Task>::Create(Options options,
                                                                     ProcessBatch process_batch,
                                                                     DropTask drop_task,
                                                                     std::string thread_name) {
  if (options.max_batch_size < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_batch_size must be >= 1; was ", options.max_batch_size));
  }
  if (options.max_queue_delay_us < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_queue_delay_us must be >= 0; was ", options.max_queue_delay_us));
  }
  if (options.piece_wait_us < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("piece_wait_us must be >= 0; was ", options.piece_wait_us));
  }
  if (options.queue_capacity < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("queue_capacity must be >= 1; was ", options.queue_capacity));
  }
  if (!process_batch || !drop_task) {
    return absl::InvalidArgumentError("process_batch and drop_task must be set");
  }
  return std::unique_ptr<Batcher>(new Batcher(options, std::move(process_batch),
                                              std::move(drop_task), std::move(thread_name)));
}

template <typename Task>
Batcher<Task>::Batcher(Options options, ProcessBatch process_batch, DropTask drop_task,
                       std::string thread_name)
    : options_(options),
      clock_(options.clock != nullptr ? options.clock : RealBatcherClock()),
      process_batch_(std::move(process_batch)),
      drop_task_(std::move(drop_task)),
      thread_([this, thread_name = std::move(thread_name)] {
        NameCurrentThread(thread_name);
        Loop();
      }) {}

template <typename Task>
Batcher<Task>::~Batcher() {
  Drain();
}

template <typename Task>
absl::Status Batcher<Task>::Schedule(std::unique_ptr<Task>* task) {
  std::vector<Dropped> dropped;
  absl::Status status;
  {
    absl::MutexLock lock(&mu_);
    if (draining_) {
      status = absl::UnavailableError("the server is shutting down and takes no new requests");
    } else {
      // Tasks nobody waits for must not keep a live one out of a full queue.
      if (static_cast<int>(queue_.size()) >= options_.queue_capacity) PurgeUnrunnable(&dropped);
      if (static_cast<int>(queue_.size()) >= options_.queue_capacity) {
        status = absl::ResourceExhaustedError(absl::StrCat(
            "the queue of this model is full (", options_.queue_capacity,
            " requests waiting); retry later or raise --queue-capacity"));
      } else {
        queue_.push_back(Entry{std::move(*task), clock_->Now()});
      }
    }
  }
  AnswerDropped(std::move(dropped));
  return status;
}

template <typename Task>
absl::Status Batcher<Task>::RunOnThread(absl::FunctionRef<void()> chore) {
  Chore queued{.run = chore, .ran = {}};
  {
    absl::MutexLock lock(&mu_);
    if (draining_) return absl::UnavailableError("the batcher is draining");
    chores_.push_back(&queued);
  }
  queued.ran.WaitForNotification();
  return absl::OkStatus();
}

template <typename Task>
void Batcher<Task>::RunChores(std::vector<Chore*>& chores) {
  for (Chore* chore : chores) {
    chore->run();
    chore->ran.Notify();
  }
  chores.clear();
}

template <typename Task>
typename Batcher<Task>::Turn Batcher<Task>::TakeIdleTurn() {
  absl::MutexLock lock(&mu_);
  if (draining_ || in_flight_ || turn_held_ || !queue_.empty() || !chores_.empty() ||
      options_.delay != BatchingDelay::kWhileBusy) {
    return Turn();
  }
  turn_held_ = true;
  return Turn(this);
}

template <typename Task>
void Batcher<Task>::EndTurn() {
  absl::MutexLock lock(&mu_);
  turn_held_ = false;
}

template <typename Task>
int Batcher<Task>::queue_depth() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(queue_.size());
}

template <typename Task>
void Batcher<Task>::Drain() {
  {
    absl::MutexLock lock(&mu_);
    draining_ = true;
  }
  absl::MutexLock lock(&join_mu_);
  if (thread_.joinable()) thread_.join();
}

template <typename Task>
absl::Status Batcher<Task>::Unrunnable(const Task& task, absl::Time enqueued, absl::Time now) {
  if (now >= task.deadline()) {
    return absl::DeadlineExceededError(
        absl::StrCat("the deadline passed after ", absl::ToInt64Microseconds(now - enqueued),
                     " us in the queue, before the request was computed"));
  }
  if (task.cancelled()) {
    return absl::CancelledError("the call was cancelled while its request was queued");
  }
  return absl::OkStatus();
}

template <typename Task>
void Batcher<Task>::PurgeUnrunnable(std::vector<Dropped>* dropped) {
  const absl::Time now = clock_->Now();
  std::deque<Entry> kept;
  for (Entry& entry : queue_) {
    absl::Status why = Unrunnable(*entry.task, entry.enqueued, now);
    if (why.ok()) {
      kept.push_back(std::move(entry));
    } else {
      dropped->push_back(Dropped{std::move(entry.task), std::move(why)});
    }
  }
  queue_.swap(kept);
}

template <typename Task>
void Batcher<Task>::AnswerDropped(std::vector<Dropped> dropped) {
  for (Dropped& d : dropped) drop_task_(std::move(d.task), std::move(d.why));
}

template <typename Task>
void Batcher<Task>::Loop() {
  std::vector<std::unique_ptr<Task>> carried;  // unfinished tasks of the last batch
  bool answered_others = false;                // the last batch finished some tasks
  // Taken from chores_ where the loop holds mu_ anyway, and run before the
  // next batch forms: after the batch in flight, or at once when idle.
  std::vector<Chore*> chores;
  for (;;) {
    RunChores(chores);
    std::vector<std::unique_ptr<Task>> batch = std::move(carried);
    carried.clear();
    std::vector<Dropped> dropped;
    {
      absl::MutexLock lock(&mu_);
      // Carried work is ready now: it waits neither to fill nor for the
      // delay, only a moment for the tasks just answered to come back.
      if (!batch.empty() && answered_others && queue_.empty() && options_.piece_wait_us > 0) {
        clock_->AwaitWithDeadline(mu_, absl::Condition(this, &Batcher::HasWorkOrDraining),
                                  clock_->Now() + absl::Microseconds(options_.piece_wait_us));
      }
      if (batch.empty()) {
        in_flight_ = false;
        mu_.Await(absl::Condition(this, &Batcher::HasWorkOrDraining));
        in_flight_ = true;
        // A caller's turn ends first; no other begins meanwhile.
        mu_.Await(absl::Condition(this, &Batcher::NoTurnHeld));
        chores.swap(chores_);
        if (!chores.empty()) continue;
        if (queue_.empty()) return;  // draining and every task answered
        if (options_.delay == BatchingDelay::kFixed) {
          const absl::Time close_at =
              queue_.front().enqueued + absl::Microseconds(options_.max_queue_delay_us);
          clock_->AwaitWithDeadline(mu_, absl::Condition(this, &Batcher::DelayEnds), close_at);
          chores.swap(chores_);
          if (!chores.empty()) continue;
        }
      }
      chores.swap(chores_);
      const absl::Time now = clock_->Now();
      const size_t full = batch.size() + static_cast<size_t>(options_.max_batch_size);
      while (batch.size() < full && !queue_.empty()) {
        Entry entry = std::move(queue_.front());
        queue_.pop_front();
        absl::Status why = Unrunnable(*entry.task, entry.enqueued, now);
        if (why.ok()) {
          batch.push_back(std::move(entry.task));
        } else {
          dropped.push_back(Dropped{std::move(entry.task), std::move(why)});
        }
      }
    }
    AnswerDropped(std::move(dropped));
    const size_t size = batch.size();
    if (!batch.empty()) carried = process_batch_(std::move(batch));
    answered_others = carried.size() < size;
  }
}

}  // namespace attention::server
