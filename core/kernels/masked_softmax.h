// masked_softmax.h: the masked softmax of docs/api.md for one row of scores.
//
// This is the book's `masked_softmax` on one row: keys at or past `bound` are
// disallowed, their score is *replaced* by -1e6, then softmax over all n_k
// keys. Used wherever a row of scores is materialised (the additive kind,
// whose scores are not a GEMM, and the fused kernel's exact path), so the
// -1e6 rule lives in one place.
#pragma once

#include <cstdint>
#include <span>

namespace attention {

// The score a disallowed (query, key) pair gets (docs/api.md).
inline constexpr float kMaskedScore = -1e6f;

// Turns row[0, bound) (scores; the rest is ignored) into the weights of all
// n_k = row.size() keys. Returns how many leading weights may be nonzero: bound
// normally; n_k when masked keys carry weight (bound 0 gives uniform weights,
// and allowed scores near -1e6 leave masked keys a share too).
int64_t MaskedSoftmaxRow(std::span<float> row, int64_t bound);

}  // namespace attention
