// model.h: what an attention model is to the engine.
//
// A model is a scoring function (its kind) plus the weights that function
// needs. The two built-ins, `dot_product` and `distance`, have no weights and
// accept any sizes. File models are made by LoadModel() (model_loader.h); both
// multi-head layouts (d2l and torch.nn.MultiheadAttention) are normalised to
// one set of projections here, so the kernels see a single layout.
//
// Weights are stored as PyTorch stores them: [out, in], y = x W^T + b.
#pragma once

#include <Eigen/Core>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "core/packed_weights.h"

namespace attention {

using RowMatrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using Vector = Eigen::VectorXf;

enum class Kind { kDotProduct, kDistance, kAdditive, kBilinear, kMultiHead };

// The name of a kind in docs/api.md: "dot_product", "distance", "additive",
// "bilinear", "multi_head".
std::string_view KindName(Kind kind);
std::optional<Kind> KindFromName(std::string_view name);

struct Model {
  std::string name;
  Kind kind = Kind::kDotProduct;

  // Sizes a request must have; 0 = any (the built-ins, and value_size of
  // additive and bilinear models, which use values as they come).
  int64_t num_heads = 0;    // multi_head: H
  int64_t query_size = 0;   // d_q
  int64_t key_size = 0;     // d_k
  int64_t value_size = 0;   // d_v
  int64_t output_size = 0;  // multi_head: E; 0 = d_v

  // additive: W_q [h, d_q], W_k [h, d_k], w_v [1, h].
  // bilinear: W_k [d_q, d_k].
  // multi_head: W_q [E, d_q], W_k [E, d_k], W_v [E, d_v], W_o [E, E] and the
  // biases b_q, b_k, b_v, b_o [E] (zero when the file has none).
  RowMatrix w_q, w_k, w_v, w_o;
  Vector b_q, b_k, b_v, b_o;

  // multi_head: W_q, W_k, W_v and W_o with their biases, packed once for the
  // projection GEMM (core/packed_gemm.h) by PackProjections (LoadModel calls
  // it); empty until then, and the engine then uses the BLAS throughout.
  // The row-major copies above stay (the portable path still runs the
  // BLAS on them, and the loader's callers read them), so a model holds each
  // weight twice, row-major and packed, no more: self-attention's Q, K and V
  // are three products over the same tokens into one (tokens x 3E) buffer,
  // read from these packs, rather than a third, concatenated [W_q; W_k; W_v].
  // Copies of a model share the packed storage.
  PackedWeights packed_q, packed_k, packed_v, packed_o;
};

// Fills the packed_* weights of a multi_head model; does nothing for any
// other model.
void PackProjections(Model& model);

// The built-in models, present in every server.
Model DotProductModel();
Model DistanceModel();

}  // namespace attention
