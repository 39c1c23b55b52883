// call_origin.h: what the dispatcher needs to know of the call that brought a
// request, whatever API it came through: its deadline, whether its client has
// gone, who sent it (for log lines), its trace (trace_context.h) and whether
// its credentials are accepted.
//
// Each API implements it once over its own transport (grpc_call.h for gRPC);
// the dispatcher never sees a transport's types.
#pragma once

#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "server/observability/trace_context.h"

namespace attention::server {

class AccessPolicy;

class CallOrigin {
 public:
  virtual ~CallOrigin() = default;

  // When the call's client stops waiting; absl::InfiniteFuture() for none.
  virtual absl::Time deadline() const = 0;
  // Whether the client cancelled the call (or the deadline passed).
  virtual bool cancelled() const = 0;
  // The client's address, for log lines.
  virtual std::string peer() const = 0;
  // OK when `access` accepts the call's credentials; UNAUTHENTICATED or
  // PERMISSION_DENIED saying why otherwise.
  virtual absl::Status Authenticate(const AccessPolicy& access) const = 0;

  // The trace the call's log lines name: the caller's, once the API has
  // called SetTraceparent() with its header, a new one otherwise.
  const TraceContext& trace() const { return trace_; }

 protected:
  CallOrigin() : trace_(TraceFromTraceparent({})) {}
  // From the API's constructor: `traceparent`, the call's header of that
  // name (empty when it has none).
  void SetTraceparent(std::string_view traceparent) {
    trace_ = TraceFromTraceparent(traceparent);
  }

 private:
  TraceContext trace_;
};

}  // namespace attention::server
