// request_generator.h: a synthetic AttendRequest for load tests, so `bench`
// needs no request file: random normal queries, keys and values (fixed seed,
// so runs are comparable) shaped for the model, or queries alone for
// self-attention (docs/api.md section 2.4).
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "attention.pb.h"

namespace attention::client {

struct GeneratedRequestShape {
  std::string model = "dot_product";
  int64_t batch = 1;  // B
  int64_t n = 128;    // n_q = n_k
  // d_q = d_k = d_v for models that take any size (the built-ins).
  int64_t dim = 64;
  bool causal = false;
  // Queries only: keys and values are left out, so the server runs
  // self-attention (Q = K = V) and a multi_head model its fused Q/K/V
  // projection. Needs d_q = d_k = d_v.
  bool self_attention = false;
};

// `model` is the server's description of shape.model: its own input sizes,
// where not 0, replace `dim`. INVALID_ARGUMENT names a size below 1, a
// request above 2^28 floats, or self-attention for a model whose input sizes
// differ.
absl::StatusOr<attention::v1::AttendRequest> GenerateRequest(
    const GeneratedRequestShape& shape, const attention::v1::ModelInfo& model);

}  // namespace attention::client
