// model.cc: kind names and the built-in weightless models.
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

void PackSelfAttention(Model& model) {
  if (model.kind != Kind::kMultiHead || model.w_q.cols() != model.w_k.cols() ||
      model.w_q.cols() != model.w_v.cols()) {
    return;
  }
  const int64_t width = model.w_q.rows();
  model.w_qkv.resize(3 * width, model.w_q.cols());
  model.w_qkv << model.w_q, model.w_k, model.w_v;
  model.b_qkv.resize(3 * width);
  model.b_qkv << model.b_q, model.b_k, model.b_v;
}

Model DistanceModel() {
  Model model;
  model.name = std::string(KindName(Kind::kDistance));
  model.kind = Kind::kDistance;
  return model;
}

}  // namespace attention
