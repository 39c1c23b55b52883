// request.h: one attention request as the engine sees it, and its validation.
//
// Validate() is the single gate between untrusted input and the kernels: it
// checks every fault docs/api.md lists (rank, positive sizes, data length
// versus product(shape) with overflow-safe arithmetic, non-finite values,
// batch and key-count agreement, sizes the model needs, valid_lens form and
// sign, size, work and scratch limits) and returns INVALID_ARGUMENT with a message that names
// the field, the expected and the actual value. Kernels trust what passed it.
#pragma once

#include <cstdint>
#include <optional>
#include <span>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "core/model/model.h"
#include "core/tensor.h"

namespace attention {

// Every member has a default, so a request may name only what it sets.
struct AttentionRequest {
  // dot_product also takes grouped heads, all three tensors 4-D: queries
  // (B, n_q, H, d), keys (B, n_k, H_kv, d), values (B, n_k, H_kv, d_v), with H
  // a multiple of H_kv; output (B, n_q, H, d_v).
  TensorView queries;                // (B, n_q, d_q)
  std::optional<TensorView> keys{};    // (B, n_k, d_k); absent: keys = queries
  std::optional<TensorView> values{};  // (B, n_k, d_v); absent: values = keys
  // Empty: no length mask; B entries: per example; B*n_q entries: per query.
  std::span<const int32_t> valid_lens{};
  bool causal = false;
  bool return_attention_weights = false;
  std::optional<float> scale{};  // replaces the kind's default scale
  // The tokens' positions, for models with rotary positions or ALiBi: empty
  // (0..n_q-1), n_q entries (the same for every example) or B*n_q
  // (row-major). Keys omitted take the queries' positions; keys given take
  // 0..n_k-1.
  std::span<const int64_t> position_ids{};
  // dot_product: key j is allowed for query i only if i - j < sliding_window
  // (unset or 0: no window), and scores are soft-capped to
  // softcap * tanh(s / softcap) (unset or 0: none).
  std::optional<int64_t> sliding_window{};
  std::optional<float> softcap{};
};

// Caps that keep one request from exhausting memory. Defaults suit a server
// with a few GiB per model; 0 disables a cap.
struct Limits {
  // Most float elements in queries + keys + values + output + weights.
  // 2^26 (256 MiB of float32) is attention-server's documented default for
  // --max-request-elements (docs/api.md); this is its only definition.
  int64_t max_request_elements = int64_t{1} << 26;
  // Most work units one request may cost (RequestWork()): 2^34 is about half
  // a second of one AVX-512 core for the built-in kinds, a few seconds on the
  // portable path; the documented default of --max-request-work.
  int64_t max_request_work = int64_t{1} << 34;
  // Most floats of engine scratch one request may need per thread
  // (RequestScratch()): 2^22 (16 MiB), so feature sizes up to about 2^16;
  // the documented default of --max-request-scratch-elements.
  int64_t max_request_scratch_elements = int64_t{1} << 22;
};

// The sizes of a request that passed validation, resolved for the engine.
struct AttentionDims {
  int64_t batch = 0;        // B
  int64_t num_queries = 0;  // n_q
  int64_t num_keys = 0;     // n_k
  int64_t query_size = 0;   // d_q
  int64_t key_size = 0;     // d_k
  int64_t value_size = 0;   // d_v
  int64_t output_size = 0;  // output's elements per query: d_v, E for multi_head, H d_v grouped
  int64_t num_heads = 1;    // heads in attention_weights (1 for single-head kinds)
  // dot_product over grouped heads: 4-D tensors queries (B, n_q, H, d),
  // keys (B, n_k, H_kv, d), values (B, n_k, H_kv, d_v); query_size,
  // key_size and value_size are then one head's.
  bool grouped = false;
  int64_t num_kv_heads = 1;
  float scale = 1.0f;       // resolved: request's scale or the kind's default
  enum class LengthMask { kNone, kPerExample, kPerQuery } length_mask = LengthMask::kNone;

  int64_t output_elements() const { return batch * num_queries * output_size; }
  int64_t weight_elements() const { return batch * num_heads * num_queries * num_keys; }
};

// Work units of a request with sizes `dims` on `model`: one per
// multiply-add of the projections and of the scores and weighted sums, plus
// kSoftmaxWork per score entry (exp and normalisation), and for additive
// models kAdditiveHiddenWork per score entry and hidden unit (a tanh: 12000
// queries of additive_h32 took 20.7 s where dot_product of the same work
// without that weight took 0.5 s). Approximate, and in double so that no
// shape overflows it; used to refuse requests that would hold the engine for
// long (Limits::max_request_work).
inline constexpr double kSoftmaxWork = 16;
inline constexpr double kAdditiveHiddenWork = 128;
double RequestWork(const Model& model, const AttentionDims& dims);
// Floats of per-thread engine scratch the request may need: a block of 64
// query rows as wide as its feature sizes together.
double RequestScratch(const AttentionDims& dims);

// The keys and values a request means, after the self-attention shorthand.
const TensorView& ResolvedKeys(const AttentionRequest& request);
const TensorView& ResolvedValues(const AttentionRequest& request);

// The kind's scale when a request sets none: 1/sqrt(d_q) for dot_product and
// bilinear, the layer's scale or 1/sqrt(head_size) for multi_head, 1 for
// distance and additive.
float DefaultScale(const Model& model, const AttentionDims& dims);

// Validate()'s checks of one tensor, for callers that validate tensors of
// their own (decoding sessions, core/sessions/session.h): the rank (3 unless
// given), positive sizes, data
// length == product(shape) (`axes` names the axes in the message), finite
// values, and one axis's size.
absl::Status CheckTensorShape(absl::string_view field, const TensorView& tensor,
                              absl::string_view axes, size_t rank = 3);
absl::Status CheckTensorFinite(absl::string_view field, const TensorView& tensor);
// INVALID_ARGUMENT "field.shape[axis] (axis_name): expected E (why), got A"
// unless expected == actual.
absl::Status CheckTensorAxis(absl::string_view field, int axis, absl::string_view axis_name,
                             int64_t expected, int64_t actual, absl::string_view why);

// INVALID_ARGUMENT naming the field on any fault; the resolved sizes otherwise.
absl::StatusOr<AttentionDims> Validate(const Model& model, const AttentionRequest& request,
                                       const Limits& limits = {});

}  // namespace attention
