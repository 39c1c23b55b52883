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

}  // namespace attention::internal
