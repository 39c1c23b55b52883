// model_loader.cc: LoadModel / ParseModel: a safetensors file to a Model.
//
// The file's tensors are matched against the names and shapes its kind needs;
// sizes are named symbols (E, d_q, h...) bound by the first tensor that has
// them, so a mismatch is reported with the numbers the earlier tensors fixed:
// "tensor 'W_o.weight' has shape [4, 5], expected [8, 8]". Every tensor must
// be used: an extra one (a typo, a bias this kind does not have, torch's
// bias_k) is an error rather than silently loading a different model.
//
// Decisions beyond docs/api.md:
// - "dot_product" and "distance" files are weightless aliases of the built-ins
//   (no tensors allowed, any sizes), so an operator can publish another name.
// - torch.nn.MultiheadAttention(bias=False) has neither in_proj_bias nor
//   out_proj.bias; both absent loads with zero biases, one alone is an error.
// - Metadata keys other than "kind", "num_heads" and "precision" (and, in
//   Hugging Face's layout, those layer_config.h reads) are ignored (writers
//   add e.g. "format"); "num_heads" on a kind without heads is an error. "precision" is accepted on every kind (only multi_head and the
//   dot_product alias have products it changes; the others stay fp32); an
//   unknown value is an error naming the key.
// - Non-finite weights are an error: they would turn every answer into NaN.
#include "core/model/model_loader.h"

#include <malloc.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <new>
#include <initializer_list>
#include <map>
#include <optional>
#include <system_error>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "core/model/layer_config.h"
#include "core/model/safetensors.h"
#include "core/status_macros.h"

namespace attention {
namespace {

constexpr absl::string_view kKindKey = "kind";
constexpr absl::string_view kNumHeadsKey = "num_heads";
constexpr absl::string_view kPrecisionKey = "precision";
constexpr absl::string_view kKvCacheDtypeKey = "kv_cache_dtype";

// Tensor names of the two multi-head layouts.
constexpr absl::string_view kD2lWeights[] = {"W_q.weight", "W_k.weight", "W_v.weight", "W_o.weight"};
constexpr absl::string_view kD2lBiases[] = {"W_q.bias", "W_k.bias", "W_v.bias", "W_o.bias"};
constexpr absl::string_view kTorchNames[] = {"in_proj_weight", "q_proj_weight", "k_proj_weight",
                                             "v_proj_weight",  "in_proj_bias",  "out_proj.weight",
                                             "out_proj.bias"};

absl::Status Invalid(absl::string_view message) { return absl::InvalidArgumentError(message); }

// One axis of an expected shape: `factor` times the size named `symbol`, or,
// with no symbol, the literal size `factor`.
struct Dim {
  absl::string_view symbol;
  int64_t factor = 1;
};
Dim Sym(absl::string_view symbol, int64_t factor = 1) { return {symbol, factor}; }
Dim Fixed(int64_t size) { return {"", size}; }

// The tensors of one file, handed out by name and checked against expected
// shapes. Sizes bound by one tensor constrain the later ones.
class Weights {
 public:
  explicit Weights(std::map<std::string, Tensor> tensors) : remaining_(std::move(tensors)) {}

  bool Has(absl::string_view name) const { return remaining_.contains(std::string(name)); }

  // The shape of tensor `name`, which Has().
  const std::vector<int64_t>& ShapeOf(absl::string_view name) const {
    return remaining_.at(std::string(name)).shape;
  }

  // The bound value of a size symbol; only valid after a Take() bound it.
  int64_t Size(absl::string_view symbol) const { return sizes_.at(symbol); }

