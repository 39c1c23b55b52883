// task.h: the dispatcher's own record of one request on its way through a
// model's batcher, and of one model's queue. Internal to dispatch/: only
// dispatcher.cc and execution.cc include it.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "core/engine/request.h"
#include "server/dispatch/batcher.h"
#include "server/dispatch/call_origin.h"
#include "server/dispatch/dispatcher.h"
#include "server/dispatch/test_gate.h"
#include "server/observability/metrics.h"
#include "server/repository/registry.h"

namespace attention::server {

// A client ends its call at its own deadline, which comes before the
// server's by the time the call took to arrive (the server's is its arrival
// plus the timeout the client sent). A cancel this close to the server's
// deadline is the deadline's, and is reported as DEADLINE_EXCEEDED.
inline constexpr absl::Duration kDeadlineSkew = absl::Milliseconds(100);

struct Dispatcher::Task {
  absl::Time deadline() const { return deadline_at; }
  bool cancelled() const { return origin->cancelled(); }
  // Polled by the engine while the request computes (docs/api.md, section 3).
  absl::Status StopReason() const {
    if (absl::Now() >= deadline_at) {
      return absl::DeadlineExceededError("the deadline passed while the request was computed");
    }
    if (cancelled()) return WhyCancelled("computed");
    return absl::OkStatus();
  }
  // Why a cancelled call ended while its request was `stage` ("queued",
  // "computed"): its client's deadline when the cancel came within
  // kDeadlineSkew of the server's, the client's cancel otherwise.
  absl::Status WhyCancelled(const char* stage) const {
    if (deadline_at - absl::Now() <= kDeadlineSkew) {
      return absl::DeadlineExceededError(
          absl::StrCat("the deadline passed while the request was ", stage,
                       " (the client's deadline, just ahead of the server's)"));
    }
    return absl::CancelledError(
        absl::StrCat("the call was cancelled while its request was ", stage));
  }

  const CallOrigin* origin = nullptr;  // the API's; alive until done runs
  std::string_view api;                // these three: owned by the caller
  std::string_view model_name;         // of Submit, alive until done runs
  std::string_view request_id;
  absl::StatusOr<std::optional<int64_t>> version;  // asked for; nullopt: newest
  absl::Status readable;                           // see Request
  AttentionRequest request;                        // views the caller's storage
  ValidatedRequest validated;                      // points at `request`
  bool is_step = false;                            // a session's step, not a request
  SessionStep step;                                // a step's; views the caller's storage
  ValidatedStep validated_step;                    // points at `step`
  // A step computed in pieces: its result, gathering the pieces' outputs,
  // kept between the batches that compute them.
  AttentionResult step_result;
  // A step waiting for the session pool to make room: since when.
  std::optional<absl::Time> waits_for_blocks_since;
  bool continues_session = false;                  // see Request
  bool continues_sequence = false;                 // see Request
  ModelQueue* queue = nullptr;                     // null: names no served model
  ServedModel served;                              // the version that computes it
  int64_t* served_version = nullptr;               // see Request
  absl::Time arrived;
  absl::Time enqueued;
  absl::Time deadline_at = absl::InfiniteFuture();
  std::optional<absl::Duration> queued;    // set once the task left the queue
  // Set once the task was computed: its batches' compute time, all of its
  // pieces' for a step in pieces.
  std::optional<absl::Duration> computed;
  int64_t message_bytes = 0;               // the request's size on the wire
  int64_t held_bytes = 0;                  // counted in held_bytes_ until answered
  Done done;
};

struct Dispatcher::ModelQueue {
  std::string name;
  ModelMetrics* metrics;  // owned by ServerMetrics
  TestGate* gate;         // not owned; nullptr for every model but the test gate's
  std::unique_ptr<Batcher<Task>> batcher;
};

}  // namespace attention::server
