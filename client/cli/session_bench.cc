// session_bench.cc: concurrent AttendSession streams and their report.
#include "client/cli/session_bench.h"

#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "nlohmann/json.hpp"

namespace attention::client {
namespace {

using attention::v1::SessionRequest;
using attention::v1::SessionResponse;

// What one session's thread measured.
struct SessionTally {
  std::vector<int64_t> latencies_ns;
  int64_t steps = 0;
  std::map<absl::StatusCode, int64_t> errors_by_code;
};

// One step's request: (1, tokens, dim) normal values, fixed seed per session.
SessionRequest StepRequest(int tokens, int64_t dim, std::mt19937& rng) {
  std::normal_distribution<float> normal;
  SessionRequest request;
  attention::v1::Tensor* queries = request.mutable_step()->mutable_queries();
  queries->add_shape(1);
  queries->add_shape(tokens);
  queries->add_shape(dim);
  for (int64_t i = 0; i < tokens * dim; ++i) queries->add_data(normal(rng));
  return request;
}

// Distinct step requests a session cycles through, at most, and the bytes
// of rows all sessions' requests may hold together (at least one request
// each). They are made before the clock starts, so that the client's CPU
// over the run is what any client spends on a step (writing, sending,
// waiting, reading), not drawing a token's normal values.
constexpr int64_t kStepRequests = 8;
constexpr int64_t kStepRequestBytes = int64_t{64} << 20;

std::vector<SessionRequest> StepRequests(const SessionBenchOptions& options, int64_t dim,
                                         int seed) {
  const int64_t bytes = int64_t{options.tokens_per_step} * dim * sizeof(float) * options.sessions;
  const int64_t count = std::clamp<int64_t>(kStepRequestBytes / std::max<int64_t>(bytes, 1), 1,
                                            std::min<int64_t>(kStepRequests, options.steps));
  std::mt19937 rng(seed);
  std::vector<SessionRequest> requests;
  for (int64_t i = 0; i < count; ++i) {
    requests.push_back(StepRequest(options.tokens_per_step, dim, rng));
  }
  return requests;
}

// User plus system CPU of this process so far.
absl::Duration ProcessCpu() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return absl::DurationFromTimeval(usage.ru_utime) + absl::DurationFromTimeval(usage.ru_stime);
}

absl::StatusCode CodeOf(const SessionResponse& response) {
  return static_cast<absl::StatusCode>(response.error().code());
}

// Opens one session and steps it; every failure is tallied, not raised.
void RunOneSession(AttentionClient& client, const SessionBenchOptions& options,
                   const std::vector<SessionRequest>& steps, SessionTally& tally) {
  grpc::ClientContext context;
  auto stream = client.AttendSession(context);
  SessionRequest open;
  open.mutable_open()->set_model(options.model);
  SessionResponse response;
  if (!stream->Write(open) || !stream->Read(&response) || response.has_error()) {
    ++tally.errors_by_code[response.has_error() ? CodeOf(response)
                                                : absl::StatusCode::kUnavailable];
    stream->WritesDone();
    static_cast<void>(stream->Finish());
    return;
  }
  for (int step = 0; step < options.steps; ++step) {
    const SessionRequest& request = steps[step % steps.size()];
    const auto start = std::chrono::steady_clock::now();
    if (!stream->Write(request) || !stream->Read(&response)) {
      ++tally.errors_by_code[absl::StatusCode::kUnavailable];
      break;
    }
    ++tally.steps;
    if (response.has_error()) {
      ++tally.errors_by_code[CodeOf(response)];
      continue;
    }
    tally.latencies_ns.push_back(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                     std::chrono::steady_clock::now() - start)
                                     .count());
  }
  stream->WritesDone();
  static_cast<void>(stream->Finish());
}

}  // namespace

absl::Status ValidateSessionBench(const SessionBenchOptions& options) {
  for (const auto& [name, value] : {std::pair<const char*, int64_t>{"--sessions", options.sessions},
                                    {"--steps-per-session", options.steps},
                                    {"--tokens-per-step", options.tokens_per_step},
                                    {"--dim", options.dim}}) {
    if (value < 1) {
      return absl::InvalidArgumentError(absl::StrCat(name, " must be >= 1; got ", value));
    }
  }
  return absl::OkStatus();
}

