// positions.h: what Hugging Face's layers do to the projected queries and
// keys before the scores (internal to the engine): qk-norm (RMSNorm), then
// rotary positions (core/model/layer_terms.h), row by row at each token's
// position; the positions a request gives its tokens; and each head's score
// terms.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "core/engine/engine.h"
#include "core/kernels/flash_kernel.h"
#include "core/model/layer_terms.h"

namespace attention {

class ThreadPool;

namespace internal {

// Rows of one projection: `count` rows of `heads` heads of `head_size`
// columns each, row stride `stride`.
struct ProjectedRows {
  float* rows = nullptr;
  int64_t stride = 0;
  int64_t count = 0;
  int64_t heads = 0;
  const std::vector<float>* norm = nullptr;  // q_norm or k_norm (empty: none)
};

// Whether a model's layer changes its projected queries or keys.
bool TransformsRows(const LayerTerms& terms);

// RMSNorm (terms.norm_eps) with each part's norm, then rotary, on every row
// of `parts`; row r of each part is at positions[r]. Rows are spread over
// the pool.
void PositionRows(ThreadPool& pool, const LayerTerms& terms, int64_t head_size,
                  std::span<const ProjectedRows> parts, std::span<const int64_t> positions);

// The score terms of query head h of a layer (its slope, sink, soft-cap).
ScoreTerms HeadTerms(const LayerTerms& terms, int64_t h);

// The positions of example b's n rows: its position_ids (n for every
// example, or B*n row-major) or 0..n-1.
void AppendPositions(const AttentionRequest& request, int64_t b, int64_t n,
                     std::vector<int64_t>& positions);

}  // namespace internal
}  // namespace attention
