// reference_attention.h: the math of docs/api.md in plain loops, for tests only.
//
// Deliberately naive and independent of core/'s kernels: full score matrices,
// -1e6 replacement, max-subtracted softmax in double, then weights . values.
#pragma once

#include "core/engine/engine.h"

namespace attention::testing {

// Computes `request` for `model` the slow, obvious way. The request must be
// valid; weights are always returned.
AttentionResult ReferenceAttention(const Model& model, const AttentionRequest& request);

}  // namespace attention::testing
