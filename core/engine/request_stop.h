// request_stop.h: a request's stop as the engine's tasks see it, shared by
// every task that computes the request (internal to the engine).
#pragma once

#include <atomic>
#include <mutex>
#include <span>

#include "absl/status/status.h"
#include "core/engine/engine.h"
#include "core/kernels/flash_kernel.h"

namespace attention::internal {

// Asks the request's StopCheck and keeps the first non-OK answer.
class RequestStop final : public WorkStop {
 public:
  explicit RequestStop(const StopCheck& check) : check_(check) {}

  bool Stopped() override;
  // After the run: OK, or why the request stopped.
  absl::Status why() const;

 private:
  const StopCheck& check_;
  std::atomic<bool> stopped_{false};
  mutable std::mutex mu_;
  absl::Status why_;
};

// Each request's stop, or null for one never asked.
using Stops = std::span<RequestStop* const>;

// The stop of a group of one request, else null. A request over the group
// bound, where a stop matters, is always a group of its own (Engine::Run).
inline WorkStop* LoneStop(Stops stops) { return stops.size() == 1 ? stops[0] : nullptr; }

}  // namespace attention::internal
