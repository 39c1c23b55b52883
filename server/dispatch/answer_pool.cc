// answer_pool.cc: the answer threads' loop and their drain.
#include "server/dispatch/answer_pool.h"

#include <utility>

#include "core/thread_name.h"

namespace attention::server {

AnswerPool::AnswerPool(int threads) {
  threads_.reserve(threads);
  for (int i = 0; i < threads; ++i) {
    threads_.emplace_back([this] {
      NameCurrentThread("answer");
      Loop();
    });
  }
}

AnswerPool::~AnswerPool() { Drain(); }

void AnswerPool::Post(Job job) { Hand(std::move(job), /*run_if_idle=*/false); }

void AnswerPool::RunOrPost(Job job) { Hand(std::move(job), /*run_if_idle=*/true); }

void AnswerPool::Hand(Job job, bool run_if_idle) {
  {
    absl::MutexLock lock(&mu_);
    const bool idle = jobs_.empty() && running_ == 0;
    if (!stopping_ && !(run_if_idle && idle)) {
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
  for (bool ran = false;; ran = true) {
    Job job;
    {
      absl::MutexLock lock(&mu_);
      if (ran) --running_;
      mu_.Await(absl::Condition(this, &AnswerPool::HasJobOrStopping));
      if (jobs_.empty()) return;  // stopping, and every job taken
      job = std::move(jobs_.front());
      jobs_.pop_front();
      ++running_;
    }
    std::move(job)();
  }
}

}  // namespace attention::server
