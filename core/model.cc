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

Model DistanceModel() {
  Model model;
  model.name = std::string(KindName(Kind::kDistance));
  model.kind = Kind::kDistance;
  return model;
}

}  // namespace attention
