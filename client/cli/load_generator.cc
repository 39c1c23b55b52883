// load_generator.cc: closed- and open-loop load (see load_generator.h).
#include "client/cli/load_generator.h"

#include <algorithm>
#include <cmath>
#include <thread>

#include "absl/strings/str_cat.h"

namespace attention::client {
namespace {

int64_t SumOfCounts(const std::map<absl::StatusCode, int64_t>& counts) {
  int64_t sum = 0;
  for (const auto& [code, count] : counts) sum += count;
  return sum;
}

}  // namespace

absl::Status LoadGenerator::Validate(const LoadOptions& options) {
  if (!(options.rate_rps >= 0) || !std::isfinite(options.rate_rps)) {
    return absl::InvalidArgumentError(
        absl::StrCat("rate must be >= 0 requests/s; was ", options.rate_rps));
  }
  if (options.rate_rps == 0 && options.concurrency < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("concurrency must be >= 1; was ", options.concurrency));
  }
  if (options.max_in_flight < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("max in flight must be >= 0; was ", options.max_in_flight));
  }
  if (options.rate_rps == 0 && options.max_in_flight != 0) {
    return absl::InvalidArgumentError("max in flight applies to the open loop (rate > 0) only");
  }
  if (options.duration <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "duration must be positive; was ", absl::FormatDuration(options.duration)));
  }
  if (options.warmup < absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "warmup must be >= 0; was ", absl::FormatDuration(options.warmup)));
  }
  return absl::OkStatus();
}

LoadGenerator::LoadGenerator(AttentionClient& client,
                             const attention::v1::AttendRequest& request,
                             LoadOptions options)
    : client_(client), attend_request_(&request), infer_request_(nullptr), options_(options) {}

LoadGenerator::LoadGenerator(AttentionClient& client,
                             const inference::ModelInferRequest& request, LoadOptions options)
    : client_(client), attend_request_(nullptr), infer_request_(&request), options_(options) {}

void LoadGenerator::Send(Clock::time_point latency_from) {
  if (infer_request_ != nullptr) {
    client_.InferAsync(infer_request_,
                       [this, latency_from](absl::StatusOr<inference::ModelInferResponse> answer) {
                         OnAnswer(latency_from, answer.status());
                       });
    return;
  }
  client_.AttendAsync(attend_request_,
                      [this, latency_from](absl::StatusOr<attention::v1::AttendResponse> answer) {
                        OnAnswer(latency_from, answer.status());
                      });
}

bool LoadGenerator::Start(Clock::time_point latency_from) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (options_.max_in_flight > 0 && in_flight_ >= options_.max_in_flight) return false;
    ++in_flight_;
  }
  Send(latency_from);
  return true;
}

void LoadGenerator::OnAnswer(Clock::time_point latency_from, const absl::Status& status) {
  const Clock::time_point now = Clock::now();
  // In the closed loop an answer hands its slot to the next call, so the
  // number in flight stays `concurrency` until the window closes.
  const bool start_next = options_.rate_rps == 0 && now < measure_until_;
  {
    std::lock_guard<std::mutex> lock(mu_);
    const Clock::time_point counted_at = options_.rate_rps > 0 ? latency_from : now;
    if (counted_at >= measure_from_ && counted_at <= measure_until_) {
      ++answered_;
      if (status.ok()) {
        latencies_ns_.push_back(
            std::chrono::duration_cast<std::chrono::nanoseconds>(now - latency_from).count());
      } else {
        ++errors_by_code_[status.code()];
      }
    }
    if (!start_next && --in_flight_ == 0) idle_.notify_all();
  }
  if (start_next) Send(now);
}

LoadProgress LoadGenerator::Progress() {
  const Clock::time_point now = Clock::now();
  std::lock_guard<std::mutex> lock(mu_);
  return {.elapsed = absl::FromChrono(now - start_),
          .warming_up = now < measure_from_,
          .answered = answered_,
          .errors = SumOfCounts(errors_by_code_)};
}

void LoadGenerator::RunClosedLoop(const WaitUntil& wait_until) {
  for (int i = 0; i < options_.concurrency; ++i) Start(Clock::now());
  wait_until(measure_until_);
}

void LoadGenerator::RunOpenLoop(const WaitUntil& wait_until) {
  const std::chrono::duration<double> period(1.0 / options_.rate_rps);
  for (int64_t i = 0;; ++i) {
    const Clock::time_point at =
        start_ + std::chrono::duration_cast<Clock::duration>(period * static_cast<double>(i));
    if (at >= measure_until_) break;
    wait_until(at);
    if (!Start(at) && at >= measure_from_) {
      std::lock_guard<std::mutex> lock(mu_);
      ++skipped_;
    }
  }
}

LoadResult LoadGenerator::Run(const std::function<void(const LoadProgress&)>& progress,
                              absl::Duration progress_interval) {
  start_ = Clock::now();
  measure_from_ = start_ + absl::ToChronoNanoseconds(options_.warmup);
  measure_until_ = measure_from_ + absl::ToChronoNanoseconds(options_.duration);

  // Sleeps until `until`, reporting progress on the way whenever it is due.
  Clock::time_point next_report = start_ + absl::ToChronoNanoseconds(progress_interval);
  const WaitUntil wait_until = [&](Clock::time_point until) {
    while (Clock::now() < until) {
      std::this_thread::sleep_until(progress ? std::min(until, next_report) : until);
      if (progress && Clock::now() >= next_report) {
        progress(Progress());
        next_report += absl::ToChronoNanoseconds(progress_interval);
      }
    }
  };
  if (options_.rate_rps > 0) {
    RunOpenLoop(wait_until);
  } else {
    RunClosedLoop(wait_until);
  }

  std::unique_lock<std::mutex> lock(mu_);
  idle_.wait(lock, [this] { return in_flight_ == 0; });
  LoadResult result;
  result.requests = answered_;
  result.errors_by_code = errors_by_code_;
  result.errors = SumOfCounts(errors_by_code_);
  result.skipped = skipped_;
  result.measured = options_.duration;
  result.throughput_rps =
      static_cast<double>(latencies_ns_.size()) / absl::ToDoubleSeconds(options_.duration);
  result.latency = Summarize(latencies_ns_);
  return result;
}

}  // namespace attention::client
