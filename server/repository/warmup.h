// warmup.h: a model's usual first calls computed before it serves (docs/api.md 6.9).
//
// The first calls a model version computes pay for what nothing before them
// touched: the engine's kept scratch growing to their sizes (lent to every
// call whatever thread makes it: core/engine/group_scratch.h), each engine
// thread's own scratch, first-touch page faults of the weights and packed
// projections, and the worker threads waking. WarmUp() pays it before the
// version is served, in two runs on the engine: a batch of --max-batch-size
// requests, each of the largest power-of-two token count (B = 1, n_q = n_k)
// that the request limits and half the work budget allow, then one request
// as large as the other half allows (a batch of one: the whole budget).
// Models of any size (the built-ins) are warmed at feature size
// kAnySizeFeatures.
#pragma once

#include <cstdint>
#include <vector>

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
  int64_t work_budget = 0;   // most work units (RequestWork) of all the runs together
};

// One run of a warm-up: `requests` requests of `dims` each.
struct WarmUpRun {
  int64_t requests = 0;
  AttentionDims dims;
};

// What one warm-up did, for the log.
struct WarmUpReport {
  std::vector<WarmUpRun> runs;  // in the order computed
  absl::Duration took;          // of all of them
};

// Computes the warm-up runs on `model` with `engine`. An error when no
// request the limits allow fits the batch's share of the budget (the model
// still serves) or when the engine failed.
absl::StatusOr<WarmUpReport> WarmUp(Engine& engine, const Model& model,
                                    const WarmUpOptions& options);

}  // namespace attention::server
