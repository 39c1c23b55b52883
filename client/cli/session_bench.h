// session_bench.h: `attention-client bench --sessions N`: concurrent
// decoding sessions (docs/api.md section 11), each an AttendSession stream
// that opens, then sends `steps` steps of `tokens_per_step` new rows one
// after another, each once the one before is answered. Measures steps and
// tokens per second over the whole run and each step's latency, from its
// send to its answer. Each session cycles through a few step requests made
// before the run, so the client's CPU is its calls', not its random rows'.
//
//   SessionBenchResult r = RunSessions(client, {.model = "m", .sessions = 64});
#pragma once

#include <cstdint>
#include <map>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "client/cpp/attention_client.h"
#include "client/cli/latency_summary.h"

namespace attention::client {

struct SessionBenchOptions {
  std::string model = "dot_product";
  // Sessions at once, each on its own thread and stream. Must be >= 1.
  int sessions = 1;
  // Steps per session and new token rows per step (B = 1). Must be >= 1.
  int steps = 512;
  int tokens_per_step = 1;
  // Row width for models that take any size; a model's own d_q wins.
  int64_t dim = 64;
};

struct SessionBenchResult {
  int64_t steps = 0;   // answered, successful or not
  int64_t errors = 0;  // failed steps and sessions that could not open
  std::map<absl::StatusCode, int64_t> errors_by_code;
  double steps_per_second = 0;   // successful steps over the run's wall time
  double tokens_per_second = 0;  // their new rows
  LatencySummary step_latency;   // of the successful steps
  absl::Duration wall;
  // This process's CPU (user + system) over the run: the client's share of
  // the machine, beside the server's, when both run on one host.
  absl::Duration client_cpu;
  double client_cpu_us_per_token = 0;  // of the successful steps' tokens
};

// INVALID_ARGUMENT for options out of range; otherwise runs every session to
// its end. `model_query_size`: the model's d_q (0: any, then `dim`).
absl::Status ValidateSessionBench(const SessionBenchOptions& options);
SessionBenchResult RunSessions(AttentionClient& client, const SessionBenchOptions& options,
                               int64_t model_query_size);

// The report: several lines for people, or one JSON object.
std::string FormatSessionReport(const std::string& target, const SessionBenchOptions& options,
                                const SessionBenchResult& result);
std::string FormatSessionJson(const std::string& target, const SessionBenchOptions& options,
                              const SessionBenchResult& result);

}  // namespace attention::client
