// flash_terms.h: the attention kernel of problems with score terms or a
// sliding window (flash_kernel.h, ScoreTerms and KeyBounds::window).
#pragma once

#include <cstdint>

#include "core/kernels/flash_kernel.h"

namespace attention::internal {

// FlashAttention (weights null) or AttentionWithWeights for a problem with
// has_terms(). Query biases, key biases and the distance kind are not
// terms' companions: such problems never have terms.
bool TermsAttention(const FlashProblem& problem, int64_t query_begin, int64_t query_end,
                    float* weights, int64_t weights_stride);

// FlashAttentionOverKeys and MergeKeyRanges' last step for such a problem:
// rows [row, row + rows) over keys [key_begin, key_end) into `part`; and
// the output of those rows from their merged max, sum and accumulator
// (rows x value_size), with the sink and the rows that take the exact path.
bool TermsOverKeys(const FlashProblem& problem, int64_t row, int64_t rows, int64_t key_begin,
                   int64_t key_end, const KeyRangePart& part);
void TermsFinish(const FlashProblem& problem, int64_t row, int64_t rows, const float* max,
                 const float* sum, const float* accumulator);

}  // namespace attention::internal
