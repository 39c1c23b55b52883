// model.cc: kind names, the built-in weightless models and the packing of
// multi_head projection weights.
#include "core/model.h"

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

}  // namespace

std::string_view KindName(Kind kind) {
  for (const auto& [k, name] : kKindNames) {
    if (k == kind) return name;
  }
  return "unknown";
}

std::optional<Kind> KindFromName(std::string_view name) {
  for (const auto& [kind, n] : kKindNames) {
    if (n == name) return kind;
  }
  return std::nullopt;
}

Model DotProductModel() {
  Model model;
  model.name = std::string(KindName(Kind::kDotProduct));
  model.kind = Kind::kDotProduct;
  return model;
}

void PackProjections(Model& model) {
  if (model.kind != Kind::kMultiHead) return;
  const auto pack = [](const RowMatrix& weight, const Vector& bias) {
    return PackedWeights::Pack(weight.data(), weight.rows(), weight.cols(),
                               bias.size() > 0 ? bias.data() : nullptr);
  };
  model.packed_q = pack(model.w_q, model.b_q);
  model.packed_k = pack(model.w_k, model.b_k);
  model.packed_v = pack(model.w_v, model.b_v);
  model.packed_o = pack(model.w_o, model.b_o);
}

Model DistanceModel() {
  Model model;
  model.name = std::string(KindName(Kind::kDistance));
  model.kind = Kind::kDistance;
  return model;
}

}  // namespace attention
