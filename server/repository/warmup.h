// warmup.h: one batch through a model before it serves (docs/api.md 6.9).
//
// The first batch a model version computes pays for what nothing before it
// touched: the engine's per-thread scratch growing to the request's sizes,
// first-touch page faults of the weights, packed projections and output
// buffers, and the worker threads waking. WarmUp() pays it before the
// version is served: it runs one batch of --max-batch-size requests, each
// of the largest power-of-two token count (B = 1, n_q = n_k) that the
// request limits allow, with the whole batch's work within a budget.
// Models of any size (the built-ins) are warmed at feature size
// kAnySizeFeatures.
#pragma once

#include <cstdint>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "core/engine/engine.h"
#include "core/model/model.h"
#include "core/engine/request.h"

namespace attention::server {

// Feature sizes (d_q, d_k, d_v) a warm-up uses where the model accepts any.
inline constexpr int64_t kAnySizeFeatures = 64;

struct WarmUpOptions {
  Limits limits;             // the server's per-request limits
  int64_t batch_size = 1;    // requests in the batch: --max-batch-size
  int64_t work_budget = 0;   // most work units (RequestWork) of the batch together
};

// What one warm-up did, for the log.
struct WarmUpReport {
  int64_t batch_size = 0;
  AttentionDims dims;  // of each request
  absl::Duration took;
};

// Computes the warm-up batch on `model` with `engine`. An error when no
// request the limits allow fits (the model still serves) or when the engine
// failed.
absl::StatusOr<WarmUpReport> WarmUp(Engine& engine, const Model& model,
                                    const WarmUpOptions& options);

}  // namespace attention::server
