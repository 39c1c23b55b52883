// latency_summary.cc: nearest-rank percentiles (see latency_summary.h).
#include "client/cli/latency_summary.h"

#include <algorithm>
#include <cmath>

namespace attention::client {
namespace {

constexpr double kNanosPerMilli = 1e6;

// Sample at rank ceil(p/100 * n), counted from 1, of sorted `samples`.
double PercentileMs(const std::vector<int64_t>& samples, double p) {
  const auto n = static_cast<double>(samples.size());
  const auto rank = static_cast<size_t>(std::max(1.0, std::ceil(p / 100.0 * n)));
  return static_cast<double>(samples[rank - 1]) / kNanosPerMilli;
}

}  // namespace

LatencySummary Summarize(std::vector<int64_t>& latencies_ns) {
  if (latencies_ns.empty()) return {};
  std::sort(latencies_ns.begin(), latencies_ns.end());
  return {.p50_ms = PercentileMs(latencies_ns, 50),
          .p90_ms = PercentileMs(latencies_ns, 90),
          .p95_ms = PercentileMs(latencies_ns, 95),
          .p99_ms = PercentileMs(latencies_ns, 99),
          .max_ms = static_cast<double>(latencies_ns.back()) / kNanosPerMilli};
}

}  // namespace attention::client