  // Removes tensor `name`, which must have the `expected` shape and finite
  // values, and binds the size symbols it introduces.
  absl::StatusOr<Tensor> Take(absl::string_view name, std::initializer_list<Dim> expected) {
    auto it = remaining_.find(std::string(name));
    if (it == remaining_.end()) {
      return Invalid(absl::StrCat("missing tensor '", name, "' (expected shape ", Expected(expected), ")"));
    }
    const std::vector<int64_t>& shape = it->second.shape;
    std::map<absl::string_view, int64_t> sizes = sizes_;
    bool matches = shape.size() == expected.size();
    for (size_t axis = 0; matches && axis < shape.size(); ++axis) {
      const Dim& dim = expected.begin()[axis];
      const int64_t actual = shape[axis];
      if (dim.symbol.empty()) {
        matches = actual == dim.factor;
      } else if (auto bound = sizes.find(dim.symbol); bound != sizes.end()) {
        matches = actual == dim.factor * bound->second;
      } else {
        matches = actual > 0 && actual % dim.factor == 0;
        sizes.emplace(dim.symbol, actual / dim.factor);
      }
    }
    if (!matches) {
      return Invalid(absl::StrCat("tensor '", name, "' has shape ", ShapeString(shape), ", expected ",
                                  Expected(expected)));
    }
    for (size_t i = 0; i < it->second.data.size(); ++i) {
      if (!std::isfinite(it->second.data[i])) {
        return Invalid(absl::StrCat("tensor '", name, "' has the non-finite value ", it->second.data[i],
                                    " at element ", i));
      }
    }
    sizes_ = std::move(sizes);
    Tensor tensor = std::move(it->second);
    remaining_.erase(it);
    return tensor;
  }

  // Fails on the first tensor no Take() asked for.
  absl::Status CheckAllTaken(absl::string_view model_description) const {
    if (remaining_.empty()) return absl::OkStatus();
    return Invalid(absl::StrCat("unexpected tensor '", absl::CHexEscape(remaining_.begin()->first),
                                "' with shape ", ShapeString(remaining_.begin()->second.shape), " in ",
                                model_description));
  }

 private:
  // `expected` with the sizes bound so far filled in, e.g. "[8, d_k]".
  std::string Expected(std::initializer_list<Dim> expected) const {
    std::vector<std::string> dims;
    for (const Dim& dim : expected) {
      if (dim.symbol.empty()) {
        dims.push_back(absl::StrCat(dim.factor));
      } else if (auto bound = sizes_.find(dim.symbol); bound != sizes_.end()) {
        dims.push_back(absl::StrCat(dim.factor * bound->second));
      } else {
        dims.push_back(dim.factor == 1 ? std::string(dim.symbol) : absl::StrCat(dim.factor, dim.symbol));
      }
    }
    return absl::StrCat("[", absl::StrJoin(dims, ", "), "]");
  }

