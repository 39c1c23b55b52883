// model.h: what an attention model is to the engine.
//
// A model is a scoring function (its kind) plus the weights that function
// needs. The two built-ins, `dot_product` and `distance`, have no weights and
// accept any sizes. File models are made by LoadModel() (model_loader.h); the
// three multi-head layouts (d2l, torch.nn.MultiheadAttention and Hugging
// Face's) are normalised to one set of projections here, so the kernels see a
// single layout: H query heads and H_kv kv heads of head_size columns each,
// with the layer terms (layer_terms.h) of Hugging Face's decoder layers.
//
// Weights are stored as PyTorch stores them: [out, in], y = x W^T + b.
#pragma once

#include <Eigen/Core>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "core/kernels/float16.h"
#include "core/kernels/packed_weights.h"
#include "core/model/layer_terms.h"

namespace attention {

using RowMatrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using Vector = Eigen::VectorXf;

enum class Kind { kDotProduct, kDistance, kAdditive, kBilinear, kMultiHead };

// The name of a kind in docs/api.md: "dot_product", "distance", "additive",
// "bilinear", "multi_head".
std::string_view KindName(Kind kind);
std::optional<Kind> KindFromName(std::string_view name);

// The values of the file's "precision" metadata key (docs/api.md): "fp32",
// "bf16".
std::string_view PrecisionName(Precision precision);
std::optional<Precision> PrecisionFromName(std::string_view name);

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
  // multi_head: kv heads H_kv (a divisor of H; 0 = H) and the columns of one
  // head (0 = E / H). Query head h reads kv head h / (H / H_kv).
  int64_t num_kv_heads = 0;
  int64_t head_size = 0;
  // multi_head: what Hugging Face's layers add to the heads' attention
  // (rotary positions, qk-norm, window, soft-cap, sinks, ALiBi, the scale).
  LayerTerms terms;
  // What the products compute in (docs/api.md 5.5): multi_head's
  // projections and attention, dot_product's attention; the other kinds
  // report fp32.
  Precision precision = Precision::kFp32;
  // What this model's sessions hold their keys and values in, from the
  // file's __metadata__ "kv_cache_dtype" (docs/api.md section 5); none: the
  // server's --kv-cache-dtype.
  std::optional<KvDtype> kv_cache_dtype;

  // additive: W_q [h, d_q], W_k [h, d_k], w_v [1, h].
  // bilinear: W_k [d_q, d_k].
  // multi_head: W_q [H hd, d_q], W_k [H_kv hd, d_k], W_v [H_kv hd, d_v],
  // W_o [E, H hd] and the biases b_q, b_k, b_v, b_o (empty or zero when the
  // file has none; hd = head_size, H hd = H_kv hd = E in the older layouts), until
  // PackProjections moves them into the packed_* weights (LoadModel does);
  // empty after.
  RowMatrix w_q, w_k, w_v, w_o;
  Vector b_q, b_k, b_v, b_o;

  // multi_head: W_q, W_k, W_v and W_o with their biases, packed once for the
  // projection GEMM (core/kernels/packed_gemm.h) in the model's precision, the only
  // form a loaded model holds them in (one copy: self-attention's Q, K and V
  // are three products over the same tokens into one (tokens x 3E) buffer,
  // read from these packs, rather than a concatenated [W_q; W_k; W_v]).
  // Empty in a model built by hand and not packed: the engine then runs the
  // row-major weights above on the BLAS. Copies of a model share the packed
  // storage.
  PackedWeights packed_q, packed_k, packed_v, packed_o;
};

// multi_head sizes, with the defaults of the older layouts filled in: kv
// heads (H_kv), columns per head (hd), the query projection's width (H hd)
// and the key and value projections' (H_kv hd).
int64_t KvHeads(const Model& model);
int64_t HeadSize(const Model& model);
int64_t QueryWidth(const Model& model);
int64_t KvWidth(const Model& model);

// A multi_head model: packs its row-major weights and biases in its
// precision into packed_* and empties them. Does nothing for any other model.
void PackProjections(Model& model);

// The inverse, for tests and tools that read the row-major weights: fills
// w_*, b_* from the packs (as held: BF16-rounded in a bf16 model), which stay.
void UnpackProjections(Model& model);

// The built-in models, present in every server.
Model DotProductModel();
Model DistanceModel();

}  // namespace attention
