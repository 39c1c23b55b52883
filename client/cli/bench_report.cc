// bench_report.cc: text, JSON and progress output of `bench` (see bench_report.h).
#include "client/cli/bench_report.h"

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"

namespace attention::client {
namespace {

std::string LoadDescription(const LoadOptions& load) {
  if (load.rate_rps == 0) return absl::StrFormat("closed loop at concurrency %d", load.concurrency);
  std::string description = absl::StrFormat("open loop at %g requests/s", load.rate_rps);
  if (load.max_in_flight > 0) {
    absl::StrAppendFormat(&description, " with at most %d in flight", load.max_in_flight);
  }
  return description;
}

}  // namespace

std::string FormatReport(const BenchSetup& setup, const LoadResult& result) {
  std::string report = absl::StrFormat(
      "model %s at %s, %s, measured %g s after %g s of warm-up\n", setup.model, setup.target,
      LoadDescription(setup.load), absl::ToDoubleSeconds(setup.load.duration),
      absl::ToDoubleSeconds(setup.load.warmup));
  if (setup.api != "attention") {
    absl::StrAppendFormat(&report, "  api          %s\n", setup.api);
  }
  absl::StrAppendFormat(&report, "  requests     %d (%d errors)\n", result.requests,
                        result.errors);
  if (result.skipped > 0) {
    absl::StrAppendFormat(&report, "  skipped      %d calls due while %d were in flight\n",
                          result.skipped, setup.load.max_in_flight);
  }
  absl::StrAppendFormat(&report, "  throughput   %.1f requests/s\n", result.throughput_rps);
  const LatencySummary& l = result.latency;
  absl::StrAppendFormat(&report,
                        "  latency ms   p50 %.3f  p90 %.3f  p95 %.3f  p99 %.3f  max %.3f\n",
                        l.p50_ms, l.p90_ms, l.p95_ms, l.p99_ms, l.max_ms);
  if (!result.errors_by_code.empty()) {
    std::vector<std::string> counts;
    for (const auto& [code, count] : result.errors_by_code) {
      counts.push_back(absl::StrCat(absl::StatusCodeToString(code), " ", count));
    }
    absl::StrAppend(&report, "  errors       ", absl::StrJoin(counts, ", "), "\n");
  }
  return report;
}

std::string FormatJson(const BenchSetup& setup, const LoadResult& result) {
  nlohmann::json errors_by_code = nlohmann::json::object();
  for (const auto& [code, count] : result.errors_by_code) {
    errors_by_code[absl::StatusCodeToString(code)] = count;
  }
  const LatencySummary& l = result.latency;
  nlohmann::json json = {
      {"requests", result.requests},
      {"errors", result.errors},
      {"errors_by_code", errors_by_code},
      {"throughput_rps", result.throughput_rps},
      {"latency_ms",
       {{"p50", l.p50_ms}, {"p90", l.p90_ms}, {"p95", l.p95_ms}, {"p99", l.p99_ms},
        {"max", l.max_ms}}},
      {"target", setup.target},
      {"model", setup.model},
      {"api", setup.api},
      {"duration_s", absl::ToDoubleSeconds(setup.load.duration)},
      {"warmup_s", absl::ToDoubleSeconds(setup.load.warmup)},
  };
  if (setup.load.rate_rps > 0) {
    json["rate_rps"] = setup.load.rate_rps;
    json["max_in_flight"] = setup.load.max_in_flight;
    json["skipped"] = result.skipped;
  } else {
    json["concurrency"] = setup.load.concurrency;
  }
  return json.dump();
}

std::string FormatProgress(const BenchSetup& setup, const LoadProgress& progress) {
  const double total_s = absl::ToDoubleSeconds(setup.load.warmup + setup.load.duration);
  return absl::StrFormat("%5.1f / %.1f s  %s  %d answered  %d errors",
                         absl::ToDoubleSeconds(progress.elapsed), total_s,
                         progress.warming_up ? "warming up" : "measuring ", progress.answered,
                         progress.errors);
}

}  // namespace attention::client
