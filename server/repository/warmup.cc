// warmup.cc: sizing and computing the warm-up batch.
#include "server/repository/warmup.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace attention::server {
namespace {

// Beyond any limit a server would set; ends the search when every cap is 0.
constexpr int64_t kMostTokens = int64_t{1} << 24;

// The sizes of one warm-up request with n queries and n keys.
AttentionDims DimsFor(const Model& model, int64_t n) {
  AttentionDims dims;
  dims.batch = 1;
  dims.num_queries = n;
  dims.num_keys = n;
  dims.query_size = model.query_size != 0 ? model.query_size : kAnySizeFeatures;
  dims.key_size = model.key_size != 0 ? model.key_size : dims.query_size;
  dims.value_size = model.value_size != 0 ? model.value_size : kAnySizeFeatures;
  dims.output_size = model.output_size != 0 ? model.output_size : dims.value_size;
  dims.num_heads = model.kind == Kind::kMultiHead ? model.num_heads : 1;
  return dims;
}

bool Fits(const Model& model, const AttentionDims& dims, const Limits& limits,
          double work_per_request) {
  const double elements =
      static_cast<double>(dims.num_queries) * (dims.query_size + dims.output_size) +
      static_cast<double>(dims.num_keys) * (dims.key_size + dims.value_size);
  return (limits.max_request_elements == 0 || elements <= limits.max_request_elements) &&
         RequestWork(model, dims) <= work_per_request;
}

// The largest power-of-two token count whose request fits, or 0: none does.
int64_t LargestFitting(const Model& model, const Limits& limits, double work_per_request) {
  if (limits.max_request_work != 0) {
    work_per_request = std::min(work_per_request, static_cast<double>(limits.max_request_work));
  }
  if (!Fits(model, DimsFor(model, 1), limits, work_per_request)) return 0;
  int64_t n = 1;
  while (n < kMostTokens && Fits(model, DimsFor(model, 2 * n), limits, work_per_request)) n *= 2;
  return n;
}

// Deterministic, finite inputs in [-1, 1]: the values do not matter, only
// that the kernels run as they do for real requests.
std::vector<float> Inputs(int64_t count) {
  std::vector<float> data(static_cast<size_t>(count));
  for (size_t i = 0; i < data.size(); ++i) data[i] = std::sin(static_cast<float>(i) * 0.37f);
  return data;
}

// `count` requests of n queries and n keys computed as one batch.
absl::StatusOr<WarmUpRun> Run(Engine& engine, const Model& model, const Limits& limits,
                              int64_t count, int64_t n) {
  const AttentionDims sizes = DimsFor(model, n);
  const std::vector<float> queries = Inputs(n * sizes.query_size);
  const std::vector<float> keys = Inputs(n * sizes.key_size);
  const std::vector<float> values = Inputs(n * sizes.value_size);
  AttentionRequest request;
  request.queries = {{1, n, sizes.query_size}, queries};
  request.keys = TensorView{{1, n, sizes.key_size}, keys};
  request.values = TensorView{{1, n, sizes.value_size}, values};
  absl::StatusOr<AttentionDims> dims = Validate(model, request, limits);
  if (!dims.ok()) return dims.status();
  const std::vector<ValidatedRequest> batch(static_cast<size_t>(count),
                                            ValidatedRequest{.request = &request, .dims = *dims});
  std::vector<AttentionResult> results(batch.size());
  try {
    engine.Run(model, batch, results);
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat("the engine failed: ", e.what()));
  }
  for (const AttentionResult& result : results) {
    if (!result.status.ok()) return result.status;
  }
  return WarmUpRun{.requests = count, .dims = *dims};
}

}  // namespace

absl::StatusOr<WarmUpReport> WarmUp(Engine& engine, const Model& model,
                                    const WarmUpOptions& options) {
  const int64_t batch_size = std::max<int64_t>(options.batch_size, 1);
  // With batching, half the budget for the batch and half for one large
  // request: a batch's requests are small, and a lone large request needs
  // scratch of its own (each request over the engine's group bound is a
  // group of its own).
  const bool lone_request = batch_size > 1;
  const double share = static_cast<double>(options.work_budget) / (lone_request ? 2 : 1);
  const int64_t batch_tokens = LargestFitting(model, options.limits, share / batch_size);
  if (batch_tokens == 0) {
    return absl::FailedPreconditionError(
        "no request of one query and one key fits the limits and the warm-up work budget");
  }
  std::vector<std::pair<int64_t, int64_t>> plan = {{batch_size, batch_tokens}};
  if (lone_request) {
    const int64_t lone_tokens = LargestFitting(model, options.limits, share);
    if (lone_tokens > batch_tokens) plan.emplace_back(1, lone_tokens);
  }
  WarmUpReport report;
  const absl::Time start = absl::Now();
  for (const auto& [count, n] : plan) {
    absl::StatusOr<WarmUpRun> run = Run(engine, model, options.limits, count, n);
    if (!run.ok()) return run.status();
    report.runs.push_back(*run);
  }
  report.took = absl::Now() - start;
  return report;
}

}  // namespace attention::server
