// request.h: one attention request as the engine sees it, and its validation.
//
// Validate() is the single gate between untrusted input and the kernels: it
// checks every fault docs/api.md lists (rank, positive sizes, data length
// versus product(shape) with overflow-safe arithmetic, non-finite values,
// batch and key-count agreement, sizes the model needs, valid_lens form and
// sign, size limits) and returns INVALID_ARGUMENT with a message that names
// the field, the expected and the actual value. Kernels trust what passed it.
#pragma once

#include <cstdint>
#include <optional>
#include <span>

#include "absl/status/statusor.h"
#include "core/model.h"
#include "core/tensor.h"

namespace attention {

struct AttentionRequest {
  TensorView queries;                // (B, n_q, d_q)
  std::optional<TensorView> keys;    // (B, n_k, d_k); absent: keys = queries
  std::optional<TensorView> values;  // (B, n_k, d_v); absent: values = keys
  // Empty: no length mask; B entries: per example; B*n_q entries: per query.
  std::span<const int32_t> valid_lens;
  bool causal = false;
  bool return_attention_weights = false;
  std::optional<float> scale;  // replaces the kind's default scale
};

// Caps that keep one request from exhausting memory. Defaults suit a server
// with a few GiB per model; 0 disables a cap.
struct Limits {
  // Most float elements in queries + keys + values + output + weights.
  int64_t max_request_elements = int64_t{1} << 28;  // 1 GiB of float32
};

// The sizes of a request that passed validation, resolved for the engine.
struct AttentionDims {
  int64_t batch = 0;        // B
  int64_t num_queries = 0;  // n_q
  int64_t num_keys = 0;     // n_k
  int64_t query_size = 0;   // d_q
  int64_t key_size = 0;     // d_k
  int64_t value_size = 0;   // d_v
  int64_t output_size = 0;  // last axis of output: d_v, or E for multi_head
  int64_t num_heads = 1;    // heads in attention_weights (1 for single-head kinds)
  float scale = 1.0f;       // resolved: request's scale or the kind's default
  enum class LengthMask { kNone, kPerExample, kPerQuery } length_mask = LengthMask::kNone;

  int64_t output_elements() const { return batch * num_queries * output_size; }
  int64_t weight_elements() const { return batch * num_heads * num_queries * num_keys; }
};

// The keys and values a request means, after the self-attention shorthand.
const TensorView& ResolvedKeys(const AttentionRequest& request);
const TensorView& ResolvedValues(const AttentionRequest& request);

// INVALID_ARGUMENT naming the field on any fault; the resolved sizes otherwise.
absl::StatusOr<AttentionDims> Validate(const Model& model, const AttentionRequest& request,
                                       const Limits& limits = {});

}  // namespace attention
