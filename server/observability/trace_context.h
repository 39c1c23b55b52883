// trace_context.h: W3C Trace Context (https://www.w3.org/TR/trace-context/)
// for request logs: the `traceparent` a caller sends is kept, so the
// server's log lines join the caller's trace; a call without a valid one
// starts a new trace (docs/api.md section 6.10).
//
//   traceparent: 00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01
//                version-trace id (32 hex)-parent id (16 hex)-flags
//
// No spans are exported (Debian packages no OpenTelemetry C++ SDK): the
// trace id is logged, and the server's span id is echoed to the caller.
#pragma once

#include <string>
#include <string_view>

namespace attention::server {

struct TraceContext {
  std::string trace_id;   // 32 lowercase hex digits, not all zero
  std::string parent_id;  // the caller's span id; empty when the trace is new
  std::string span_id;    // this call's span id, new for every call: 16 hex digits
  std::string flags;      // 2 hex digits: the caller's, "00" for a new trace

  // Whether the trace came from the caller's traceparent.
  bool continued() const { return !parent_id.empty(); }
  // The traceparent of this call's span, for the caller and downstream:
  // "00-<trace_id>-<span_id>-<flags>".
  std::string Traceparent() const;
};

// The caller's trace when `traceparent` is a valid header (version 00
// exactly as the specification writes it; a later version's first four
// fields, followed by the end or by '-'); a new trace with a random trace
// id otherwise (missing, malformed, version ff, an all-zero id).
TraceContext TraceFromTraceparent(std::string_view traceparent);

}  // namespace attention::server
