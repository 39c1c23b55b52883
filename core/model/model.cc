// model.cc: kind and precision names, the built-in weightless models and the
// packing of multi_head projection weights.
#include "core/model/model.h"

#include <array>
#include <utility>

namespace attention {
namespace {

// The names of docs/api.md, one per Kind; the only place they are spelled.
constexpr std::array<std::pair<Kind, std::string_view>, 5> kKindNames = {{
    {Kind::kDotProduct, "dot_product"},
    {Kind::kDistance, "distance"},
    {Kind::kAdditive, "additive"},
    {Kind::kBilinear, "bilinear"},
    {Kind::kMultiHead, "multi_head"},
}};

constexpr std::array<std::pair<Precision, std::string_view>, 2> kPrecisionNames = {{
    {Precision::kFp32, "fp32"},
    {Precision::kBf16, "bf16"},
}};

// The name of `value` in `names`, or "unknown".
template <typename T, size_t N>
std::string_view NameIn(const std::array<std::pair<T, std::string_view>, N>& names, T value) {
  for (const auto& [v, name] : names) {
    if (v == value) return name;
  }
  return "unknown";
}

// The value named `name` in `names`.
template <typename T, size_t N>
std::optional<T> ValueIn(const std::array<std::pair<T, std::string_view>, N>& names,
                         std::string_view name) {
  for (const auto& [value, n] : names) {
    if (n == name) return value;
  }
  return std::nullopt;
}

}  // namespace

std::string_view KindName(Kind kind) { return NameIn(kKindNames, kind); }

std::optional<Kind> KindFromName(std::string_view name) { return ValueIn(kKindNames, name); }

std::string_view PrecisionName(Precision precision) { return NameIn(kPrecisionNames, precision); }

std::optional<Precision> PrecisionFromName(std::string_view name) {
  return ValueIn(kPrecisionNames, name);
}

int64_t KvHeads(const Model& model) {
  return model.num_kv_heads > 0 ? model.num_kv_heads : model.num_heads;
}

int64_t HeadSize(const Model& model) {
  if (model.head_size > 0) return model.head_size;
  return model.num_heads > 0 ? model.output_size / model.num_heads : 0;
}

int64_t QueryWidth(const Model& model) { return model.num_heads * HeadSize(model); }

int64_t KvWidth(const Model& model) { return KvHeads(model) * HeadSize(model); }

Model DotProductModel() {
  Model model;
  model.name = std::string(KindName(Kind::kDotProduct));
  model.kind = Kind::kDotProduct;
  return model;
}

void PackProjections(Model& model) {
  if (model.kind != Kind::kMultiHead) return;
  const auto pack = [&](RowMatrix& weight, Vector& bias, PackedWeights& packed) {
    packed = PackedWeights::Pack(weight.data(), weight.rows(), weight.cols(),
                                 bias.size() > 0 ? bias.data() : nullptr, model.precision);
    weight = RowMatrix();
    bias = Vector();
  };
  pack(model.w_q, model.b_q, model.packed_q);
  pack(model.w_k, model.b_k, model.packed_k);
  pack(model.w_v, model.b_v, model.packed_v);
  pack(model.w_o, model.b_o, model.packed_o);
}

void UnpackProjections(Model& model) {
  if (model.kind != Kind::kMultiHead || model.packed_q.empty()) return;
  const auto unpack = [](const PackedWeights& packed, RowMatrix& weight, Vector& bias) {
    weight.resize(packed.out_cols(), packed.in_cols());
    bias.resize(packed.out_cols());
    packed.Unpack(weight.data(), bias.data());
  };
  unpack(model.packed_q, model.w_q, model.b_q);
  unpack(model.packed_k, model.w_k, model.b_k);
  unpack(model.packed_v, model.w_v, model.b_v);
  unpack(model.packed_o, model.w_o, model.b_o);
}

Model DistanceModel() {
  Model model;
  model.name = std::string(KindName(Kind::kDistance));
  model.kind = Kind::kDistance;
  return model;
}

}  // namespace attention