SessionBenchResult RunSessions(AttentionClient& client, const SessionBenchOptions& options,
                               int64_t model_query_size) {
  const int64_t dim = model_query_size > 0 ? model_query_size : options.dim;
  std::vector<SessionTally> tallies(options.sessions);
  std::vector<std::vector<SessionRequest>> steps;
  for (int s = 0; s < options.sessions; ++s) steps.push_back(StepRequests(options, dim, s + 1));
  const absl::Duration cpu_start = ProcessCpu();
  const absl::Time start = absl::Now();
  {
    std::vector<std::jthread> threads;
    for (int s = 0; s < options.sessions; ++s) {
      threads.emplace_back([&, s] { RunOneSession(client, options, steps[s], tallies[s]); });
    }
  }
  SessionBenchResult result;
  result.wall = absl::Now() - start;
  result.client_cpu = ProcessCpu() - cpu_start;
  std::vector<int64_t> latencies;
  for (SessionTally& tally : tallies) {
    result.steps += tally.steps;
    for (const auto& [code, count] : tally.errors_by_code) {
      result.errors_by_code[code] += count;
      result.errors += count;
    }
    latencies.insert(latencies.end(), tally.latencies_ns.begin(), tally.latencies_ns.end());
  }
  const double seconds = absl::ToDoubleSeconds(result.wall);
  result.steps_per_second = seconds > 0 ? static_cast<double>(latencies.size()) / seconds : 0;
  result.tokens_per_second = result.steps_per_second * options.tokens_per_step;
  const double tokens = static_cast<double>(latencies.size()) * options.tokens_per_step;
  result.client_cpu_us_per_token =
      tokens > 0 ? absl::ToDoubleMicroseconds(result.client_cpu) / tokens : 0;
  result.step_latency = Summarize(latencies);
  return result;
}

std::string FormatSessionReport(const std::string& target, const SessionBenchOptions& options,
                                const SessionBenchResult& result) {
  const LatencySummary& l = result.step_latency;
  std::string report = absl::StrFormat(
      "target %s  model %s  sessions %d  steps/session %d  tokens/step %d\n"
      "steps %d  errors %d  wall %.3f s\n"
      "steps/s %.1f  tokens/s %.1f\n"
      "client CPU %.3f s  (%.1f us per token)\n"
      "step latency ms  p50 %.3f  p90 %.3f  p95 %.3f  p99 %.3f  max %.3f\n",
      target, options.model, options.sessions, options.steps, options.tokens_per_step,
      result.steps, result.errors, absl::ToDoubleSeconds(result.wall), result.steps_per_second,
      result.tokens_per_second, absl::ToDoubleSeconds(result.client_cpu),
      result.client_cpu_us_per_token, l.p50_ms, l.p90_ms, l.p95_ms, l.p99_ms, l.max_ms);
  for (const auto& [code, count] : result.errors_by_code) {
    absl::StrAppend(&report, "  ", absl::StatusCodeToString(code), ": ", count, "\n");
  }
  return report;
}

std::string FormatSessionJson(const std::string& target, const SessionBenchOptions& options,
                              const SessionBenchResult& result) {
  nlohmann::json errors_by_code = nlohmann::json::object();
  for (const auto& [code, count] : result.errors_by_code) {
    errors_by_code[absl::StatusCodeToString(code)] = count;
  }
  const LatencySummary& l = result.step_latency;
  return nlohmann::json{
      {"target", target},
      {"model", options.model},
      {"sessions", options.sessions},
      {"steps_per_session", options.steps},
      {"tokens_per_step", options.tokens_per_step},
      {"steps", result.steps},
      {"errors", result.errors},
      {"errors_by_code", errors_by_code},
      {"wall_s", absl::ToDoubleSeconds(result.wall)},
      {"steps_per_s", result.steps_per_second},
      {"tokens_per_s", result.tokens_per_second},
      {"client_cpu_s", absl::ToDoubleSeconds(result.client_cpu)},
      {"client_cpu_us_per_token", result.client_cpu_us_per_token},
      {"step_latency_ms",
       {{"p50", l.p50_ms}, {"p90", l.p90_ms}, {"p95", l.p95_ms}, {"p99", l.p99_ms},
        {"max", l.max_ms}}}}
      .dump();
}

}  // namespace attention::client
