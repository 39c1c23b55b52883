// runners.h: how each kind of model runs one group of requests (internal to
// the engine). A runner computes every request of the group together in at
// most three parallel phases: projections over all their tokens, attention
// tasks bounded by each query's allowed keys, and (multi_head) the output
// projection; results[r] answers requests[r].
#pragma once

#include <span>

#include "core/engine/engine.h"
#include "core/engine/request_stop.h"

namespace attention {

class ThreadPool;

namespace internal {

// dot_product, distance and bilinear (run_dot_product.cc).
void RunDotProductFamily(ThreadPool& pool, const Model& model,
                         std::span<const ValidatedRequest> requests,
                         std::span<AttentionResult> results, Stops stops);

// additive (run_additive.cc).
void RunAdditive(ThreadPool& pool, const Model& model, std::span<const ValidatedRequest> requests,
                 std::span<AttentionResult> results, Stops stops);

// multi_head (run_multi_head.cc).
void RunMultiHead(ThreadPool& pool, const Model& model,
                  std::span<const ValidatedRequest> requests, std::span<AttentionResult> results,
                  Stops stops);

}  // namespace internal
}  // namespace attention
