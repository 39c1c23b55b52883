// bench_report.h: how `attention-client bench` shows a LoadResult: a text
// report for people, one JSON object for scripts, and the progress line.
#pragma once

#include <string>

#include "client/cli/load_generator.h"

namespace attention::client {

// What was run, for the report's heading and the JSON's echo of it.
struct BenchSetup {
  std::string target;
  std::string model;
  // "attention" (Attend) or "inference" (ModelInfer).
  std::string api = "attention";
  LoadOptions load;
};

// Several lines: the setup, requests and errors, throughput, latency
// percentiles, and the errors per status code.
std::string FormatReport(const BenchSetup& setup, const LoadResult& result);

// One line of JSON: requests, errors (a count), errors_by_code (code name ->
// count), throughput_rps, latency_ms {p50, p90, p95, p99, max}, and the setup
// (api included).
std::string FormatJson(const BenchSetup& setup, const LoadResult& result);

// One line without a newline, for redrawing in place on a terminal.
std::string FormatProgress(const BenchSetup& setup, const LoadProgress& progress);

}  // namespace attention::client
