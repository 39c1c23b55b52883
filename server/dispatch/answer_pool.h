// answer_pool.h: the threads that send a batch's answers (serialization and
// the call's Finish, or a stream's next write), so that the model's batcher
// thread is free to form and compute the next batch meanwhile.
#pragma once

#include <deque>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/any_invocable.h"
#include "absl/synchronization/mutex.h"

namespace attention::server {

class AnswerPool {
 public:
  using Job = absl::AnyInvocable<void() &&>;

  // Starts `threads` (>= 1) threads.
  explicit AnswerPool(int threads);
  // Drains (see Drain()).
  ~AnswerPool();
  AnswerPool(const AnswerPool&) = delete;
  AnswerPool& operator=(const AnswerPool&) = delete;

  // Runs `job` on a pool thread, in no particular order with the other jobs;
  // once Drain() has begun, at once in the caller, so no job is ever lost.
  void Post(Job job);

  // As Post(), but runs `job` at once in the caller when no job is queued or
  // running: then there is nothing for the caller to overlap it with, and
  // the hand-off (a wake-up and a context switch) would cost more than a
  // small job.
  void RunOrPost(Job job);

  // Runs every job posted, then stops the threads. Idempotent. Must not be
  // called from a job.
  void Drain();

 private:
  // Post() and RunOrPost(): queues `job`, or runs it in the caller once
  // draining, or when `run_if_idle` and the pool is idle.
  void Hand(Job job, bool run_if_idle);
  void Loop();
  bool HasJobOrStopping() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return !jobs_.empty() || stopping_;
  }

  absl::Mutex mu_;
  std::deque<Job> jobs_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  int running_ ABSL_GUARDED_BY(mu_) = 0;  // jobs a pool thread runs now

  absl::Mutex join_mu_;               // serialises Drain() callers around the joins
  std::vector<std::thread> threads_;  // run Loop(); joined by Drain()
};

}  // namespace attention::server
