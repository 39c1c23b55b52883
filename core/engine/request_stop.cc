// request_stop.cc: RequestStop (request_stop.h).
#include "core/engine/request_stop.h"

#include <utility>

namespace attention::internal {

bool RequestStop::Stopped() {
  if (stopped_.load(std::memory_order_acquire)) return true;
  absl::Status why = check_();
  if (why.ok()) return false;
  std::lock_guard<std::mutex> lock(mu_);
  if (!stopped_.load(std::memory_order_relaxed)) {
    why_ = std::move(why);
    stopped_.store(true, std::memory_order_release);
  }
  return true;
}

absl::Status RequestStop::why() const {
  std::lock_guard<std::mutex> lock(mu_);
  return why_;
}

}  // namespace attention::internal
