// step_chain.h: the steps of a session run one after another. A stream
// (ordered_stream.h) reads and submits its requests as they come, several at
// once; a session's steps each need the one before it done, so the stream
// hands them to a StepChain, which starts each once the one before it is
// answered.
#pragma once

#include <deque>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/functional/any_invocable.h"
#include "absl/synchronization/mutex.h"

namespace attention::server {

class StepChain {
 public:
  using Step = absl::AnyInvocable<void() &&>;

  // Starts `step` now if no step of the chain is in flight, otherwise once
  // the ones before it are done. The step calls Done() when it is answered.
  void Run(Step step) {
    {
      absl::MutexLock lock(&mu_);
      if (busy_) {
        waiting_.push_back(std::move(step));
        return;
      }
      busy_ = true;
    }
    std::move(step)();
  }

  // The step in flight is answered: starts the next one, if any. A stream
  // holds at most kMaxStreamInFlight steps, which bounds the recursion of
  // steps answered at once (refused).
  void Done() {
    Step next;
    {
      absl::MutexLock lock(&mu_);
      if (waiting_.empty()) {
        busy_ = false;
        return;
      }
      next = std::move(waiting_.front());
      waiting_.pop_front();
    }
    std::move(next)();
  }

 private:
  absl::Mutex mu_;
  std::deque<Step> waiting_ ABSL_GUARDED_BY(mu_);
  bool busy_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace attention::server