  std::map<std::string, Tensor> remaining_;
  std::map<absl::string_view, int64_t> sizes_;
};

// Rows [first_row, first_row + rows) of a row-major [*, cols] tensor.
RowMatrix Rows(const Tensor& tensor, int64_t first_row, int64_t rows) {
  const int64_t cols = tensor.shape[1];
  return Eigen::Map<const RowMatrix>(tensor.data.data() + first_row * cols, rows, cols);
}
RowMatrix Matrix(const Tensor& tensor) { return Rows(tensor, 0, tensor.shape[0]); }

// Elements [first, first + size) of a rank-1 tensor.
Vector Slice(const Tensor& tensor, int64_t first, int64_t size) {
  return Eigen::Map<const Vector>(tensor.data.data() + first, size);
}

// Strict decimal: digits only (no sign, no spaces), positive.
absl::StatusOr<int64_t> ParseNumHeads(absl::string_view text) {
  int64_t value = 0;
  const bool digits_only = !text.empty() && std::all_of(text.begin(), text.end(), absl::ascii_isdigit);
  if (!digits_only || !absl::SimpleAtoi(text, &value) || value <= 0) {
    return Invalid(absl::StrCat("__metadata__ \"", kNumHeadsKey, "\" is \"", absl::CHexEscape(text),
                                "\", expected a positive decimal integer"));
  }
  return value;
}

absl::Status LoadAdditive(Weights& weights, Model& model) {
  absl::StatusOr<Tensor> w_q = weights.Take("W_q.weight", {Sym("h"), Sym("d_q")});
  if (!w_q.ok()) return w_q.status();
  absl::StatusOr<Tensor> w_k = weights.Take("W_k.weight", {Sym("h"), Sym("d_k")});
  if (!w_k.ok()) return w_k.status();
  absl::StatusOr<Tensor> w_v = weights.Take("w_v.weight", {Fixed(1), Sym("h")});
  if (!w_v.ok()) return w_v.status();
  model.query_size = weights.Size("d_q");
  model.key_size = weights.Size("d_k");
  model.w_q = Matrix(*w_q);
  model.w_k = Matrix(*w_k);
  model.w_v = Matrix(*w_v);
  return weights.CheckAllTaken("an additive model (W_q.weight, W_k.weight, w_v.weight)");
}

absl::Status LoadBilinear(Weights& weights, Model& model) {
  absl::StatusOr<Tensor> w_k = weights.Take("W_k.weight", {Sym("d_q"), Sym("d_k")});
  if (!w_k.ok()) return w_k.status();
  model.query_size = weights.Size("d_q");
  model.key_size = weights.Size("d_k");
  model.w_k = Matrix(*w_k);
  return weights.CheckAllTaken("a bilinear model (W_k.weight)");
}

// Called once E is bound: heads split E evenly.
absl::Status CheckHeadsDivideWidth(const Model& model, int64_t width) {
  if (width % model.num_heads != 0) {
    return Invalid(
        absl::StrCat(kNumHeadsKey, " ", model.num_heads, " does not divide the model width E = ", width));
  }
  return absl::OkStatus();
}

// Takes the input projections W_q [E, query_in], W_k [E, d_k], W_v [E, d_v]
// under a layout's names into `model`, with the input sizes they give.
absl::Status TakeInputProjections(Weights& weights, absl::string_view q_name, absl::string_view k_name,
                                  absl::string_view v_name, Dim query_in, Model& model) {
  absl::StatusOr<Tensor> w_q = weights.Take(q_name, {Sym("E"), query_in});
  if (!w_q.ok()) return w_q.status();
  absl::StatusOr<Tensor> w_k = weights.Take(k_name, {Sym("E"), Sym("d_k")});
  if (!w_k.ok()) return w_k.status();
  absl::StatusOr<Tensor> w_v = weights.Take(v_name, {Sym("E"), Sym("d_v")});
  if (!w_v.ok()) return w_v.status();
  model.query_size = weights.Size(query_in.symbol);
  model.key_size = weights.Size("d_k");
  model.value_size = weights.Size("d_v");
  model.w_q = Matrix(*w_q);
  model.w_k = Matrix(*w_k);
  model.w_v = Matrix(*w_v);
  return absl::OkStatus();
}

// d2l.ai MultiHeadAttention: W_q/W_k/W_v [E, d_*], W_o [E, E], biases all or none.
absl::Status LoadD2lMultiHead(Weights& weights, Model& model) {
  RETURN_IF_ERROR(
      TakeInputProjections(weights, "W_q.weight", "W_k.weight", "W_v.weight", Sym("d_q"), model));
  const int64_t width = weights.Size("E");
  RETURN_IF_ERROR(CheckHeadsDivideWidth(model, width));
  absl::StatusOr<Tensor> w_o = weights.Take("W_o.weight", {Sym("E"), Sym("E")});
  if (!w_o.ok()) return w_o.status();
  model.output_size = width;
  model.w_o = Matrix(*w_o);

  std::vector<absl::string_view> present, absent;
  for (absl::string_view bias : kD2lBiases) (weights.Has(bias) ? present : absent).push_back(bias);
  Vector* biases[] = {&model.b_q, &model.b_k, &model.b_v, &model.b_o};
  if (present.empty()) {
    for (Vector* bias : biases) *bias = Vector::Zero(width);
  } else if (absent.empty()) {
    for (size_t i = 0; i < std::size(kD2lBiases); ++i) {
      absl::StatusOr<Tensor> bias = weights.Take(kD2lBiases[i], {Sym("E")});
      if (!bias.ok()) return bias.status();
      *biases[i] = Slice(*bias, 0, width);
    }
  } else {
    return Invalid(absl::StrCat("d2l layout has ", absl::StrJoin(present, ", "), " but not ",
                                absl::StrJoin(absent, ", "), ": give all four biases or none"));
  }
  return weights.CheckAllTaken("a d2l multi_head model");
}

// torch.nn.MultiheadAttention: packed in_proj_weight [3E, E] or separate
// q/k/v_proj_weight (kdim/vdim), in_proj_bias [3E], out_proj.weight [E, E],
// out_proj.bias [E].
absl::Status LoadTorchMultiHead(Weights& weights, Model& model) {
  absl::StatusOr<Tensor> out_weight = weights.Take("out_proj.weight", {Sym("E"), Sym("E")});
  if (!out_weight.ok()) return out_weight.status();
  const int64_t width = weights.Size("E");
  RETURN_IF_ERROR(CheckHeadsDivideWidth(model, width));
  model.w_o = Matrix(*out_weight);

  const bool separate =
      weights.Has("q_proj_weight") || weights.Has("k_proj_weight") || weights.Has("v_proj_weight");
  if (weights.Has("in_proj_weight") && separate) {
    return Invalid("has both in_proj_weight and q/k/v_proj_weight; torch writes one or the other");
  }
  if (separate) {
    RETURN_IF_ERROR(TakeInputProjections(weights, "q_proj_weight", "k_proj_weight",
                                         "v_proj_weight", Sym("E"), model));
  } else {
    if (!weights.Has("in_proj_weight")) {
      return Invalid(absl::StrCat("missing tensor 'in_proj_weight' (expected shape [", 3 * width, ", ", width,
                                  "]) or q_proj_weight, k_proj_weight and v_proj_weight"));
    }
    absl::StatusOr<Tensor> in_weight = weights.Take("in_proj_weight", {Sym("E", 3), Sym("E")});
    if (!in_weight.ok()) return in_weight.status();
    model.query_size = width;
    model.key_size = width;
    model.value_size = width;
    model.w_q = Rows(*in_weight, 0, width);
    model.w_k = Rows(*in_weight, width, width);
    model.w_v = Rows(*in_weight, 2 * width, width);
  }
  model.output_size = width;

  const bool has_in_bias = weights.Has("in_proj_bias");
  if (has_in_bias != weights.Has("out_proj.bias")) {
    return Invalid(absl::StrCat("has ", has_in_bias ? "in_proj_bias" : "out_proj.bias", " but not ",
                                has_in_bias ? "out_proj.bias" : "in_proj_bias",
                                ": torch writes both (bias=True) or neither (bias=False)"));
  }
  if (has_in_bias) {
    absl::StatusOr<Tensor> in_bias = weights.Take("in_proj_bias", {Sym("E", 3)});
    if (!in_bias.ok()) return in_bias.status();
    absl::StatusOr<Tensor> out_bias = weights.Take("out_proj.bias", {Sym("E")});
    if (!out_bias.ok()) return out_bias.status();
    model.b_q = Slice(*in_bias, 0, width);
    model.b_k = Slice(*in_bias, width, width);
    model.b_v = Slice(*in_bias, 2 * width, width);
    model.b_o = Slice(*out_bias, 0, width);
  } else {
    for (Vector* bias : {&model.b_q, &model.b_k, &model.b_v, &model.b_o}) *bias = Vector::Zero(width);
  }
  return weights.CheckAllTaken("a torch.nn.MultiheadAttention multi_head model");
}

// Hugging Face's attention modules: q_proj.weight [H hd, hidden],
// k_proj.weight and v_proj.weight [H_kv hd, hidden], o_proj.weight
// [hidden, H hd], each projection's .bias optional on its own, qk-norm
// weights [hd] (per head) or [H hd] / [H_kv hd] (the whole projection),
// sinks [H]; sizes and terms from the "config" metadata (layer_config.h).
absl::Status TakeHfProjection(Weights& weights, absl::string_view name, int64_t rows,
                              absl::string_view in, RowMatrix& weight, Vector& bias) {
  absl::StatusOr<Tensor> w = weights.Take(absl::StrCat(name, ".weight"), {Fixed(rows), Sym(in)});
  if (!w.ok()) return w.status();
  weight = Matrix(*w);
  const std::string bias_name = absl::StrCat(name, ".bias");
  if (!weights.Has(bias_name)) return absl::OkStatus();
  absl::StatusOr<Tensor> b = weights.Take(bias_name, {Fixed(rows)});
  if (!b.ok()) return b.status();
  bias = Slice(*b, 0, rows);
  return absl::OkStatus();
}

// An RMSNorm weight over one head (hd) or the whole projection (`width`).
absl::Status TakeNorm(Weights& weights, absl::string_view name, int64_t head_size, int64_t width,
                      std::vector<float>& norm) {
  if (!weights.Has(name)) return absl::OkStatus();
  const std::vector<int64_t>& shape = weights.ShapeOf(name);
  const bool per_head = shape.size() == 1 && shape[0] == head_size;
  absl::StatusOr<Tensor> tensor = weights.Take(name, {Fixed(per_head ? head_size : width)});
  if (!tensor.ok()) {
    return Invalid(absl::StrCat(tensor.status().message(), " or [", head_size, "] (one head)"));
  }
  norm = std::move(tensor->data);
  return absl::OkStatus();
}

absl::Status LoadHfMultiHead(Weights& weights, const std::map<std::string, std::string>& metadata,
                             Model& model) {
  ASSIGN_OR_RETURN(HfLayerConfig layer, ReadHfLayerConfig(metadata));
  const int64_t hd = layer.head_size;
  const int64_t query_width = layer.num_heads * hd, kv_width = layer.num_kv_heads * hd;
  RETURN_IF_ERROR(TakeHfProjection(weights, "q_proj", query_width, "hidden", model.w_q, model.b_q));
  const int64_t hidden = weights.Size("hidden");
  if (layer.hidden_size != 0 && layer.hidden_size != hidden) {
    return Invalid(absl::StrCat("tensor 'q_proj.weight' has ", hidden,
                                " columns, but config \"hidden_size\" is ", layer.hidden_size));
  }
  RETURN_IF_ERROR(TakeHfProjection(weights, "k_proj", kv_width, "hidden", model.w_k, model.b_k));
  RETURN_IF_ERROR(TakeHfProjection(weights, "v_proj", kv_width, "hidden", model.w_v, model.b_v));
  RETURN_IF_ERROR(TakeHfProjection(weights, "o_proj", hidden, "Hhd", model.w_o, model.b_o));
  if (weights.Size("Hhd") != query_width) {
    return Invalid(absl::StrCat("tensor 'o_proj.weight' has ", weights.Size("Hhd"),
                                " columns, expected H * head_dim = ", query_width));
  }
  RETURN_IF_ERROR(TakeNorm(weights, "q_norm.weight", hd, query_width, layer.terms.q_norm));
  RETURN_IF_ERROR(TakeNorm(weights, "k_norm.weight", hd, kv_width, layer.terms.k_norm));
  if (weights.Has("sinks")) {
    absl::StatusOr<Tensor> sinks = weights.Take("sinks", {Fixed(layer.num_heads)});
    if (!sinks.ok()) return sinks.status();
    layer.terms.sinks = std::move(sinks->data);
  }
  model.num_heads = layer.num_heads;
  model.num_kv_heads = layer.num_kv_heads;
  model.head_size = hd;
  model.query_size = model.key_size = model.value_size = model.output_size = hidden;
  model.terms = std::move(layer.terms);
  return weights.CheckAllTaken("a Hugging Face multi_head model");
}

// The "num_heads" key the d2l and torch layouts need.
absl::Status ReadNumHeads(const std::map<std::string, std::string>& metadata, Model& model) {
  const auto entry = metadata.find(std::string(kNumHeadsKey));
  if (entry == metadata.end()) {
    return Invalid(absl::StrCat("multi_head model has no __metadata__ \"", kNumHeadsKey, "\""));
  }
  ASSIGN_OR_RETURN(model.num_heads, ParseNumHeads(entry->second));
  return absl::OkStatus();
}

absl::Status LoadMultiHead(Weights& weights, const std::map<std::string, std::string>& metadata,
                           Model& model) {
  if (weights.Has("q_proj.weight") || weights.Has("o_proj.weight")) {
    return LoadHfMultiHead(weights, metadata, model);
  }
  const auto first_present = [&](auto& names) -> std::optional<absl::string_view> {
    for (absl::string_view name : names) {
      if (weights.Has(name)) return name;
    }
    return std::nullopt;
  };
  std::optional<absl::string_view> d2l = first_present(kD2lWeights);
  if (!d2l) d2l = first_present(kD2lBiases);
  const std::optional<absl::string_view> torch = first_present(kTorchNames);
  if (d2l && torch) {
    return Invalid(absl::StrCat("mixes the d2l layout ('", *d2l,
                                "') and the torch.nn.MultiheadAttention layout ('", *torch, "')"));
  }
  if (d2l || torch) RETURN_IF_ERROR(ReadNumHeads(metadata, model));
  if (d2l) return LoadD2lMultiHead(weights, model);
  if (torch) return LoadTorchMultiHead(weights, model);
  return Invalid(
      "multi_head model has neither the d2l tensors (W_q.weight, W_k.weight, W_v.weight, W_o.weight), "
      "the torch.nn.MultiheadAttention ones (in_proj_weight or q/k/v_proj_weight, out_proj.weight) "
      "nor Hugging Face's (q_proj.weight, k_proj.weight, v_proj.weight, o_proj.weight)");
}

// The "precision" key: fp32 when absent (or when `force_fp32`), else its
// value, which must be one PrecisionFromName knows.
absl::StatusOr<Precision> PrecisionOf(const SafetensorsFile& file, bool force_fp32) {
  const auto entry = file.metadata.find(std::string(kPrecisionKey));
  if (entry == file.metadata.end()) return Precision::kFp32;
  const std::optional<Precision> precision = PrecisionFromName(entry->second);
  if (!precision) {
    return Invalid(absl::StrCat("__metadata__ \"", kPrecisionKey, "\" is \"",
                                absl::CHexEscape(entry->second), "\", expected fp32 or bf16"));
  }
  return force_fp32 ? Precision::kFp32 : *precision;
}

// The "kv_cache_dtype" key, for every kind (each has sessions): none when
// absent, else its value, which must be one ParseKvDtype knows.
absl::StatusOr<std::optional<KvDtype>> KvCacheDtypeOf(const SafetensorsFile& file) {
  const auto entry = file.metadata.find(std::string(kKvCacheDtypeKey));
  if (entry == file.metadata.end()) return std::nullopt;
  const std::optional<KvDtype> dtype = ParseKvDtype(entry->second);
  if (!dtype) {
    return Invalid(absl::StrCat("__metadata__ \"", kKvCacheDtypeKey, "\" is \"",
                                absl::CHexEscape(entry->second), "\", expected ",
                                std::string(kKvDtypeNames)));
  }
  return dtype;
}

// Everything but the file name; ParseModel adds it.
absl::StatusOr<Model> ParseModelBytes(const std::string& name, std::span<const uint8_t> bytes,
                                      bool force_fp32) {
  absl::StatusOr<SafetensorsFile> file = ParseSafetensors(bytes);
  if (!file.ok()) return file.status();

  const auto kind_entry = file->metadata.find(std::string(kKindKey));
  if (kind_entry == file->metadata.end()) {
    return Invalid(
        absl::StrCat("__metadata__ has no \"", kKindKey, "\" (expected additive, bilinear or multi_head)"));
  }
  const std::optional<Kind> kind = KindFromName(kind_entry->second);
  if (!kind) {
    return Invalid(absl::StrCat("__metadata__ \"", kKindKey, "\" is \"", absl::CHexEscape(kind_entry->second),
                                "\", expected additive, bilinear or multi_head (or dot_product, distance)"));
  }
  Model model;
  model.name = name;
  model.kind = *kind;
  absl::StatusOr<Precision> precision = PrecisionOf(*file, force_fp32);
  if (!precision.ok()) return precision.status();
  // Only these kinds have products the precision changes (docs/api.md 5.5).
  if (*kind == Kind::kMultiHead || *kind == Kind::kDotProduct) model.precision = *precision;
  absl::StatusOr<std::optional<KvDtype>> kv_cache_dtype = KvCacheDtypeOf(*file);
  if (!kv_cache_dtype.ok()) return kv_cache_dtype.status();
  model.kv_cache_dtype = *kv_cache_dtype;

  const auto heads_entry = file->metadata.find(std::string(kNumHeadsKey));
  if (*kind != Kind::kMultiHead && heads_entry != file->metadata.end()) {
    return Invalid(absl::StrCat("__metadata__ \"", kNumHeadsKey, "\" is given, but a ",
                                std::string(KindName(*kind)), " model has no heads"));
  }

  const std::map<std::string, std::string> metadata = file->metadata;
  Weights weights(std::move(file->tensors));
  absl::Status status;
  switch (*kind) {
    case Kind::kDotProduct:
    case Kind::kDistance:
      status = weights.CheckAllTaken(
          absl::StrCat("a ", std::string(KindName(*kind)), " model (it has no weights)"));
      break;
    case Kind::kAdditive:
      status = LoadAdditive(weights, model);
      break;
    case Kind::kBilinear:
      status = LoadBilinear(weights, model);
      break;
    case Kind::kMultiHead:
      status = LoadMultiHead(weights, metadata, model);
      break;
  }
  if (!status.ok()) return status;
  PackProjections(model);
  return model;
}

absl::Status WithFile(absl::string_view file, const absl::Status& status) {
  return absl::Status(status.code(), absl::StrCat(file, ": ", status.message()));
}

// Reads and parses the `size` bytes of `path`. A model that does not fit in
// memory is a bad file for the caller to skip, not the end of the process.
absl::StatusOr<Model> ReadModel(const std::filesystem::path& path, uintmax_t size,
                                bool force_fp32) {
  const std::string file = path.string();
  try {
    std::vector<uint8_t> bytes(size);
    std::ifstream stream(path, std::ios::binary);
    if (!stream.read(reinterpret_cast<char*>(bytes.data()), static_cast<std::streamsize>(size))) {
      return absl::UnavailableError(absl::StrCat(file, ": could not read its ", size, " bytes"));
    }
    absl::StatusOr<Model> model = ParseModelBytes(path.stem().string(), bytes, force_fp32);
    if (!model.ok()) return WithFile(file, model.status());
    return model;
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError(
        absl::StrCat(file, ": out of memory while loading its ", size, " bytes"));
  }
}

}  // namespace

absl::StatusOr<Model> ParseModel(const std::string& name, std::span<const uint8_t> bytes,
                                 bool force_fp32) {
  absl::StatusOr<Model> model = ParseModelBytes(name, bytes, force_fp32);
  if (!model.ok()) return WithFile(absl::StrCat(name, ".safetensors"), model.status());
  return model;
}

absl::StatusOr<Model> LoadModel(const std::filesystem::path& path, uint64_t max_file_bytes,
                                bool force_fp32) {
  const std::string file = path.string();
  std::error_code error;
  const uintmax_t size = std::filesystem::file_size(path, error);
  if (error) return absl::ErrnoToStatus(error.value(), absl::StrCat(file, ": cannot read"));
  if (max_file_bytes > 0 && size > max_file_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        file, ": ", size, " bytes, more than the model file cap of ", max_file_bytes, " bytes"));
  }
  absl::StatusOr<Model> model = ReadModel(path, size, force_fp32);
  // The load freed about twice the file's size (its bytes, its tensors, the
  // row-major weights before packing) in blocks the allocator keeps rather
  // than return: eight E = 1024 models held 1.22x their weights' bytes of
  // resident memory with them kept, 0.98x with them returned (BENCHMARKS.md,
  // "Memory per model").
  malloc_trim(0);
  return model;
}

}  // namespace attention
