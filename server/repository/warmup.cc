// warmup.cc: sizing and computing the warm-up batch.
#include "server/repository/warmup.h"

#include <algorithm>
#include <cmath>
#include <limits>
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

// Deterministic, finite inputs in [-1, 1]: the values do not matter, only
// that the kernels run as they do for real requests.
std::vector<float> Inputs(int64_t count) {
  std::vector<float> data(static_cast<size_t>(count));
  for (size_t i = 0; i < data.size(); ++i) data[i] = std::sin(static_cast<float>(i) * 0.37f);
  return data;
}

}  // namespace

absl::StatusOr<WarmUpReport> WarmUp(Engine& engine, const Model& model,
                                    const WarmUpOptions& options) {
  const int64_t batch_size = std::max<int64_t>(options.batch_size, 1);
  double work_per_request = static_cast<double>(options.work_budget) / batch_size;
  if (options.limits.max_request_work != 0) {
    work_per_request = std::min(work_per_request, static_cast<double>(options.limits.max_request_work));
  }
  if (!Fits(model, DimsFor(model, 1), options.limits, work_per_request)) {
    return absl::FailedPreconditionError(
        "no request of one query and one key fits the limits and the warm-up work budget");
  }
  int64_t n = 1;
  while (n < kMostTokens && Fits(model, DimsFor(model, 2 * n), options.limits, work_per_request)) {
    n *= 2;
  }
  const AttentionDims sizes = DimsFor(model, n);
  const std::vector<float> queries = Inputs(n * sizes.query_size);
  const std::vector<float> keys = Inputs(n * sizes.key_size);
  const std::vector<float> values = Inputs(n * sizes.value_size);
  AttentionRequest request;
  request.queries = {{1, n, sizes.query_size}, queries};
  request.keys = TensorView{{1, n, sizes.key_size}, keys};
  request.values = TensorView{{1, n, sizes.value_size}, values};
  absl::StatusOr<AttentionDims> dims = Validate(model, request, options.limits);
  if (!dims.ok()) return dims.status();

  const std::vector<ValidatedRequest> batch(static_cast<size_t>(batch_size),
                                            ValidatedRequest{.request = &request, .dims = *dims});
  std::vector<AttentionResult> results(batch.size());
  const absl::Time start = absl::Now();
  try {
    engine.Run(model, batch, results);
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat("the engine failed: ", e.what()));
  }
  const absl::Duration took = absl::Now() - start;
  for (const AttentionResult& result : results) {
    if (!result.status.ok()) return result.status;
  }
  return WarmUpReport{.batch_size = batch_size, .dims = *dims, .took = took};
}

}  // namespace attention::server
