// answer_pool.cc: the answer threads' loop and their drain.
#include "server/dispatch/answer_pool.h"

#include <utility>

namespace attention::server {

AnswerPool::AnswerPool(int threads) {
  threads_.reserve(threads);
  for (int i = 0; i < threads; ++i) threads_.emplace_back([this] { Loop(); });
}

AnswerPool::~AnswerPool() { Drain(); }

void AnswerPool::Post(Job job) {
  {
    absl::MutexLock lock(&mu_);
    if (!stopping_) {
      jobs_.push_back(std::move(job));
      return;
    }
  }
  std::move(job)();
}

void AnswerPool::Drain() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  absl::MutexLock lock(&join_mu_);
  for (std::thread& thread : threads_) {
    if (thread.joinable()) thread.join();
  }
}

void AnswerPool::Loop() {
  for (;;) {
    Job job;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(this, &AnswerPool::HasJobOrStopping));
      if (jobs_.empty()) return;  // stopping, and every job taken
      job = std::move(jobs_.front());
      jobs_.pop_front();
    }
    std::move(job)();
  }
}

}  // namespace attention::server
