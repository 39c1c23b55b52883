// latency_summary.h: the percentiles a load test reports, from raw samples.
#pragma once

#include <cstdint>
#include <vector>

namespace attention::client {

struct LatencySummary {
  // Milliseconds; all 0 when there was no sample.
  double p50_ms = 0, p90_ms = 0, p95_ms = 0, p99_ms = 0, max_ms = 0;
};

// Nearest-rank percentiles (the smallest sample with at least p% of the
// samples at or below it) of `latencies_ns`, which it sorts.
LatencySummary Summarize(std::vector<int64_t>& latencies_ns);

}  // namespace attention::client
