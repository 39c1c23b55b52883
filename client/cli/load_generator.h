// load_generator.h: drives Attend calls (or Open Inference Protocol
// ModelInfer calls) at a server and measures them, like Triton's
// perf_analyzer.
//
// Two ways to load the server:
//   closed loop (rate_rps == 0): `concurrency` calls are always in flight;
//     each answer starts the next call. Measures the throughput the server
//     sustains at that concurrency; latency is from send to answer.
//   open loop (rate_rps > 0): calls start on a fixed schedule, rate_rps per
//     second, whether or not earlier ones were answered. Latency counts from
//     a call's scheduled start, so a client or server that falls behind shows
//     up as latency instead of silently sending less (coordinated omission).
//     With max_in_flight set, a call that falls due while that many are in
//     flight is skipped and counted, so a server that cannot keep up does
//     not make the client's own memory grow without bound.
// The first `warmup` is not measured. Calls stop starting after
// warmup + duration. In the closed loop the answers that arrive inside the
// measured window count; in the open loop the calls due inside it count,
// whenever they are answered, so every call due is either answered or
// skipped even when the client falls behind its schedule. Run() returns once
// every started call has ended (each is bounded by the client's deadline).
//
//   LoadGenerator generator(client, request, {.concurrency = 8});
//   LoadResult result = generator.Run([](const LoadProgress& p) { ... });
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "attention.pb.h"
#include "inference/grpc_service.pb.h"
#include "client/cpp/attention_client.h"
#include "client/cli/latency_summary.h"

namespace attention::client {

struct LoadOptions {
  // Closed loop: calls kept in flight. Ignored in open loop. Must be >= 1.
  int concurrency = 1;
  // Open loop: calls started per second; 0 selects the closed loop.
  double rate_rps = 0;
  // Open loop: calls in flight at most; 0 is no limit. Must be >= 0.
  int64_t max_in_flight = 0;
  absl::Duration warmup = absl::Seconds(1);
  // The measured window; must be positive.
  absl::Duration duration = absl::Seconds(10);
};

struct LoadResult {
  // Answers inside the measured window (open loop: answers to the calls due
  // inside it), successful or not.
  int64_t requests = 0;
  // Of those, the failed ones, and their count per status code.
  int64_t errors = 0;
  std::map<absl::StatusCode, int64_t> errors_by_code;
  // Open loop: calls due inside the measured window that were not sent
  // because max_in_flight calls were in flight.
  int64_t skipped = 0;
  // Successful answers per second of the measured window.
  double throughput_rps = 0;
  // Of the successful answers only: an error can come back far faster (or
  // slower) than an answer, and would skew the percentiles.
  LatencySummary latency;
  absl::Duration measured;
};

// A snapshot for a progress line; `warming_up` answers are not counted.
struct LoadProgress {
  absl::Duration elapsed;
  bool warming_up = true;
  int64_t answered = 0;
  int64_t errors = 0;
};

class LoadGenerator {
 public:
  // INVALID_ARGUMENT names the option that is out of range.
  static absl::Status Validate(const LoadOptions& options);

  // `client` and `request` are not owned and must outlive Run().
  LoadGenerator(AttentionClient& client, const attention::v1::AttendRequest& request,
                LoadOptions options);
  // The same load as ModelInfer calls of `request`.
  LoadGenerator(AttentionClient& client, const inference::ModelInferRequest& request,
                LoadOptions options);

  // Runs the load once; `progress` (may be empty) is called on this thread
  // about every `progress_interval` while calls are being started.
  LoadResult Run(const std::function<void(const LoadProgress&)>& progress,
                 absl::Duration progress_interval = absl::Milliseconds(500));

 private:
  using Clock = std::chrono::steady_clock;

  // Starts one call; `latency_from` is when its latency starts counting.
  // Returns false, without starting it, if max_in_flight calls are in flight.
  bool Start(Clock::time_point latency_from);
  // Sends the request once; its answer goes to OnAnswer.
  void Send(Clock::time_point latency_from);
  void OnAnswer(Clock::time_point latency_from, const absl::Status& status);
  // Returns at the given time; meanwhile reports progress.
  using WaitUntil = std::function<void(Clock::time_point)>;
  void RunClosedLoop(const WaitUntil& wait_until);
  void RunOpenLoop(const WaitUntil& wait_until);
  LoadProgress Progress();

  AttentionClient& client_;
  // Exactly one of the two is set.
  const attention::v1::AttendRequest* const attend_request_;
  const inference::ModelInferRequest* const infer_request_;
  const LoadOptions options_;
  Clock::time_point start_, measure_from_, measure_until_;

  std::mutex mu_;
  std::condition_variable idle_;  // signalled when in_flight_ drops to 0
  int64_t in_flight_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t answered_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t skipped_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<absl::StatusCode, int64_t> errors_by_code_ ABSL_GUARDED_BY(mu_);
  std::vector<int64_t> latencies_ns_ ABSL_GUARDED_BY(mu_);
};

}  // namespace attention::client
